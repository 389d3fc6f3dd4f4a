// FlashAttention forward and backward for the CPU, as XLA FFI custom calls (jax_impl/cpu_kernel).
//
// The same algorithm as the Pallas kernels and the xla path (FlashAttention-2, the online
// softmax in base 2 with scale * log2(e) folded into one multiply-add per logit), fused so that
// a tile never leaves the caches between its products: the forward works one (batch row, head,
// query tile) at a time, the backward one (batch row, kv head, chunk of key tiles). Every
// product is one register-blocked microkernel (`Gemm`): C[M, N] (+)= A[M, K] B[K, N], A read one
// scalar at a time through two strides (so P^T and dS^T need no transposed copy), B in rows of
// SIMD vectors.
//
// Layouts (float32): the forward takes q [B, Lq, Hq, D] as the library holds it, K^T in panels
// of 64 keys and v head-major; the backward takes every array head-major [B, H, L, D]. XLA makes
// these copies once per call (__init__.py). Row statistics and delta are [B, Hq, Lq]. The mask
// is the band d_lo[b] <= j - i <= d_hi[b] inside i < q_len[b], j < kv_len[b], and segment ids
// when given (masking.py's rules 1-4). Non-finite values follow online_softmax's rule: on a tile
// that evaluates a mask, q, k, v enter the products with their non-finite entries as 0 and a
// pair whose query row or key row (k or v) holds one gets a NaN logit.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;  // floats per SIMD vector
constexpr int MR = 6, NV = 4;  // microkernel: MR rows x NV vectors = 24 of 32 registers
#elif defined(__AVX__)
constexpr int W = 8;
constexpr int MR = 3, NV = 4;  // 12 of 16 registers
#else
constexpr int W = 4;
constexpr int MR = 3, NV = 4;
#endif
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return x - vf{}; }  // x - 0 folds to a broadcast (x + 0 would not: -0)

constexpr float LOG2_E = 1.4426950408889634f;
constexpr float NEG_INF = -INFINITY;

// 2^x for x <= 0.5 (every use: logits minus a row max): exactly 0 below 2^-125, NaN kept.
// Cephes exp2f: x = i + f, |f| <= 1/2, 2^f by a degree-6 polynomial (about 2 ulp).
inline vf exp2_fraction(vf f) {
  vf p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  return p * f + 1.0f;
}
inline vf exp2v(vf x) {
  vf xc = x < -125.0f ? splat(-125.0f) : x;  // a NaN compares false and stays NaN
  vi i = __builtin_convertvector(xc - 0.5f, vi);  // round to nearest for xc <= 0.5
  vf p = exp2_fraction(xc - __builtin_convertvector(i, vf));
  vi bits = (i + 127) << 23;
  vf two_i; std::memcpy(&two_i, &bits, sizeof two_i);
  return x < -125.0f ? splat(0.0f) : p * two_i;
}

