// What specjax's few-row products cost outside XLA: the kernel of
// specjax/models/fewrow.cc (compiled into this program) on a model's matrices, in a
// plain C++ loop with ideal threading. Built and run by `python -m experiments.kernel_floor`,
// which passes the shapes; see that module for what each table means.
//
//   kernel_floor K0 N0 K1 N1 ...      (one product per (K, N) pair, in forward order)
//
// Options in the environment: FLOOR_REPS (timed forwards per point), FLOOR_BF16=0
// (float32 panels), FLOOR_PREFETCH_MIN_BYTES (prefetch the weights of matrices this
// large, as `cpu_kernels.PREFETCH_MIN_BYTES`; default never), FLOOR_CHECK=1 (compare one
// product with a plain loop and exit).
#include "../specjax/models/fewrow.cc"

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

using Clock = std::chrono::steady_clock;

double Micros(Clock::time_point since) {
  return std::chrono::duration<double, std::micro>(Clock::now() - since).count();
}

// Multiply-adds on 10 independent register chains, no memory: the core's FMA peak
// (AVX2 + FMA; 0 where this build has neither).
double PeakGflops(int64_t n) {
#if defined(__x86_64__) && defined(__FMA__) && defined(__AVX2__)
  const auto start = Clock::now();
  int64_t left = n;
  asm volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n vxorps %%ymm1, %%ymm1, %%ymm1\n"
      "vxorps %%ymm2, %%ymm2, %%ymm2\n vxorps %%ymm3, %%ymm3, %%ymm3\n"
      "vxorps %%ymm4, %%ymm4, %%ymm4\n vxorps %%ymm5, %%ymm5, %%ymm5\n"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n vxorps %%ymm7, %%ymm7, %%ymm7\n"
      "vxorps %%ymm8, %%ymm8, %%ymm8\n vxorps %%ymm9, %%ymm9, %%ymm9\n"
      "vxorps %%ymm14, %%ymm14, %%ymm14\n vxorps %%ymm15, %%ymm15, %%ymm15\n"
      "1:\n"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm0\n vfmadd231ps %%ymm15, %%ymm14, %%ymm1\n"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm2\n vfmadd231ps %%ymm15, %%ymm14, %%ymm3\n"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm4\n vfmadd231ps %%ymm15, %%ymm14, %%ymm5\n"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm6\n vfmadd231ps %%ymm15, %%ymm14, %%ymm7\n"
      "vfmadd231ps %%ymm15, %%ymm14, %%ymm8\n vfmadd231ps %%ymm15, %%ymm14, %%ymm9\n"
      "dec %0\n jnz 1b\n"
      : "+r"(left)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
        "xmm14", "xmm15", "cc");
  return n * 10.0 * 16 / Micros(start) / 1e3;
#else
  (void)n;
  return 0.0;
#endif
}

struct Matrix {
  int64_t K, N;
  std::vector<float> w32;     // [N / 16, K, 16]
  std::vector<uint16_t> w16;  // pack_bf16's interleaved halves
};

bool g_bf16 = true, g_no_prefetch = false;
int64_t g_prefetch_min_bytes = INT64_MAX;

// Columns [n0, n1) of y = x · W for `rows` rows, as PanelMatmul's chunks run them.
void Columns(const Matrix& m, const float* x, float* y, int64_t rows, int64_t n0,
             int64_t n1) {
  const bool ahead =
      !g_no_prefetch && m.K * m.N * (g_bf16 ? 2 : 4) >= g_prefetch_min_bytes;
  if (g_bf16)
    ByRowGroups<uint16_t>(x, m.w16.data(), y, nullptr, rows, m.K, m.N, n0, n1, ahead);
  else
    ByRowGroups<float>(x, m.w32.data(), y, nullptr, rows, m.K, m.N, n0, n1, ahead);
}

// A second thread that claims chunks as PanelMatmul's pool thread does, but spins between
// products (no wake-up latency): the best case for the two-thread split.
struct Team {
  std::atomic<int64_t> generation{0}, finished{0};
  std::atomic<bool> stop{false};
  const std::vector<Matrix>* mats = nullptr;
  const float* x = nullptr;
  float* y = nullptr;
  int64_t rows = 1;
  std::vector<std::unique_ptr<std::atomic<int64_t>>> claims;

  void Work() {
    for (size_t i = 0; i < mats->size(); ++i) {
      const Matrix& m = (*mats)[i];
      const int64_t chunk = ChunkColumns(m.N / kPanel), n = (m.N + chunk - 1) / chunk;
      for (int64_t c; (c = claims[i]->fetch_add(1)) < n;)
        Columns(m, x, y, rows, c * chunk, std::min(m.N, (c + 1) * chunk));
    }
  }
};

