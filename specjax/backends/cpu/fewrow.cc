// Few-row matrix products for XLA:CPU, y[R, N] = x[R, K] · W, registered as FFI targets
// by specjax/backends/cpu/kernels.py and used for the 1..9 rows of a decode step or a
// verify pass. XLA:CPU multiplies 2..9 rows with a general multiply that repacks the
// weights on every call; these read each weight element once and use it for every row
// while it sits in a register, so a few more rows cost their arithmetic and little
// else (docs/ARCHITECTURE.md, "Why a step costs what it does").
//
//   SpecjaxPanelMatmul: W in panels, wp[N / 16, K, 16] (`kernels.pack`): a panel's
//     16 columns are contiguous for every k, so it is read as one sequential stream (W
//     [K, N] as it lies would be read 64 bytes per row, N floats apart: no prefetcher
//     follows that, and a forward runs 2-4x slower). It also does the RMSNorm or
//     SwiGLU before a product and the residual add after it. SpecjaxPanelMatmulBf16:
//     the same over bfloat16 panels (`kernels.pack_bf16`), half the bytes to stream
//     for the same float32 products where every weight is a bfloat16 value.
//   SpecjaxCachedAttention: attention of a few new queries over the valid cache slots.
//   SpecjaxRopeAttention: a layer's RoPE, attention and KV write in one call.
//   SpecjaxTop: argmax and support size of each row (the T = 0 verify rule).
//   SpecjaxPanelLookup(Bf16): embedding rows from the tied LM head's panels.
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

typedef uint32_t v8u __attribute__((vector_size(32)));

// A panel row's 16 weights as two vectors (columns 0-7, 8-15). bfloat16 panels
// (`kernels.pack_bf16`) hold column i in the low half of 32-bit lane i and column
// i + 8 in the high half: one load, and a shift or a mask makes each float32 exactly.
inline void LoadPanel(const float* p, v8& lo, v8& hi) {
  lo = Load(p);
  hi = Load(p + 8);
}

inline void LoadPanel(const uint16_t* p, v8& lo, v8& hi) {
  v8u raw;
  std::memcpy(&raw, p, sizeof(raw));
  lo = (v8)(raw << 16);
  hi = (v8)(raw & 0xFFFF0000u);
}

// Column c of a panel row, as float32.
inline float PanelAt(const float* p, int64_t c) { return p[c]; }

inline float PanelAt(const uint16_t* p, int64_t c) {
  const uint32_t bits = static_cast<uint32_t>(p[c < 8 ? 2 * c : 2 * (c - 8) + 1]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Keeps a loaded weight vector in a register. Without it GCC folds the load into every
// multiply-add at 4 rows (8 loads per k instead of 2), and 4 rows took longer than 5.
inline void InRegister(v8& v) {
#if defined(__GNUC__) && defined(__x86_64__)
  asm("" : "+v"(v));
#endif
}

using Rows = ffi::Buffer<ffi::F32, 2>;  // aliases keep the commas out of the macros below
using Vec = ffi::Buffer<ffi::F32, 1>;
using Panels3 = ffi::Buffer<ffi::F32, 3>;
using PanelsBf16 = ffi::Buffer<ffi::BF16, 3>;
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

// How far ahead of its loads a product over weights from memory asks for them.
constexpr int64_t kAheadBytes = 4096;

// y[r, j0 : j0 + 16 P] for R rows from P consecutive panels p[P, K, 16]. Each output
// column is summed over k in order whatever R and P are; P > 1 gives a few rows more
// independent multiply-add chains (one row of one panel is two chains, each waiting
// out the multiply-add latency at every k). Ahead: software prefetch kAheadBytes ahead
// in every panel, once per cache line; for weights that come from memory, where the
// hardware prefetcher fell behind a product of 3 or more rows (it only changes when
// the bytes arrive, never the sums).
template <int R, int P, typename W, bool Ahead>
inline void PanelRows(const float* x, const W* p, float* y, const float* add,
                      int64_t K, int64_t N, int64_t j0) {
  constexpr int64_t kRowBytes = kPanel * sizeof(W), kLine = 64 / kRowBytes;
  v8 acc[R][2 * P];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * P; ++c) acc[r][c] = v8{};
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (Ahead) {
      if (k % kLine == 0)
        for (int c = 0; c < P; ++c)
          __builtin_prefetch(p + (c * K + k + kAheadBytes / kRowBytes) * kPanel);
    }
    v8 w[2 * P];
    for (int c = 0; c < P; ++c) {
      LoadPanel(p + (c * K + k) * kPanel, w[2 * c], w[2 * c + 1]);
      InRegister(w[2 * c]), InRegister(w[2 * c + 1]);
    }
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * K + k];
      for (int c = 0; c < 2 * P; ++c) acc[r][c] += xs * w[c];
    }
  }
  if (add) {  // the residual stream: add + x·W, as XLA adds them
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2 * P; ++c) acc[r][c] = Load(add + r * N + j0 + 8 * c) + acc[r][c];
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * P; ++c) Store(y + r * N + j0 + 8 * c, acc[r][c]);
}

