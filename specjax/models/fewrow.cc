// Few-row matrix products for XLA:CPU, y[R, N] = x[R, K] · W, registered as FFI targets
// by specjax/models/cpu_kernels.py and used for the 1..9 rows of a decode step or a
// verify pass. XLA:CPU multiplies 2..9 rows with a general multiply that repacks the
// weights on every call; these read each weight element once and use it for every row
// while it sits in a register, so a few more rows cost their arithmetic and little
// else (docs/ARCHITECTURE.md, "Why the verify pass costs what it does on a CPU").
//
//   SpecjaxPanelMatmul: W in panels, wp[N / 16, K, 16] (`cpu_kernels.pack`): a panel's
//     16 columns are contiguous for every k, so it is read as one sequential stream (W
//     [K, N] as it lies would be read 64 bytes per row, N floats apart: no prefetcher
//     follows that, and a forward runs 2-4x slower).
//
// The columns are split in chunks between the calling thread and one XLA pool thread.
// Each row's additions run in the same order whatever the number of rows, so a row of a
// verify pass gets the bits a 1-token step would. Generic vectors (GCC / Clang) keep the
// accumulators in registers; the build uses -march=native.
#include <algorithm>
#include <cmath>
#include <atomic>
#include <memory>
#include <thread>
#include <vector>
#include <cstdint>
#include <cstring>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 Load(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }

// Keeps a loaded weight vector in a register. Without it GCC folds the load into every
// multiply-add at 4 rows (8 loads per k instead of 2), and 4 rows took longer than 5.
inline void InRegister(v8& v) {
#if defined(__GNUC__) && defined(__x86_64__)
  asm("" : "+v"(v));
#endif
}

using Rows = ffi::Buffer<ffi::F32, 2>;  // aliases keep the commas out of the macros below
using Panels3 = ffi::Buffer<ffi::F32, 3>;
using Out = ffi::ResultBuffer<ffi::F32, 2>;

constexpr int kPanel = 16;  // columns per panel: two vectors
// Rows per pass over a panel: 2 accumulators a row, + 2 weights + 1 broadcast, within
// the 32 vector registers of AVX-512 (9 rows: a 9-token pass reads the weights once)
// or the 16 of AVX2.
#if defined(__AVX512VL__)
constexpr int kRowGroup = 9;
#else
constexpr int kRowGroup = 6;
#endif

// y[r, j0 : j0 + 16] for R rows from one panel p[K, 16].
template <int R>
inline void PanelRows(const float* x, const float* p, float* y, int64_t K, int64_t N,
                      int64_t j0) {
  v8 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = v8{};
  for (int64_t k = 0; k < K; ++k) {
    v8 w0 = Load(p + k * kPanel), w1 = Load(p + k * kPanel + 8);
    InRegister(w0), InRegister(w1);
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * K + k];
      acc[r][0] += xs * w0;
      acc[r][1] += xs * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    Store(y + r * N + j0, acc[r][0]);
    Store(y + r * N + j0 + 8, acc[r][1]);
  }
}

// Columns [n0, n1) of y for R rows.
template <int R>
void Panels(const float* x, const float* p, float* y, int64_t K, int64_t N, int64_t n0,
            int64_t n1) {
  for (int64_t j = n0; j < n1; j += kPanel) PanelRows<R>(x, p + j * K, y, K, N, j);
}

using Kernel = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t,
                        int64_t);
constexpr Kernel kPanels[] = {Panels<1>, Panels<2>, Panels<3>, Panels<4>, Panels<5>,
                              Panels<6>, Panels<7>, Panels<8>, Panels<9>};
// Columns [n0, n1): rows in groups of at most kRowGroup; a later group finds the
// weights in cache.
void ByRowGroups(const float* x, const float* w, float* y, int64_t rows, int64_t K,
                 int64_t N, int64_t n0, int64_t n1) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
    const int64_t r = std::min<int64_t>(kRowGroup, rows - r0);
    kPanels[r - 1](x + r0 * K, w, y + r0 * N, K, N, n0, n1);
  }
}

// fn(i) for i in [0, n), claimed in turn by the calling thread and one pool thread.
// The caller never waits for an item nobody has claimed, so a busy pool costs only
// speed; a helper that starts late finds nothing left and touches no buffer.
struct Claims {
  std::atomic<int64_t> next{0}, done{0};
};