// C[m, nv*W] (+)= sum_k A[r*ar + k*ak] * B[k*ldb + c], m <= MR rows, nv <= NV vectors.
template <int M, int N>
void micro(int64_t K, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb,
           float* C, int64_t ldc, bool accumulate) {
  vf acc[M][N];
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) acc[r][c] = accumulate ? load(C + r * ldc + c * W) : splat(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    vf b[N];
    for (int c = 0; c < N; ++c) b[c] = load(B + k * ldb + c * W);
    for (int r = 0; r < M; ++r) {
      vf a = splat(A[r * ar + k * ak]);
      for (int c = 0; c < N; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) store(C + r * ldc + c * W, acc[r][c]);
}

// micro<rows, nv> for rows <= M and nv <= N known only at run time (the tiles' edges).
template <int M, int N>
void micro_edge(int rows, int nv, int64_t K, const float* A, int64_t ar, int64_t ak,
                const float* B, int64_t ldb, float* C, int64_t ldc, bool acc) {
  if constexpr (M > 1) {
    if (rows < M) return micro_edge<M - 1, N>(rows, nv, K, A, ar, ak, B, ldb, C, ldc, acc);
  }
  if constexpr (N > 1) {
    if (nv < N) return micro_edge<M, N - 1>(rows, nv, K, A, ar, ak, B, ldb, C, ldc, acc);
  }
  micro<M, N>(K, A, ar, ak, B, ldb, C, ldc, acc);
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
inline bool finite(float x) { return std::fabs(x) < INFINITY; }

// B operands are read in panels of PW columns: element (k, c) of B is at
// B[(c / PW) * panel + k * ldb + c % PW]. A row-major B is panel = PW; a packed K^T tile is
// ldb = PW, panel = D * PW, so that each microkernel call streams one contiguous block.
constexpr int64_t PW = 64;
static_assert(PW % (NV * W) == 0, "a microkernel call stays inside one panel");

// C[M, N] (+)= A[M, K] B[K, N]; N a multiple of W. A's element (r, k) is A[r*ar + k*ak].
void Gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t ar, int64_t ak,
          const float* B, int64_t ldb, int64_t panel, float* C, int64_t ldc, bool accumulate) {
  for (int64_t c0 = 0; c0 < N; c0 += NV * W) {
    int nv = static_cast<int>(std::min<int64_t>(NV, (N - c0) / W));
    for (int64_t r0 = 0; r0 < M; r0 += MR) {
      const float* a = A + r0 * ar;
      float* c = C + r0 * ldc + c0;
      const float* b = B + (c0 / PW) * panel + c0 % PW;
      micro_edge<MR, NV>(static_cast<int>(std::min<int64_t>(MR, M - r0)), nv, K, a, ar, ak, b, ldb,
                         c, ldc, accumulate);
    }
  }
}

// Runs fn(item) for item in [0, n) on the caller and XLA's intra-op threads. Items are handed
// out by an atomic counter; the caller returns once all are done, and a task that starts late
// finds none left and touches nothing.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, F fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto drain = [state, n](const F* f) {
    for (int64_t item; (item = state->next.fetch_add(1)) < n;) {
      (*f)(item);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([drain, f = &fn]() { drain(f); });
  drain(&fn);
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// One call's shapes and mask, per batch row b.
struct Problem {
  int64_t B, Lq, Lk, Hq, Hkv, D;
  const int32_t *q_len, *kv_len, *d_lo, *d_hi, *q_seg, *kv_seg;  // segments may be null
  float scale;
  int64_t groups() const { return Hq / Hkv; }
  int64_t qlen(int64_t b) const { return std::clamp<int64_t>(q_len[b], 0, Lq); }
  int64_t kvlen(int64_t b) const { return std::clamp<int64_t>(kv_len[b], 0, Lk); }
  // Key range [lo, hi) that rows [i0, i1) may see (i1 already clipped to qlen).
  void key_range(int64_t b, int64_t i0, int64_t i1, int64_t* lo, int64_t* hi) const {
    *lo = std::max<int64_t>(0, i0 + d_lo[b]);
    *hi = std::min<int64_t>(kvlen(b), i1 - 1 + int64_t{d_hi[b]} + 1);
    if (i1 <= i0) *hi = *lo;
  }
  void query_range(int64_t b, int64_t j0, int64_t j1, int64_t* lo, int64_t* hi) const {
    *lo = std::max<int64_t>(0, j0 - int64_t{d_hi[b]});
    *hi = std::min<int64_t>(qlen(b), j1 - 1 - int64_t{d_lo[b]} + 1);
    if (j1 <= j0) *hi = *lo;
  }
  // Whether every pair of rows [i0, i1) x keys [j0, j1) is allowed (no per-element mask).
  bool whole(int64_t b, int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    return q_seg == nullptr && i1 <= qlen(b) && j1 <= kvlen(b) && j0 - (i1 - 1) >= d_lo[b] &&
           (j1 - 1) - i0 <= d_hi[b];
  }
};

// The mask on the logits of query row i against keys [j0, j0 + n): -inf where rules 1-4 forbid
// the pair, NaN at an allowed pair whose query row or key row (k or v) holds a non-finite value
// when `sanitize` (the tile's operands were cleaned: online_softmax's non-finite rule). Rules 1-3
// allow one interval of keys per row, filled without a per-element test.
void MaskRow(const Problem& P, int64_t b, int64_t i, int64_t j0, int64_t n, float* row,
             bool sanitize, bool q_bad, const uint8_t* k_bad, const uint8_t* v_bad) {
  int64_t lo = 0, hi = 0;
  if (i < P.qlen(b)) {
    lo = std::clamp<int64_t>(i + int64_t{P.d_lo[b]} - j0, 0, n);
    hi = std::clamp<int64_t>(std::min<int64_t>(P.kvlen(b), i + int64_t{P.d_hi[b]} + 1) - j0, lo, n);
  }
  std::fill(row, row + lo, NEG_INF);
  std::fill(row + hi, row + n, NEG_INF);
  if (P.q_seg == nullptr && !sanitize) return;
  const int32_t* kv_seg = P.q_seg == nullptr ? nullptr : P.kv_seg + b * P.Lk + j0;
  const int32_t q_seg = P.q_seg == nullptr ? 0 : P.q_seg[b * P.Lq + i];
  for (int64_t c = lo; c < hi; ++c) {
    if (kv_seg != nullptr && kv_seg[c] != q_seg) row[c] = NEG_INF;
    else if (sanitize && (q_bad || (k_bad && k_bad[c]) || (v_bad && v_bad[c]))) row[c] = NAN;
  }
}

// Copies n rows of D floats (row stride `stride`) into dst [n, D], non-finite entries as 0 when
// `sanitize`; returns whether any row held a non-finite value (and sets bad[r] unless null).
bool CopyRows(const float* src, int64_t stride, int64_t n, int64_t D, float* dst, bool sanitize,
              uint8_t* bad) {
  bool any = false;
  for (int64_t r = 0; r < n; ++r) {
    const float* s = src + r * stride;
    bool row_bad = false;
    for (int64_t d = 0; d < D; ++d) {
      float x = s[d];
      if (!finite(x)) { row_bad = true; if (sanitize) x = 0.0f; }
      dst[r * D + d] = x;
    }
    if (bad != nullptr) bad[r] = row_bad;
    any |= row_bad;
  }
  return any;
}

// Packs n rows of D floats (row stride `stride`) as K^T panels (see Gemm): dst holds
// round_up(n, PW) / PW panels of [D, PW], columns past n zero; non-finite entries as 0 if
// `sanitize`.
void PackPanels(const float* src, int64_t stride, int64_t n, int64_t D, float* dst, bool sanitize) {
  const int64_t panels = round_up(n, PW) / PW;
  std::fill(dst, dst + panels * D * PW, 0.0f);
  for (int64_t r = 0; r < n; ++r) {
    const float* s = src + r * stride;
    float* col = dst + (r / PW) * D * PW + r % PW;
    for (int64_t d = 0; d < D; ++d) {
      float x = s[d];
      col[d * PW] = (sanitize && !finite(x)) ? 0.0f : x;
    }
  }
}

bool AnyBadRow(const float* src, int64_t stride, int64_t n, int64_t D, uint8_t* bad) {
  bool any = false;
  for (int64_t r = 0; r < n; ++r) {
    bool row_bad = false;
    for (int64_t d = 0; d < D; ++d) row_bad |= !finite(src[r * stride + d]);
    bad[r] = row_bad;
    any |= row_bad;
  }
  return any;
}

// For K^T panels of D rows (PackPanels' layout, starting at a panel): bad[c] for columns
// [0, cols), whether key c holds a non-finite value.
bool AnyBadColumn(const float* panels, int64_t D, int64_t cols, uint8_t* bad) {
  bool any = false;
  for (int64_t c = 0; c < cols; ++c) {
    const float* col = panels + (c / PW) * D * PW + c % PW;
    bool b = false;
    for (int64_t d = 0; d < D; ++d) b |= !finite(col[d * PW]);
    bad[c] = b;
    any |= b;
  }
  return any;
}

// The largest entry of row[0, n) (NaN entries are skipped here; they poison the exponentials).
inline float RowMax(const float* row, int64_t n) {
  vf vmax = splat(NEG_INF);
  int64_t c = 0;
  for (; c + W <= n; c += W) { vf x = load(row + c); vmax = x > vmax ? x : vmax; }
  float m = NEG_INF;
  for (int w = 0; w < W; ++w) m = vmax[w] > m ? vmax[w] : m;
  for (; c < n; ++c) m = row[c] > m ? row[c] : m;
  return m;
}

// row[c] = 2^(row[c] * mult + shift) for c < n, 0 for n <= c < nw; returns their sum.
inline float ExpRow(float* row, int64_t n, int64_t nw, float mult, float shift) {
  vf sum = splat(0.0f), vm = splat(mult), vs = splat(shift);
  int64_t c = 0;
  for (; c + W <= n; c += W) {
    vf p = exp2v(load(row + c) * vm + vs);
    store(row + c, p);
    sum += p;
  }
  float total = 0.0f;
  for (; c < n; ++c) { row[c] = exp2v(splat(row[c] * mult + shift))[0]; total += row[c]; }
  for (; c < nw; ++c) row[c] = 0.0f;
  for (int w = 0; w < W; ++w) total += sum[w];
  return total;
}

// One thread's buffers (kept between calls: their size depends only on the tiles).
struct TileScratch {
  std::vector<float> q, kt, vt, v, t, dp, acc;
  std::vector<uint8_t> q_bad, k_bad, v_bad;
};

// ---------------------------------------------------------------------------------------------
// Forward: one item per (b, hq, query tile). q [B, Lq, Hq, D] as given; k as K^T panels
// kt [B, Hkv, Lk_pad / PW, D, PW] and v head-major [B, Hkv, Lk, D] (XLA lays them out once per
// call), so that each key tile's operands are contiguous blocks.
void Forward(const Problem& P, const float* q, const float* kt, const float* v, int64_t lk_pad,
             float* out, float* row_max, float* log_sum, int64_t bq, int64_t bk,
             ffi::ThreadPool& pool) {
  const int64_t D = P.D, q_tiles = (P.Lq + bq - 1) / bq, ldt = round_up(bk, PW);
  const float mult = P.scale * LOG2_E;
  auto run = [&](int64_t item) {
    static thread_local TileScratch s;
    int64_t tile = q_tiles - 1 - item % q_tiles;  // heavy query tiles first (causal)
    int64_t bh = item / q_tiles, b = bh / P.Hq, h = bh % P.Hq, hk = h / P.groups();
    int64_t i0 = tile * bq, i1 = std::min(P.Lq, i0 + bq), m = i1 - i0;
    const int64_t q_stride = P.Hq * D;
    const float* qa_raw = q + ((b * P.Lq + i0) * P.Hq + h) * D;
    const float* kth = kt + (b * P.Hkv + hk) * lk_pad * D;
    const float* vh = v + (b * P.Hkv + hk) * P.Lk * D;
    s.q.resize(bq * D); s.kt.resize(D * ldt); s.v.resize(bk * D); s.t.resize(bq * ldt);
    s.acc.assign(bq * D, 0.0f);
    s.q_bad.resize(bq); s.k_bad.resize(ldt); s.v_bad.resize(bk);
    std::vector<float> mx(m, NEG_INF), l(m, 0.0f);
    int64_t lo, hi;
    P.key_range(b, i0, std::min(i1, P.qlen(b)), &lo, &hi);
    lo = lo / bk * bk;
    int q_any_bad = -1;  // checked at the first masked tile (unmasked tiles need no check)
    for (int64_t j0 = lo; j0 < hi; j0 += bk) {
      int64_t j1 = std::min(hi, j0 + bk), n = j1 - j0, nw = round_up(n, W);
      const float* k_panels = kth + (j0 / PW) * D * PW;
      const float* v_rows = vh + j0 * D;
      // The non-finite rule, on masked tiles only: clean copies and poisoned pairs.
      bool masked = !P.whole(b, i0, i1, j0, j1);
      bool k_bad = masked && AnyBadColumn(k_panels, D, n, s.k_bad.data());
      bool v_bad = masked && AnyBadRow(v_rows, D, n, D, s.v_bad.data());
      if (masked && q_any_bad < 0) q_any_bad = AnyBadRow(qa_raw, q_stride, m, D, s.q_bad.data());
      bool sanitize = masked && (q_any_bad > 0 || k_bad || v_bad);
      const float* qa = qa_raw;
      int64_t qa_r = q_stride;
      if (sanitize) {
        CopyRows(qa_raw, q_stride, m, D, s.q.data(), true, nullptr);
        CopyRows(k_panels, 1, round_up(n, PW) / PW * D * PW, 1, s.kt.data(), true, nullptr);
        CopyRows(v_rows, D, n, D, s.v.data(), true, nullptr);
        qa = s.q.data(); qa_r = D; k_panels = s.kt.data(); v_rows = s.v.data();
      }
      float* t = s.t.data();
      Gemm(m, nw, D, qa, qa_r, 1, k_panels, PW, D * PW, t, ldt, false);  // t = q k^T
      if (masked) {
        for (int64_t r = 0; r < m; ++r)
          MaskRow(P, b, i0 + r, j0, n, t + r * ldt, sanitize, sanitize && s.q_bad[r],
                  k_bad ? s.k_bad.data() : nullptr, v_bad ? s.v_bad.data() : nullptr);
      }
      // Online softmax in base 2: p = 2^(t * scale * log2(e) - m2), m2 = max * log2(e), with
      // the running max natural (as every implementation saves it).
      for (int64_t r = 0; r < m; ++r) {
        float* tr = t + r * ldt;
        float new_max = std::max(mx[r], RowMax(tr, n) * P.scale);
        float m2 = (new_max == NEG_INF ? 0.0f : new_max) * LOG2_E;
        float rescale = exp2v(splat(mx[r] * LOG2_E - m2))[0];  // 0 while mx is -inf
        l[r] = rescale * l[r] + ExpRow(tr, n, nw, mult, -m2);
        mx[r] = new_max;
        if (rescale != 1.0f) {
          float* a = s.acc.data() + r * D;
          for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
        }
      }
      Gemm(m, D, n, t, ldt, 1, v_rows, D, PW, s.acc.data(), D, true);  // acc += p v
    }
    for (int64_t r = 0; r < m; ++r) {
      bool empty = l[r] == 0.0f;  // a NaN sum is not empty: the row's output is NaN
      float inv = empty ? 0.0f : 1.0f / l[r];
      float* o = out + ((b * P.Lq + i0 + r) * P.Hq + h) * D;
      const float* a = s.acc.data() + r * D;
      for (int64_t d = 0; d < D; ++d) o[d] = empty ? 0.0f : a[d] * inv;
      int64_t st = (b * P.Hq + h) * P.Lq + i0 + r;
      row_max[st] = empty ? INFINITY : mx[r];
      log_sum[st] = empty ? 0.0f : std::log(l[r]);
    }
  };
  ParallelFor(pool, P.B * P.Hq * q_tiles, run);
}

// ---------------------------------------------------------------------------------------------
// Backward (FlashAttention-2's Algorithm 2): one item per (b, kv head, key chunk), every array
// head-major ([B, H, L, D]). A key tile's dK, dV stay in the scratch while the query tiles of
// its query heads pass; dq accumulates into dq_parts[chunk] (one float32 buffer per chunk,
// summed by the caller), unscaled like dK until the end.
void Backward(const Problem& P, const float* q, const float* k, const float* v, const float* d_out,
              const float* row_max, const float* log_sum, const float* delta, float* dq_parts,
              float* dk, float* dv, int64_t bq, int64_t bk, int64_t chunks, ffi::ThreadPool& pool) {
  const int64_t D = P.D, G = P.groups(), k_tiles = (P.Lk + bk - 1) / bk, ldt = round_up(bk, PW);
  const float mult = P.scale * LOG2_E;
  const int64_t dq_size = P.B * P.Hq * P.Lq * D;
  auto run = [&](int64_t item) {
    static thread_local TileScratch s;
    int64_t chunk = item % chunks, bh = item / chunks, b = bh / P.Hkv, hk = bh % P.Hkv;
    const float* kh = k + bh * P.Lk * D;
    const float* vh = v + bh * P.Lk * D;
    s.kt.resize(D * ldt); s.vt.resize(D * ldt); s.t.resize(bq * ldt); s.dp.resize(bq * ldt);
    s.q.resize(bq * D); s.v.resize(bk * D); s.acc.resize(2 * bk * D);
    s.q_bad.resize(bq); s.k_bad.resize(bk); s.v_bad.resize(bk);
    for (int64_t tile = chunk; tile < k_tiles; tile += chunks) {
      int64_t j0 = tile * bk, j1 = std::min(P.Lk, j0 + bk), n = j1 - j0, nw = round_up(n, W);
      float* dk_acc = s.acc.data();           // [n, D]
      float* dv_acc = s.acc.data() + bk * D;  // [n, D]
      std::fill(dk_acc, dk_acc + 2 * bk * D, 0.0f);
      int64_t lo, hi;
      P.query_range(b, j0, std::min(j1, P.kvlen(b)), &lo, &hi);
      lo = lo / bq * bq;
      const float* k_rows = kh + j0 * D;
      bool k_any = AnyBadRow(k_rows, D, n, D, s.k_bad.data());
      bool v_any = AnyBadRow(vh + j0 * D, D, n, D, s.v_bad.data());
      int packed = -1;  // whether kt/vt hold the clean (1) or raw (0) tile
      for (int64_t g = 0; g < G; ++g) {
        int64_t h = hk * G + g, row0 = (b * P.Hq + h) * P.Lq;
        const float* qh = q + row0 * D;
        const float* doh = d_out + row0 * D;
        float* dqh = dq_parts + chunk * dq_size + row0 * D;
        for (int64_t i0 = lo; i0 < hi; i0 += bq) {
          int64_t i1 = std::min(hi, i0 + bq), m = i1 - i0;
          bool masked = !P.whole(b, i0, i1, j0, j1);
          bool q_any = masked && AnyBadRow(qh + i0 * D, D, m, D, s.q_bad.data());
          bool sanitize = masked && (q_any || k_any || v_any);
          if (packed != static_cast<int>(sanitize)) {  // K^T, V^T panels of the key tile
            PackPanels(k_rows, D, n, D, s.kt.data(), sanitize);
            PackPanels(vh + j0 * D, D, n, D, s.vt.data(), sanitize);
            if (sanitize) CopyRows(k_rows, D, n, D, s.v.data(), true, nullptr);
            packed = sanitize;
          }
          const float* qa = qh + i0 * D;
          if (sanitize) {
            CopyRows(qa, D, m, D, s.q.data(), true, nullptr);
            qa = s.q.data();
          }
          const float* do_rows = doh + i0 * D;
          float* t = s.t.data();
          float* dp = s.dp.data();
          Gemm(m, nw, D, qa, D, 1, s.kt.data(), PW, D * PW, t, ldt, false);        // q k^T
          Gemm(m, nw, D, do_rows, D, 1, s.vt.data(), PW, D * PW, dp, ldt, false);  // dO v^T
          for (int64_t r = 0; r < m; ++r) {
            float* tr = t + r * ldt;
            float* dpr = dp + r * ldt;
            if (masked)
              MaskRow(P, b, i0 + r, j0, n, tr, sanitize, sanitize && s.q_bad[r], s.k_bad.data(),
                      s.v_bad.data());
            // P = 2^(t * scale * log2(e) - m2 - log_sum * log2(e)) with the forward's m2;
            // dS = P (dP - delta). P stays in t, dS in dp.
            const float shift = -(row_max[row0 + i0 + r] * LOG2_E) - log_sum[row0 + i0 + r] * LOG2_E;
            const float dl = delta[row0 + i0 + r];
            vf vm = splat(mult), vs = splat(shift), vd = splat(dl);
            int64_t c = 0;
            for (; c + W <= n; c += W) {
              vf p = exp2v(load(tr + c) * vm + vs);
              store(tr + c, p);
              store(dpr + c, p * (load(dpr + c) - vd));
            }
            for (; c < n; ++c) {
              float p = exp2v(splat(tr[c] * mult + shift))[0];
              tr[c] = p;
              dpr[c] = p * (dpr[c] - dl);
            }
            for (; c < nw; ++c) tr[c] = dpr[c] = 0.0f;
          }
          Gemm(n, D, m, t, 1, ldt, do_rows, D, PW, dv_acc, D, true);  // dV += P^T dO
          Gemm(n, D, m, dp, 1, ldt, qa, D, PW, dk_acc, D, true);      // dK += dS^T q
          Gemm(m, D, n, dp, ldt, 1, sanitize ? s.v.data() : k_rows, D, PW, dqh + i0 * D, D,
               true);                                                  // dq += dS k
        }
      }
      float* dkr = dk + (bh * P.Lk + j0) * D;
      float* dvr = dv + (bh * P.Lk + j0) * D;
      for (int64_t x = 0; x < n * D; ++x) {
        dkr[x] = dk_acc[x] * P.scale;
        dvr[x] = dv_acc[x];
      }
    }
  };
  ParallelFor(pool, P.B * P.Hkv * chunks, run);
}

Problem MakeProblem(int64_t B, int64_t Lq, int64_t Lk, int64_t Hq, int64_t Hkv, int64_t D,
                    ffi::Buffer<ffi::S32>& q_len, ffi::Buffer<ffi::S32>& kv_len,
                    ffi::Buffer<ffi::S32>& d_lo, ffi::Buffer<ffi::S32>& d_hi,
                    ffi::Buffer<ffi::S32>& q_seg, ffi::Buffer<ffi::S32>& kv_seg, float scale,
                    int64_t has_segments) {
  return Problem{B, Lq, Lk, Hq, Hkv, D,
                 q_len.typed_data(), kv_len.typed_data(), d_lo.typed_data(), d_hi.typed_data(),
                 has_segments ? q_seg.typed_data() : nullptr,
                 has_segments ? kv_seg.typed_data() : nullptr, scale};
}

ffi::Error Check(const Problem& P, int64_t bq, int64_t bk) {
  if (P.D % W != 0) return ffi::Error::InvalidArgument("head_dim must be a multiple of the SIMD width");
  if (bq < 1 || bk < PW || bk % PW != 0)
    return ffi::Error::InvalidArgument("block_q must be >= 1 and block_k a multiple of 64");
  return ffi::Error::Success();
}

// q [B, Lq, Hq, D], kt [B, Hkv, Lk_pad / PW, D, PW], v [B, Hkv, Lk, D].
ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kt,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_len,
                       ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::S32> d_lo,
                       ffi::Buffer<ffi::S32> d_hi, ffi::Buffer<ffi::S32> q_seg,
                       ffi::Buffer<ffi::S32> kv_seg, float scale, int64_t block_q,
                       int64_t block_k, int64_t has_segments, ffi::ResultBuffer<ffi::F32> out,
                       ffi::ResultBuffer<ffi::F32> row_max, ffi::ResultBuffer<ffi::F32> log_sum) {
  auto qd = q.dimensions(), vd = v.dimensions(), ktd = kt.dimensions();
  Problem P = MakeProblem(qd[0], qd[1], vd[2], qd[2], vd[1], qd[3], q_len, kv_len, d_lo, d_hi,
                          q_seg, kv_seg, scale, has_segments);
  if (ffi::Error e = Check(P, block_q, block_k); e.failure()) return e;
  Forward(P, q.typed_data(), kt.typed_data(), v.typed_data(), ktd[2] * PW, out->typed_data(),
          row_max->typed_data(), log_sum->typed_data(), block_q, block_k, pool);
  return ffi::Error::Success();
}

// Every array head-major: q, d_out [B, Hq, Lq, D], k, v [B, Hkv, Lk, D]; stats [B, Hq, Lq].
ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_len,
                        ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::S32> d_lo,
                        ffi::Buffer<ffi::S32> d_hi, ffi::Buffer<ffi::S32> q_seg,
                        ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::F32> d_out,
                        ffi::Buffer<ffi::F32> row_max, ffi::Buffer<ffi::F32> log_sum,
                        ffi::Buffer<ffi::F32> delta, float scale, int64_t block_q,
                        int64_t block_k, int64_t has_segments, int64_t chunks,
                        ffi::ResultBuffer<ffi::F32> dq_parts, ffi::ResultBuffer<ffi::F32> dk,
                        ffi::ResultBuffer<ffi::F32> dv) {
  auto qd = q.dimensions(), vd = v.dimensions();
  Problem P = MakeProblem(qd[0], qd[2], vd[2], qd[1], vd[1], qd[3], q_len, kv_len, d_lo, d_hi,
                          q_seg, kv_seg, scale, has_segments);
  if (ffi::Error e = Check(P, block_q, block_k); e.failure()) return e;
  float* dq = dq_parts->typed_data();
  std::fill(dq, dq + dq_parts->element_count(), 0.0f);
  std::fill(dk->typed_data(), dk->typed_data() + dk->element_count(), 0.0f);  // keys no query sees
  std::fill(dv->typed_data(), dv->typed_data() + dv->element_count(), 0.0f);
  Backward(P, q.typed_data(), k.typed_data(), v.typed_data(), d_out.typed_data(),
           row_max.typed_data(), log_sum.typed_data(), delta.typed_data(), dq, dk->typed_data(),
           dv->typed_data(), block_q, block_k, chunks, pool);
  return ffi::Error::Success();
}

}  // namespace

namespace {
// What both handlers take first: XLA's thread pool, q, k (the forward's K^T panels), v, and the
// mask operands q_len, kv_len, d_lo, d_hi, q_seg, kv_seg.
auto BindAttention() {
  using F32 = ffi::Buffer<ffi::F32>;
  using S32 = ffi::Buffer<ffi::S32>;
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32>().Arg<F32>().Arg<F32>()
      .Arg<S32>().Arg<S32>().Arg<S32>().Arg<S32>().Arg<S32>().Arg<S32>();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashForwardCpu, ForwardImpl,
                              BindAttention()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_k")
                                  .Attr<int64_t>("has_segments")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// After the common operands: d_out, row_max, log_sum, delta.
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashBackwardCpu, BackwardImpl,
                              BindAttention()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block_q")
                                  .Attr<int64_t>("block_k")
                                  .Attr<int64_t>("has_segments")
                                  .Attr<int64_t>("chunks")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