// Panels per pass for R rows: at least 8 chains where the registers hold them
// (accumulators 2RP + weights 2P + a broadcast).
template <int R>
constexpr int PanelsPerPass() {
#if defined(__AVX512VL__)
  return R == 1 ? 4 : R <= 3 ? 2 : 1;
#else
  return R <= 2 ? 2 : 1;
#endif
}

// Columns [n0, n1) of y for R rows.
template <int R, typename W, bool Ahead>
void Panels(const float* x, const W* p, float* y, const float* add, int64_t K,
            int64_t N, int64_t n0, int64_t n1) {
  constexpr int P = PanelsPerPass<R>();
  int64_t j = n0;
  for (; j + P * kPanel <= n1; j += P * kPanel)
    PanelRows<R, P, W, Ahead>(x, p + j * K, y, add, K, N, j);
  for (; j < n1; j += kPanel) PanelRows<R, 1, W, Ahead>(x, p + j * K, y, add, K, N, j);
}

template <typename W>
using Kernel = void (*)(const float*, const W*, float*, const float*, int64_t, int64_t,
                        int64_t, int64_t);
template <typename W, bool Ahead>
constexpr Kernel<W> kPanels[] = {
    Panels<1, W, Ahead>, Panels<2, W, Ahead>, Panels<3, W, Ahead>,
    Panels<4, W, Ahead>, Panels<5, W, Ahead>, Panels<6, W, Ahead>,
    Panels<7, W, Ahead>, Panels<8, W, Ahead>, Panels<9, W, Ahead>};
// Columns [n0, n1): rows in groups of at most kRowGroup; a later group finds the
// weights in cache. ahead (a matrix too large to stay in cache): prefetch its weights
// (PanelRows) for 3 or more rows; 1 or 2 rows keep up with the weights unaided, and
// prefetching made them a few percent slower.
template <typename W>
void ByRowGroups(const float* x, const W* w, float* y, const float* add, int64_t rows,
                 int64_t K, int64_t N, int64_t n0, int64_t n1, bool ahead = false) {
  const auto& kernels = ahead && rows >= 3 ? kPanels<W, true> : kPanels<W, false>;
  for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
    const int64_t r = std::min<int64_t>(kRowGroup, rows - r0);
    kernels[r - 1](x + r0 * K, w, y + r0 * N, add ? add + r0 * N : nullptr, K, N, n0, n1);
  }
}

// A thread's scratch array of n T (slot I: the arrays one call uses at once), kept for the
// next call: a call allocates nothing once the sizes are reached (a malloc per array
// and head was a tenth of a 1-token step's attention).
template <typename T, int I>
T* Scratch(int64_t n) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// fn(i) for i in [0, n), claimed in turn by the calling thread and one pool thread.
// The caller never waits for an item nobody has claimed, so a busy pool costs only
// speed; a helper that starts late finds nothing left and touches no buffer.
struct Claims {
  std::atomic<int64_t> next{0}, done{0};
};