template <typename F>
void ForEach(ffi::ThreadPool& pool, int64_t n, F fn) {
  auto claims = std::make_shared<Claims>();
  auto work = [=]() {
    for (int64_t i; (i = claims->next.fetch_add(1)) < n;) {
      fn(i);
      claims->done.fetch_add(1, std::memory_order_release);
    }
  };
  if (n > 1 && pool.num_threads() > 1) pool.Schedule(decltype(work)(work));  // a copy
  work();
  // The helper may have been preempted mid-item (a loaded machine): yield, don't spin.
  while (claims->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, Rows x, Panels3 wp, Out y) {
  const auto xd = x.dimensions(), wd = wp.dimensions();
  if (wd[2] != kPanel || wd[1] != xd[1] || y->dimensions()[1] != wd[0] * kPanel)
    return ffi::Error::InvalidArgument("SpecjaxPanelMatmul: shapes do not match");
  const float *xp = x.typed_data(), *w = wp.typed_data();
  float* yp = y->typed_data();
  const int64_t rows = xd[0], K = xd[1], N = wd[0] * kPanel;
  // The columns in 8 chunks of whole panels.
  const int64_t chunk = (wd[0] + 7) / 8 * kPanel;
  ForEach(pool, (N + chunk - 1) / chunk, [=](int64_t c) {
    ByRowGroups(xp, w, yp, rows, K, N, c * chunk, std::min(N, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

// Attention of T new queries over the first length[b] cached slots and the T new keys
// (causal), for the G query heads that share each KV head. Reads only the valid slots,
// and each cached key and value once for all T·G queries of its head. Every step of a
// query's arithmetic is the same whatever T is (the same blocks, sums and exp from its
// first slot on), so a verify-pass row gets the bits of the 1-token step at its position.
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 Broadcast(float f) { return v8{} + f; }

// [Σ a[0], Σ a[1], Σ a[2], Σ a[3]], each sum in a fixed order.
inline void Sum4(const v8 a[4], float out[4]) {
#if defined(__AVX__)
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a[0], (__m256)a[1]),
                                  _mm256_hadd_ps((__m256)a[2], (__m256)a[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  for (int i = 0; i < 4; ++i) {
    float s = 0.f;
    for (int l = 0; l < 8; ++l) s += a[i][l];
    out[i] = s;
  }
#endif
}

inline float Sum(v8 v) {
  const v8 a[4] = {v, v8{}, v8{}, v8{}};
  float out[4];
  Sum4(a, out);
  return out[0];
}

// e^x for x <= 0 (Cephes' expf: 2^n times a degree-6 polynomial; within 2 ulp of
// std::exp, 0 below -87). Eight at a time: the softmax's exps were a third of the kernel.
inline v8 Exp(v8 x) {
  const v8i under = x < Broadcast(-87.0f);
  x = x < Broadcast(-87.0f) ? Broadcast(-87.0f) : x;
  const v8 magic = Broadcast(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const v8 t = x * 1.44269504088896341f + magic;
  const v8 n = t - magic;
  const v8 r = x - n * 0.693359375f - n * -2.12194440e-4f;
  v8 p = Broadcast(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v8 y = p * r * r + r + 1.0f;
  const v8i scale = ((v8i)t - (v8i)magic + 127) << 23;
  return (v8)((v8i)(y * (v8)scale) & ~under);
}

// s[r][0..3] = q_r · key_i for R (1 or 2) queries and 4 keys: 4R independent chains.
template <int R>
inline void Dots4(const float* const q[R], const float* const keys[4], int64_t D,
                  float s[R][4]) {
  v8 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) a[r][i] = v8{};
  for (int64_t d = 0; d + 8 <= D; d += 8) {
    v8 k[4];
    for (int i = 0; i < 4; ++i) k[i] = Load(keys[i] + d);
    for (int r = 0; r < R; ++r) {
      const v8 qv = Load(q[r] + d);
      for (int i = 0; i < 4; ++i) a[r][i] += qv * k[i];
    }
  }
  for (int r = 0; r < R; ++r) Sum4(a[r], s[r]);
}

// o_r[0:8V] = Σ_j w_r[j] value(j) over j < seen_r for R (1 or 2) rows; each value
// vector is read once for the R rows. seen_0 <= seen_1.
template <int V, int R, typename ValueOf>
inline void WeightedSum(const float* const w[R], const int64_t seen[R], ValueOf value,
                        float* const o[R]) {
  v8 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = v8{};
  int64_t j = 0;
  for (; j < seen[0]; ++j) {
    const float* val = value(j);
    for (int v = 0; v < V; ++v) {
      const v8 x = Load(val + 8 * v);
      for (int r = 0; r < R; ++r) acc[r][v] += w[r][j] * x;
    }
  }
  for (; j < seen[R - 1]; ++j) {  // the later row's last slots
    const float* val = value(j);
    for (int v = 0; v < V; ++v) acc[R - 1][v] += w[R - 1][j] * Load(val + 8 * v);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(o[r] + 8 * v, acc[r][v]);
}

template <int V, typename ValueOf>
inline void WeightedSums(float* const* w, const int64_t* seen, ValueOf value,
                         float* const* o, int64_t rows) {
  // Two rows share each value load where their accumulators fit in the registers.
  constexpr int kPair = (V * 2 + 2 <= (kRowGroup == 9 ? 32 : 16)) ? 2 : 1;
  int64_t r = 0;
  for (; kPair == 2 && r + 2 <= rows; r += 2)
    WeightedSum<V, 2>(w + r, seen + r, value, o + r);
  for (; r < rows; ++r) WeightedSum<V, 1>(w + r, seen + r, value, o + r);
}

inline int64_t RoundUp8(int64_t n) { return (n + 7) / 8 * 8; }

// q, out [T, H, D] and kn, vn [T, KVH, D] of one row; kb, vb [len, D] of its head kh.
// scores: T * G rows of RoundUp8(len + T) + 8 floats.
void AttendHead(const float* q, const float* kn, const float* vn, const float* kb,
                const float* vb, float* out, int64_t len, int64_t T, int64_t H,
                int64_t KVH, int64_t D, int64_t kh, float* scores) {
  const int64_t G = H / KVH, width = len + T, stride = RoundUp8(width) + 8, rows = T * G;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  auto key = [&](int64_t j) { return j < len ? kb + j * D : kn + ((j - len) * KVH + kh) * D; };
  auto value = [&](int64_t j) { return j < len ? vb + j * D : vn + ((j - len) * KVH + kh) * D; };
  std::vector<const float*> qs(rows);
  std::vector<float*> w(rows), o(rows);
  std::vector<int64_t> seen(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / G, head = t * H + kh * G + r % G;
    qs[r] = q + head * D, o[r] = out + head * D, w[r] = scores + r * stride;
    seen[r] = len + t + 1;  // causal over the new keys
  }
  // scores[r][j]: j < len a cached slot, len + u new key u. D % 8 == 0 (checked).
  for (int64_t j0 = 0; j0 < width; j0 += 4) {
    const float* keys[4];
    for (int i = 0; i < 4; ++i) keys[i] = key(std::min(j0 + i, width - 1));
    int64_t r = 0;
    float s[2][4];
    for (; r + 2 <= rows; r += 2) {
      Dots4<2>(&qs[r], keys, D, s);
      for (int i = 0; i < 4; ++i) w[r][j0 + i] = s[0][i] * scale, w[r + 1][j0 + i] = s[1][i] * scale;
    }
    for (; r < rows; ++r) {
      Dots4<1>(&qs[r], keys, D, s);
      for (int i = 0; i < 4; ++i) w[r][j0 + i] = s[0][i] * scale;
    }
  }
  v8i lane;
  for (int l = 0; l < 8; ++l) lane[l] = l;
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = w[r];
    float m = sc[0];
    for (int64_t j = 1; j < seen[r]; ++j) m = std::max(m, sc[j]);
    v8 total{};
    for (int64_t j = 0; j < seen[r]; j += 8) {  // slots past seen: 0, in the padding
      const v8 e = Exp(Load(sc + j) - m);
      const v8 kept = (v8)((v8i)e & (lane + (int32_t)j < (int32_t)seen[r]));
      Store(sc + j, kept);
      total += kept;
    }
    const float inv = 1.f / Sum(total);
    for (int64_t j = 0; j < seen[r]; ++j) sc[j] *= inv;
  }
  switch (D) {
    case 32: WeightedSums<4>(w.data(), seen.data(), value, o.data(), rows); break;
    case 64: WeightedSums<8>(w.data(), seen.data(), value, o.data(), rows); break;
    case 128: WeightedSums<16>(w.data(), seen.data(), value, o.data(), rows); break;
    default:
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t d = 0; d < D; ++d) o[r][d] = 0.f;
        for (int64_t j = 0; j < seen[r]; ++j)
          for (int64_t d = 0; d < D; ++d) o[r][d] += w[r][j] * value(j)[d];
      }
  }
}

using Heads = ffi::Buffer<ffi::F32, 4>;
using Lengths = ffi::Buffer<ffi::S32, 1>;

ffi::Error CachedAttention(ffi::ThreadPool pool, Heads q, Heads kn, Heads vn, Heads kb,
                           Heads vb, Lengths length, ffi::ResultBuffer<ffi::F32, 4> out) {
  const auto qd = q.dimensions(), bd = kb.dimensions();
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3], KVH = bd[1], S = bd[2];
  if (kn.dimensions()[2] != KVH || bd[3] != D || H % KVH || D % 8 ||
      length.dimensions()[0] != B)
    return ffi::Error::InvalidArgument("SpecjaxCachedAttention: shapes do not match");
  const float *qp = q.typed_data(), *knp = kn.typed_data(), *vnp = vn.typed_data();
  const float *kbp = kb.typed_data(), *vbp = vb.typed_data();
  const int32_t* lens = length.typed_data();
  float* op = out->typed_data();
  ForEach(pool, B * KVH, [=](int64_t unit) {
    const int64_t b = unit / KVH, kh = unit % KVH;
    const int64_t len = std::min<int64_t>(std::max<int32_t>(lens[b], 0), S);
    std::vector<float> scores(T * (H / KVH) * (RoundUp8(len + T) + 8));
    const int64_t slots = ((b * KVH + kh) * S) * D;
    AttendHead(qp + b * T * H * D, knp + b * T * KVH * D, vnp + b * T * KVH * D,
               kbp + slots, vbp + slots, op + b * T * H * D, len, T, H, KVH, D, kh,
               scores.data());
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows>()
                                  .Arg<Panels3>()
                                  .Ret<Rows>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCachedAttention, CachedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Heads>()
                                  .Arg<Heads>()
                                  .Arg<Heads>()
                                  .Arg<Heads>()
                                  .Arg<Heads>()
                                  .Arg<Lengths>()
                                  .Ret<Heads>());