// One forward's products; threads: 1, or 2 (the team's helper takes chunks too).
double Forward(Team& team, int threads) {
  for (auto& c : team.claims) c->store(0);
  const auto start = Clock::now();
  if (threads == 2) {
    const int64_t before = team.finished.load();
    team.generation.fetch_add(1);
    team.Work();
    while (team.finished.load() == before) __builtin_ia32_pause();
  } else {
    team.Work();
  }
  return Micros(start);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || argc % 2 == 0) {
    std::fprintf(stderr, "usage: kernel_floor K0 N0 [K1 N1 ...]\n");
    return 2;
  }
  g_bf16 = !(std::getenv("FLOOR_BF16") && std::string(std::getenv("FLOOR_BF16")) == "0");
  const int reps = std::getenv("FLOOR_REPS") ? std::atoi(std::getenv("FLOOR_REPS")) : 200;
  if (std::getenv("FLOOR_PREFETCH_MIN_BYTES"))
    g_prefetch_min_bytes = std::atoll(std::getenv("FLOOR_PREFETCH_MIN_BYTES"));
  std::vector<Matrix> mats;
  std::srand(0);
  for (int i = 1; i + 1 < argc; i += 2) {
    Matrix m{std::atoll(argv[i]), std::atoll(argv[i + 1]), {}, {}};
    if (m.K <= 0 || m.N <= 0 || m.N % kPanel) {
      std::fprintf(stderr, "each N must be a positive multiple of %d\n", kPanel);
      return 2;
    }
    m.w32.resize(m.K * m.N);
    m.w16.resize(m.K * m.N);
    // bfloat16 values (the low 16 bits zero), so both layouts hold the same weights.
    for (int64_t p = 0; p < m.N / kPanel; ++p)
      for (int64_t k = 0; k < m.K; ++k)
        for (int c = 0; c < kPanel; ++c) {
          const uint16_t bits = static_cast<uint16_t>(0x3c00 + std::rand() % 0x0400);
          uint32_t wide = static_cast<uint32_t>(bits) << 16;
          float f;
          std::memcpy(&f, &wide, sizeof(f));
          if (std::rand() & 1) f = -f;
          std::memcpy(&wide, &f, sizeof(f));
          m.w32[(p * m.K + k) * kPanel + c] = f;
          // pack_bf16: lane i of a panel row holds column i (low half), i + 8 (high)
          const int lane = c % 8, high = c / 8;
          m.w16[(p * m.K + k) * kPanel + 2 * lane + high] = static_cast<uint16_t>(wide >> 16);
        }
    mats.push_back(std::move(m));
  }
  int64_t max_k = 0, max_n = 0;
  double macs = 0, bytes = 0;
  for (const auto& m : mats) {
    max_k = std::max(max_k, m.K), max_n = std::max(max_n, m.N);
    macs += double(m.K) * m.N;
    bytes += double(m.K) * m.N * (g_bf16 ? 2 : 4);
  }
  std::vector<float> x(kRowGroup * 2 * max_k), y(kRowGroup * 2 * max_n);
  for (auto& v : x) v = (std::rand() % 2000 - 1000) / 1000.f;

  if (std::getenv("FLOOR_CHECK")) {  // the first product, 3 rows, against a plain loop
    const Matrix& m = mats[0];
    const int64_t rows = 3;
    Columns(m, x.data(), y.data(), rows, 0, m.N);
    double worst = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < m.N; ++j) {
        double ref = 0;
        for (int64_t k = 0; k < m.K; ++k)
          ref += double(x[r * m.K + k]) * m.w32[((j / kPanel) * m.K + k) * kPanel + j % kPanel];
        worst = std::max(worst, std::abs(ref - y[r * m.N + j]) / (1.0 + std::abs(ref)));
      }
    std::printf("max_rel_error %.3g\n", worst);
    return 0;
  }

  Team team;
  team.mats = &mats;
  team.x = x.data();
  team.y = y.data();
  for (size_t i = 0; i < mats.size(); ++i)
    team.claims.push_back(std::make_unique<std::atomic<int64_t>>(0));
  std::thread helper([&team] {
    int64_t seen = team.generation.load();
    while (!team.stop.load()) {
      if (team.generation.load() == seen) {
        __builtin_ia32_pause();
        continue;
      }
      seen = team.generation.load();
      team.Work();
      team.finished.fetch_add(1);
    }
  });
  std::printf("peak_gflops_per_core %.1f\n", PeakGflops(50000000));
  std::printf("matrices %zu macs_per_row %.0f weight_bytes %.0f bf16 %d\n", mats.size(), macs,
              bytes, int(g_bf16));
  for (int rows = 1; rows <= kRowGroup + 3; ++rows) {
    team.rows = rows;
    std::vector<double> one, two, plain;
    Forward(team, 1), Forward(team, 2);
    for (int i = 0; i < reps; ++i) {  // interleaved: the machine's speed drifts
      one.push_back(Forward(team, 1));
      two.push_back(Forward(team, 2));
      g_no_prefetch = true;
      plain.push_back(Forward(team, 2));
      g_no_prefetch = false;
    }
    std::printf("rows %d one_thread_us %.1f two_threads_us %.1f no_prefetch_us %.1f\n", rows,
                Median(one), Median(two), Median(plain));
  }
  team.stop.store(true);
  team.generation.fetch_add(1);
  helper.join();
  return 0;
}