template <typename F>
void ForEach(ffi::ThreadPool& pool, int64_t n, F fn, bool parallel = true) {
  if (!parallel) {  // too little work to pay for waking a pool thread
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
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

// Vector helpers: sums in a fixed order, exp.
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

// o = silu(gate) · up, 8 at a time (a scalar exp per hidden unit cost more than the
// product): sigmoid(g) from e = exp(-|g|) <= 1, as 1 / (1 + e) or e / (1 + e).
inline void Swiglu(const float* gate, const float* up, float* o, int64_t K) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const v8 g = Load(gate + k);
    const v8 e = Exp(g < 0 ? g : -g);
    const v8 sig = (g < 0 ? e : Broadcast(1.0f)) / (1.0f + e);
    Store(o + k, g * sig * Load(up + k));
  }
  for (; k < K; ++k) o[k] = gate[k] / (1.0f + std::exp(-gate[k])) * up[k];
}

// How many of each `period` rows are in use: live [1] (a traced count, clipped to
// [0, period]) or all of them (live [0]). A verify pass is as wide as the round's
// longest possible draft; its rows past the longest actual one are not computed.
using Live = ffi::Buffer<ffi::S32, 1>;

inline int64_t InUse(const Live& live, int64_t period) {
  if (live.dimensions()[0] == 0) return period;
  return std::min<int64_t>(std::max<int32_t>(live.typed_data()[0], 0), period);
}

// Columns per chunk of a product over `panels` panels split between two threads: up to
// 8 chunks of whole passes (4 panels).
inline int64_t ChunkColumns(int64_t panels) { return ((panels + 7) / 8 + 3) / 4 * 4 * kPanel; }

// y = in(x) · W (+ add), W in panels. in(x) is x; with `gated`, x = [gate | up] and
// in(x) = silu(gate) · up (SwiGLU's hidden units); with a scale [K], RMSNorm of that
// (eps): the small ops around a product, done on its rows in the same pass instead of
// in XLA thunks of their own. add [R, N] (or [0, 0]) is the residual stream. Of each
// `period` rows (0: all R) only the first `live` are computed; the others are zeros.
// ahead: prefetch the weights (PanelRows), for a matrix too large to stay in cache.
template <typename PanelBuffer>
ffi::Error PanelMatmul(ffi::ThreadPool pool, Rows x, PanelBuffer wp, Vec scale, Rows add,
                       Live live, Out y, bool parallel, float eps, bool gated,
                       int64_t period, bool ahead) {
  const auto xd = x.dimensions(), wd = wp.dimensions();
  const int64_t rows = xd[0], K = wd[1], N = wd[0] * kPanel;
  const bool norm = scale.dimensions()[0] > 0, residual = add.dimensions()[0] > 0;
  const int64_t per = period > 0 ? period : rows;
  if (wd[2] != kPanel || xd[1] != (gated ? 2 * K : K) || y->dimensions()[1] != N ||
      (norm && scale.dimensions()[0] != K) || (per > 0 && rows % per) ||
      live.dimensions()[0] > 1 ||
      (residual && (add.dimensions()[0] != rows || add.dimensions()[1] != N)))
    return ffi::Error::InvalidArgument("SpecjaxPanelMatmul: shapes do not match");
  const int64_t used = per > 0 ? InUse(live, per) : 0, groups = per > 0 ? rows / per : 0;
  const float* xp = x.typed_data();
  float* staged = nullptr;
  if (norm || gated) {
    staged = Scratch<float, 0>(rows * K);
    const float* g = scale.typed_data();
    for (int64_t r = 0; r < rows; ++r) {
      if (r % per >= used) continue;
      const float* in = xp + r * xd[1];
      float* o = staged + r * K;
      if (gated)
        Swiglu(in, in + K, o, K);
      else
        std::memcpy(o, in, K * sizeof(float));
      if (norm) {
        v8 acc{};
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) acc += Load(o + k) * Load(o + k);
        float squares = Sum(acc);
        for (; k < K; ++k) squares += o[k] * o[k];
        const float inv = 1.0f / std::sqrt(squares / K + eps);
        for (int64_t k = 0; k < K; ++k) o[k] = o[k] * (inv * g[k]);  // grouped as nnx.RMSNorm does
      }
    }
    xp = staged;
  }
  float* yp = y->typed_data();
  const float* ap = residual ? add.typed_data() : nullptr;
  for (int64_t g = 0; g < groups; ++g)  // the rows not in use
    std::memset(yp + (g * per + used) * N, 0, (per - used) * N * sizeof(float));
  const int64_t chunk = parallel ? ChunkColumns(wd[0]) : N;
  const auto* w = wp.typed_data();
  if (used == 0) return ffi::Error::Success();
  ForEach(pool, (N + chunk - 1) / chunk, [=](int64_t c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, (c + 1) * chunk);
    if (used == per) {  // every row: row groups run across the periods
      ByRowGroups(xp, w, yp, ap, rows, K, N, n0, n1, ahead);
      return;
    }
    for (int64_t g = 0; g < groups; ++g)
      ByRowGroups(xp + g * per * K, w, yp + g * per * N, ap ? ap + g * per * N : nullptr,
                  used, K, N, n0, n1, ahead);
  }, parallel);
  return ffi::Error::Success();
}

