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
//   SpecjaxRowsDot: W [N, K] as it lies (an embedding used as the LM head): each output
//     is a dot product along contiguous memory.
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

using Rows = ffi::Buffer<ffi::F32, 2>;  // aliases keep the commas out of the macros below
using Panels3 = ffi::Buffer<ffi::F32, 3>;
using Out = ffi::ResultBuffer<ffi::F32, 2>;

constexpr int kPanel = 16;  // columns per panel: two vectors
constexpr int kRowGroup = 6;  // rows per pass over a panel: 12 accumulators + 2 loads

// y[r, j0 : j0 + 16] for R rows from one panel p[K, 16].
template <int R>
inline void PanelRows(const float* x, const float* p, float* y, int64_t K, int64_t N,
                      int64_t j0) {
  v8 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = v8{};
  for (int64_t k = 0; k < K; ++k) {
    const v8 w0 = Load(p + k * kPanel), w1 = Load(p + k * kPanel + 8);
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

// y[r, n] for R rows and the two rows n, n + 1 of e[N, K].
template <int R>
inline void DotPair(const float* x, const float* e, float* y, int64_t K, int64_t N,
                    int64_t n, int pair) {
  v8 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = v8{};
  const float* e0 = e + n * K;
  const float* e1 = e + (n + pair - 1) * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const v8 w0 = Load(e0 + k), w1 = Load(e1 + k);
    for (int r = 0; r < R; ++r) {
      const v8 xv = Load(x + r * K + k);
      acc[r][0] += xv * w0;
      acc[r][1] += xv * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < pair; ++i) {
      float s = 0.f;
      for (int l = 0; l < 8; ++l) s += acc[r][i][l];
      for (int64_t kk = k; kk < K; ++kk) s += x[r * K + kk] * (i ? e1 : e0)[kk];
      y[r * N + n + i] = s;
    }
  }
}

// Columns [n0, n1) of y for R rows.
template <int R>
void Panels(const float* x, const float* p, float* y, int64_t K, int64_t N, int64_t n0,
            int64_t n1) {
  for (int64_t j = n0; j < n1; j += kPanel) PanelRows<R>(x, p + j * K, y, K, N, j);
}

template <int R>
void Dots(const float* x, const float* e, float* y, int64_t K, int64_t N, int64_t n0,
          int64_t n1) {
  for (int64_t n = n0; n < n1; n += 2) DotPair<R>(x, e, y, K, N, n, n + 1 < n1 ? 2 : 1);
}

using Kernel = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t,
                        int64_t);
constexpr Kernel kPanels[kRowGroup] = {Panels<1>, Panels<2>, Panels<3>,
                                       Panels<4>, Panels<5>, Panels<6>};
constexpr Kernel kDots[kRowGroup] = {Dots<1>, Dots<2>, Dots<3>, Dots<4>, Dots<5>, Dots<6>};