// Attention of T new queries over the first length[b] cached slots and the T new keys
// (causal), for the G query heads that share each KV head. Reads only the valid slots,
// and each cached key and value once for all T·G queries of its head. Every step of a
// query's arithmetic is the same whatever T is (the same blocks, sums and exp from its
// first slot on), so a verify-pass row gets the bits of the 1-token step at its position.

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
  const float** qs = Scratch<const float*, 0>(rows);
  float** w = Scratch<float*, 0>(rows);
  float** o = Scratch<float*, 1>(rows);
  int64_t* seen = Scratch<int64_t, 0>(rows);
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
    float s[4][4];
    // Four queries per key load where AVX-512's registers hold their 16 sums.
    for (; kRowGroup == 9 && r + 4 <= rows; r += 4) {
      Dots4<4>(&qs[r], keys, D, s);
      for (int q = 0; q < 4; ++q)
        for (int i = 0; i < 4; ++i) w[r + q][j0 + i] = s[q][i] * scale;
    }
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
    int64_t j = 0;  // the max in vectors (the same value in any order)
    if (seen[r] >= 8) {
      v8 mv = Load(sc);
      for (j = 8; j + 8 <= seen[r]; j += 8) {
        const v8 x = Load(sc + j);
        mv = x > mv ? x : mv;
      }
      for (int l = 0; l < 8; ++l) m = std::max(m, mv[l]);
    }
    for (; j < seen[r]; ++j) m = std::max(m, sc[j]);
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
  switch (D) {  // in vectors for the common head dims (48: the shipped draft's)
    case 16: WeightedSums<2>(w, seen, value, o, rows); break;
    case 32: WeightedSums<4>(w, seen, value, o, rows); break;
    case 48: WeightedSums<6>(w, seen, value, o, rows); break;
    case 64: WeightedSums<8>(w, seen, value, o, rows); break;
    case 80: WeightedSums<10>(w, seen, value, o, rows); break;
    case 96: WeightedSums<12>(w, seen, value, o, rows); break;
    case 128: WeightedSums<16>(w, seen, value, o, rows); break;
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
    float* scores = Scratch<float, 1>(T * (H / KVH) * (RoundUp8(len + T) + 8));
    const int64_t slots = ((b * KVH + kh) * S) * D;
    AttendHead(qp + b * T * H * D, knp + b * T * KVH * D, vnp + b * T * KVH * D,
               kbp + slots, vbp + slots, op + b * T * H * D, len, T, H, KVH, D, kh,
               scores);
  });
  return ffi::Error::Success();
}


// RoPE (rotate-half) of one head vector: y[i] = x[i] c[i] - x[i + h] s[i],
// y[i + h] = x[i + h] c[i] + x[i] s[i], i < h = D / 2.
inline void Rope(const float* x, const float* c, const float* s, float* y, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    y[i] = x[i] * c[i] - x[i + half] * s[i];
    y[i + half] = x[i + half] * c[i] + x[i] * s[i];
  }
}

using Fused = ffi::Buffer<ffi::F32, 3>;

// A layer's attention from its raw qkv projection [B, T, (H + 2 KVH) D]: RoPE of the new
// q and k (cos, sin [B, T, D / 2]), attention as CachedAttention, and the new k and v
// written to slots length[b] + t of the caches, which are the outputs' buffers
// (aliased): no rotated copies, scatters or cache copies around the call. A slot past
// the end is dropped (as kv_cache.write drops it). Each unit (row, KV head) reads and
// writes only its own head's slots. Only each row's first `live` tokens are attended
// and written (the rest of out: zeros).
ffi::Error RopeAttention(ffi::ThreadPool pool, Fused qkv, Fused cos, Fused sin, Heads kb,
                         Heads vb, Lengths length, Live live,
                         ffi::ResultBuffer<ffi::F32, 3> out,
                         ffi::ResultBuffer<ffi::F32, 4> kout,
                         ffi::ResultBuffer<ffi::F32, 4> vout) {
  const auto xd = qkv.dimensions(), bd = kb.dimensions(), od = out->dimensions();
  const int64_t B = xd[0], KVH = bd[1], S = bd[2], D = bd[3];
  const int64_t H = D ? od[2] / D : 0, half = D / 2, W = xd[2];
  if (D % 8 || H % KVH || H == 0 || W != (H + 2 * KVH) * D || bd[0] != B ||
      cos.dimensions()[2] != half || length.dimensions()[0] != B ||
      live.dimensions()[0] > 1)
    return ffi::Error::InvalidArgument("SpecjaxRopeAttention: shapes do not match");
  const int64_t period = xd[1], T = InUse(live, period);
  const float *xp = qkv.typed_data(), *cp = cos.typed_data(), *sp = sin.typed_data();
  const float *kin = kb.typed_data(), *vin = vb.typed_data();
  float *kp = kout->typed_data(), *vp = vout->typed_data(), *op = out->typed_data();
  const int32_t* lens = length.typed_data();
  const int64_t G = H / KVH;
  for (int64_t b = 0; b < B; ++b)  // the tokens not in use
    std::memset(op + (b * period + T) * H * D, 0, (period - T) * H * D * sizeof(float));
  ForEach(pool, B * KVH, [=](int64_t unit) {
    const int64_t b = unit / KVH, kh = unit % KVH;
    const int64_t start = std::max<int32_t>(lens[b], 0), len = std::min(start, S);
    const int64_t slots = ((b * KVH + kh) * S) * D;
    if (kp != kin) std::memcpy(kp + slots, kin + slots, S * D * sizeof(float));
    if (vp != vin) std::memcpy(vp + slots, vin + slots, S * D * sizeof(float));
    // The unit's heads of the new tokens, in CachedAttention's [T, H, D] / [T, KVH, D].
    float *q = Scratch<float, 2>(T * H * D), *k = Scratch<float, 3>(T * KVH * D);
    float* v = Scratch<float, 4>(T * KVH * D);
    for (int64_t t = 0; t < T; ++t) {
      const float* row = xp + (b * period + t) * W;
      const float *c = cp + (b * period + t) * half, *s = sp + (b * period + t) * half;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head = kh * G + g;
        Rope(row + head * D, c, s, q + (t * H + head) * D, half);
      }
      Rope(row + (H + kh) * D, c, s, k + (t * KVH + kh) * D, half);
      std::memcpy(v + (t * KVH + kh) * D, row + (H + KVH + kh) * D, D * sizeof(float));
    }
    float* scores = Scratch<float, 1>(T * G * (RoundUp8(len + T) + 8));
    AttendHead(q, k, v, kp + slots, vp + slots, op + b * period * H * D,
               len, T, H, KVH, D, kh, scores);
    for (int64_t t = 0; t < T && start + t < S; ++t) {
      const int64_t at = slots + (start + t) * D, from = (t * KVH + kh) * D;
      std::memcpy(kp + at, k + from, D * sizeof(float));
      std::memcpy(vp + at, v + from, D * sizeof(float));
    }
  });
  return ffi::Error::Success();
}