// Columns [n0, n1): rows in groups of at most kRowGroup; a later group finds the
// weights in cache.
void ByRowGroups(const Kernel* table, const float* x, const float* w, float* y,
                 int64_t rows, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
    const int64_t r = std::min<int64_t>(kRowGroup, rows - r0);
    table[r - 1](x + r0 * K, w, y + r0 * N, K, N, n0, n1);
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

// The columns in 8 chunks of whole panels (or pairs).
void Parallel(ffi::ThreadPool& pool, const Kernel* table, const float* x, const float* w,
              float* y, int64_t rows, int64_t K, int64_t N, int64_t align) {
  constexpr int64_t kChunks = 8;
  const int64_t chunk = std::max<int64_t>(align, (N / kChunks + align - 1) / align * align);
  ForEach(pool, (N + chunk - 1) / chunk, [=](int64_t c) {
    ByRowGroups(table, x, w, y, rows, K, N, c * chunk, std::min(N, (c + 1) * chunk));
  });
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, Rows x, Panels3 wp, Out y) {
  const auto xd = x.dimensions(), wd = wp.dimensions();
  if (wd[2] != kPanel || wd[1] != xd[1] || y->dimensions()[1] != wd[0] * kPanel)
    return ffi::Error::InvalidArgument("SpecjaxPanelMatmul: shapes do not match");
  Parallel(pool, kPanels, x.typed_data(), wp.typed_data(), y->typed_data(), xd[0], xd[1],
           wd[0] * kPanel, kPanel);
  return ffi::Error::Success();
}

ffi::Error RowsDot(ffi::ThreadPool pool, Rows x, Rows e, Out y) {
  const auto xd = x.dimensions(), ed = e.dimensions();
  if (ed[1] != xd[1] || y->dimensions()[1] != ed[0])
    return ffi::Error::InvalidArgument("SpecjaxRowsDot: shapes do not match");
  Parallel(pool, kDots, x.typed_data(), e.typed_data(), y->typed_data(), xd[0], xd[1],
           ed[0], 2);
  return ffi::Error::Success();
}

// Attention of T new queries over the first length[b] cached slots and the T new keys
// (causal), for the G query heads that share each KV head. Reads only the valid slots,
// and each cached key and value once for all T·G queries of its head.
// Σ a[d] b[d] in eight lanes, then across them.
inline float Dot(const float* a, const float* b, int64_t n) {
  v8 acc{};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) acc += Load(a + d) * Load(b + d);
  float s = 0.f;
  for (int l = 0; l < 8; ++l) s += acc[l];
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// q, out [T, H, D] and kn, vn [T, KVH, D] of one row; kb, vb [len, D] of its head kh.
void AttendHead(const float* q, const float* kn, const float* vn, const float* kb,
                const float* vb, float* out, int64_t len, int64_t T, int64_t H,
                int64_t KVH, int64_t D, int64_t kh, float* scores) {
  const int64_t G = H / KVH, width = len + T, rows = T * G;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // scores[(t * G + g) * width + j]: j < len a cached slot, len + u the new key u.
  for (int64_t j = 0; j < width; ++j) {
    const float* key = j < len ? kb + j * D : kn + ((j - len) * KVH + kh) * D;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const float* qv = q + (t * H + kh * G + g) * D;
        scores[(t * G + g) * width + j] = Dot(qv, key, D) * scale;
      }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / G, seen = len + t + 1;  // causal over the new keys
    float* sc = scores + r * width;
    float m = sc[0];
    for (int64_t j = 1; j < seen; ++j) m = std::max(m, sc[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < seen; ++j) sum += (sc[j] = std::exp(sc[j] - m));
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < seen; ++j) sc[j] *= inv;
    for (int64_t j = seen; j < width; ++j) sc[j] = 0.f;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / G, g = r % G;
    float* o = out + (t * H + kh * G + g) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
  }
  for (int64_t j = 0; j < width; ++j) {
    const float* val = j < len ? vb + j * D : vn + ((j - len) * KVH + kh) * D;
    for (int64_t r = 0; r < rows; ++r) {
      const float w = scores[r * width + j];
      if (w == 0.f) continue;
      const int64_t t = r / G, g = r % G;
      float* o = out + (t * H + kh * G + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += w * val[d];
    }
  }
}

using Heads = ffi::Buffer<ffi::F32, 4>;
using Lengths = ffi::Buffer<ffi::S32, 1>;

ffi::Error CachedAttention(ffi::ThreadPool pool, Heads q, Heads kn, Heads vn, Heads kb,
                           Heads vb, Lengths length, ffi::ResultBuffer<ffi::F32, 4> out) {
  const auto qd = q.dimensions(), bd = kb.dimensions();
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3], KVH = bd[1], S = bd[2];
  if (kn.dimensions()[2] != KVH || bd[3] != D || H % KVH || length.dimensions()[0] != B)
    return ffi::Error::InvalidArgument("SpecjaxCachedAttention: shapes do not match");
  const float *qp = q.typed_data(), *knp = kn.typed_data(), *vnp = vn.typed_data();
  const float *kbp = kb.typed_data(), *vbp = vb.typed_data();
  const int32_t* lens = length.typed_data();
  float* op = out->typed_data();
  ForEach(pool, B * KVH, [=](int64_t unit) {
    const int64_t b = unit / KVH, kh = unit % KVH;
    const int64_t len = std::min<int64_t>(std::max<int32_t>(lens[b], 0), S);
    std::vector<float> scores(T * (H / KVH) * (len + T));
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
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowsDot, RowsDot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows>()
                                  .Arg<Rows>()
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