// argmax over the last axis of x [R, V] (the first maximum; the first NaN if there is
// one, as jnp.argmax), and how many entries are > 0 (a point mass has one). XLA:CPU
// splits every reduction over a vocabulary into three thunks (two reduce-windows and a
// reduce), and an argmax is two reductions: six small ops per draft step and pass,
// against one call here.
ffi::Error Top(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> index,
               ffi::ResultBuffer<ffi::S32> count) {
  const auto xd = x.dimensions();
  const int64_t V = xd.size() ? xd[xd.size() - 1] : 0, R = V ? x.element_count() / V : 0;
  if (V == 0 || index->element_count() != R || count->element_count() != R)
    return ffi::Error::InvalidArgument("SpecjaxTop: shapes do not match");
  const float* xp = x.typed_data();
  int32_t *ip = index->typed_data(), *cp = count->typed_data();
  for (int64_t r = 0; r < R; ++r) {
    const float* row = xp + r * V;
    v8 top = Broadcast(-INFINITY), positive{};
    v8i nan{};
    int64_t j = 0;
    for (; j + 8 <= V; j += 8) {
      const v8 v = Load(row + j);
      top = v > top ? v : top;
      nan |= (v8i)(v != v);
      positive += (v8)((v8i)(v > 0.0f) & (v8i)Broadcast(1.0f));
    }
    float m = -INFINITY, n = 0.f;
    bool any_nan = false;
    for (int l = 0; l < 8; ++l) m = std::max(m, top[l]), any_nan |= nan[l] != 0, n += positive[l];
    for (; j < V; ++j) m = std::max(m, row[j]), any_nan |= row[j] != row[j], n += row[j] > 0.0f;
    int64_t at = 0;
    if (any_nan) {
      while (row[at] == row[at]) ++at;
    } else {
      while (row[at] != m) ++at;
    }
    ip[r] = static_cast<int32_t>(at);
    cp[r] = static_cast<int32_t>(n);
  }
  return ffi::Error::Success();
}

// Rows of an embedding table laid out as the tied LM head's panels [V / 16, d, 16]:
// out[r] = column tokens[r] (clipped to [0, V)). XLA's gather of a few such strided
// columns cost several times this loop, which reads each column once.
template <typename PanelBuffer>
ffi::Error PanelLookup(ffi::Buffer<ffi::S32> tokens, PanelBuffer wp,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto wd = wp.dimensions();
  const int64_t V = wd[0] * kPanel, K = wd[1], R = tokens.element_count();
  if (wd[2] != kPanel || out->element_count() != R * K || V == 0)
    return ffi::Error::InvalidArgument("SpecjaxPanelLookup: shapes do not match");
  const int32_t* tp = tokens.typed_data();
  const auto* w = wp.typed_data();
  float* op = out->typed_data();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = std::min<int64_t>(std::max<int32_t>(tp[r], 0), V - 1);
    const auto* panel = w + (t / kPanel) * K * kPanel;
    for (int64_t k = 0; k < K; ++k) op[r * K + k] = PanelAt(panel + k * kPanel, t % kPanel);
  }
  return ffi::Error::Success();
}

}  // namespace

// One binding per panel type (float32 or bfloat16 panels).
template <typename PanelBuffer>
auto PanelLookupBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<PanelBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

template <typename PanelBuffer>
auto PanelMatmulBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<Rows>()
      .Arg<PanelBuffer>()
      .template Arg<Vec>()
      .template Arg<Rows>()
      .template Arg<Live>()
      .template Ret<Rows>()
      .template Attr<bool>("parallel")
      .template Attr<float>("eps")
      .template Attr<bool>("gated")
      .template Attr<int64_t>("period")
      .template Attr<bool>("ahead");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanelLookup, PanelLookup<Panels3>,
                              PanelLookupBinding<Panels3>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanelLookupBf16, PanelLookup<PanelsBf16>,
                              PanelLookupBinding<PanelsBf16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanelMatmul, PanelMatmul<Panels3>,
                              PanelMatmulBinding<Panels3>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPanelMatmulBf16, PanelMatmul<PanelsBf16>,
                              PanelMatmulBinding<PanelsBf16>());
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
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRopeAttention, RopeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Fused>()
                                  .Arg<Fused>()
                                  .Arg<Fused>()
                                  .Arg<Heads>()
                                  .Arg<Heads>()
                                  .Arg<Lengths>()
                                  .Arg<Live>()
                                  .Ret<Fused>()
                                  .Ret<Heads>()
                                  .Ret<Heads>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxTop, Top,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
