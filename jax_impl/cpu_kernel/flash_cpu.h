// FlashAttention forward and backward for the CPU: the algorithm, free of XLA (flash_cpu.cc
// binds it as XLA FFI custom calls; the tests' harness calls it on exact-size buffers).
//
// The same algorithm as the Pallas kernels and the xla path (FlashAttention-2, the online
// softmax in base 2: online_softmax.Base2Softmax), fused so that a tile never leaves the caches
// between its products: the forward works one (batch row, head, query tile) at a time, the
// backward one (batch row, kv head, chunk of key tiles). Every product is one register-blocked
// microkernel (`Gemm`): C[M, N] (+)= A[M, K] B[K, N], A read one scalar at a time through two
// strides (so P^T and dS^T need no transposed copy), B in rows of SIMD vectors.
//
// Layouts (float32, head_dim D a multiple of the SIMD width: the caller pads it with zeros):
// the forward takes q [B, Lq, Hq, D] as the library holds it, K^T in panels of 64 keys and v
// head-major; the backward takes every array head-major [B, H, L, D]. Row statistics and delta
// are [B, Hq, Lq]. A bias [Bb, Hb, Lq, Lk], a mask [Bm, Hm, Lq, Lk], sinks and dropout seeds
// [Bs, Hs] may be broadcast over batch and heads (size 1 there).
//
// The mask (masking.py's rules 1-5): the band d_lo[b] <= j - i <= d_hi[b] inside i < q_len[b],
// j < kv_len[b], segment ids, the dense mask; and an additive -inf bias excludes a pair as the
// rules do. The non-finite rule (online_softmax.py): a pair whose query row or key row (k or v)
// holds a NaN or inf gets a NaN logit, computed with those entries as 0, so it reaches only the
// rows that may attend it; excluded pairs contribute exactly 0 to every gradient. Tile classes
// (Problem::tiles, when given) skip the tiles with no allowed pair and the per-pair mask on
// those whose pairs rules 1-4 all allow.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

// Invariants of the tile ranges and buffer offsets, checked in the sanitizer build (build.py
// defines FLASH_CPU_CHECKS there): a broken one aborts with its line instead of reading on.
#ifdef FLASH_CPU_CHECKS
#define FLASH_CPU_CHECK(cond)                                                           \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "flash_cpu.h:%d: check failed: %s\n", __LINE__, #cond);      \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)
#else
#define FLASH_CPU_CHECK(cond) \
  do {                        \
  } while (0)
#endif

namespace flash_cpu {

#if defined(__AVX512F__)
constexpr int W = 16;  // floats per SIMD vector
constexpr int MR = 6, NV = 4;  // microkernel: MR rows x NV vectors = 24 of 32 registers
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
#if !defined(__AVX512F__)
// 16 registers and no broadcast operand in an FMA: 6 x 2 holds 12 accumulators, 2 B vectors
// and one broadcast A scalar, 8 loads per 12 FMAs; 3 x 4 would need 17 registers, so that the
// compiler reads B from memory in every FMA (15 loads per 12 FMAs: load-bound, 0.6x the
// speed of 6 x 2 on the 2-core AVX2 host).
constexpr int MR = 6, NV = 2;
#endif
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));

inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return x - vf{}; }  // x - 0 folds to a broadcast (x + 0 would not: -0)
inline vf select(vi mask, vf a, vf b) { return mask ? a : b; }
// a * b + c, one rounding where the target has FMA (else two), in every shape of the
// microkernel: the compiler's own contraction varies with the shape (GCC 12 left micro<1, 1>
// a multiply and an add), and the backward's logits must equal the forward's bit for bit
// (at |S| ~ 1e9 one ulp is e^64 in P).
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);  // W = 8: -mfma implies AVX
#elif defined(__aarch64__)
  return vfmaq_f32(c, a, b);
#else
  return a * b + c;  // no FMA instruction: nothing to contract into
#endif
}

constexpr float LOG2_E = 1.4426950408889634f;
constexpr float NEG_INF = -INFINITY;

// 2^x for x <= 0.5 (every use: logits minus a row max): exactly 0 at x <= -127 (so at -inf),
// NaN kept. Cephes exp2f: x = i + f, |f| <= 1/2, 2^f by a degree-6 polynomial (about 2 ulp).
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
  constexpr float SHIFTER = 12582912.0f;  // 1.5 * 2^23: x + it rounds x to an integer, in its low bits
  const vf lowest = splat(-127.0f);
  vf xc = lowest > x ? lowest : x;  // a max that keeps a NaN (which compares false)
  vf y = xc + SHIFTER;
  vf i = y - SHIFTER;  // round(xc), exact
  vf p = exp2_fraction(xc - i);
  // 2^i in the exponent field: i + 127 sits in y's low bits, and the shift drops the rest; at
  // i = -127 the bits are those of 0, so that the result is exactly 0 there.
  vi bits;
  std::memcpy(&bits, &y, sizeof bits);
  bits = (bits + 127) << 23;
  vf two_i; std::memcpy(&two_i, &bits, sizeof two_i);
  return p * two_i;
}
inline float exp2s(float x) { return exp2v(splat(x))[0]; }

// tanh (the soft cap), Cephes tanhf (about 2 ulp): an odd polynomial below |x| = 0.625, else
// (1 - e) / (1 + e) with e = 2^(-2|x| log2(e)) in (0, 0.29]; +-1 at +-inf, NaN kept.
inline vf tanhv(vf x) {
  vf ax = x < 0.0f ? -x : x;
  vf z = x * x;
  vf p = splat(-5.70498872745e-3f);
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  vf small = x + x * z * p;
  vf e = exp2v(ax * (-2.0f * LOG2_E));
  vf big = (1.0f - e) / (1.0f + e);
  big = x < 0.0f ? -big : big;
  return ax < 0.625f ? small : big;
}

// Dropout's keep decision (dropout_sinks.keep, bit for bit): murmur3's finaliser over the seed
// and the absolute (query, key) indices; kept iff the top 24 bits reach the threshold.
constexpr uint32_t MIX1 = 0x85EBCA6Bu, MIX2 = 0xC2B2AE35u, GOLDEN = 0x9E3779B1u, PRIME = 0x27D4EB2Fu;
template <typename U>
inline U mix(U x) {
  x ^= x >> 16;
  x *= MIX1;
  x ^= x >> 13;
  x *= MIX2;
  return x ^ (x >> 16);
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

#include "mod_program.h"  // the mods' row programs (inside this namespace: they use the above)

// C[m, nv*W] (+)= sum_k A[r*ar + k*ak] * B[k*ldb + c], m <= MR rows, nv <= NV vectors.
// A's k stride is a template parameter (1: rows of A, else A^T), so that each instance has one
// loop and keeps its accumulators in registers (with both loops in one function, GCC passed
// them through the stack between the loop versions).
template <int M, int N, bool UnitK>
void micro_strided(int64_t K, const float* A, int64_t ar, int64_t ak, const float* B,
                   int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  vf acc[M][N];
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) acc[r][c] = accumulate ? load(C + r * ldc + c * W) : splat(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    vf b[N];
    for (int c = 0; c < N; ++c) b[c] = load(B + k * ldb + c * W);
    for (int r = 0; r < M; ++r) {
      vf a = splat(A[r * ar + k * (UnitK ? 1 : ak)]);
      for (int c = 0; c < N; ++c) acc[r][c] = fmadd(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) store(C + r * ldc + c * W, acc[r][c]);
}
template <int M, int N>
void micro(int64_t K, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb,
           float* C, int64_t ldc, bool accumulate) {
  if (ak == 1) return micro_strided<M, N, true>(K, A, ar, ak, B, ldb, C, ldc, accumulate);
  micro_strided<M, N, false>(K, A, ar, ak, B, ldb, C, ldc, accumulate);
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

inline bool finite(float x) { return std::fabs(x) < INFINITY; }

// B operands are read in panels of PW columns: element (k, c) of B is at
// B[(c / PW) * panel + k * ldb + c % PW]. A row-major B is panel = PW; a packed K^T tile is
// ldb = PW, panel = D * PW, so that each microkernel call streams one contiguous block.
constexpr int64_t PW = 64;
static_assert(PW % (NV * W) == 0, "a microkernel call stays inside one panel");

// C[M, N] (+)= A[M, K] B[K, N]; N a multiple of W. A's element (r, k) is A[r*ar + k*ak].
inline void Gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t ar, int64_t ak,
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

// Runs fn(item) for item in [0, n) on the caller and the pool's threads (`Pool`: num_threads()
// and Schedule(task), as XLA's ffi::ThreadPool). Items are handed out by an atomic counter; the
// caller returns once all are done, and a task that starts late finds none left and touches
// nothing.
template <typename Pool, typename F>
void ParallelFor(Pool& pool, int64_t n, F fn) {
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

// A [X0, X1, ...] array broadcast over its first two axes (batch, head) where they have size 1.
template <typename T>
struct PerHead {
  const T* data = nullptr;  // null: absent
  int64_t batch_stride = 0, head_stride = 0;  // 0 along a broadcast axis
  PerHead() = default;
  PerHead(const T* d, int64_t batches, int64_t heads, int64_t inner)
      : data(d), batch_stride(batches > 1 ? heads * inner : 0), head_stride(heads > 1 ? inner : 0) {}
  const T* at(int64_t b, int64_t h) const { return data + b * batch_stride + h * head_stride; }
  explicit operator bool() const { return data != nullptr; }
};

// Tile classes (block_mask.py's EMPTY, PARTIAL, FULL): whether a tile of the call's grid holds
// no allowed pair (skipped), some (masked per pair), or only allowed pairs by rules 1-4.
enum TileClass : int8_t { kEmpty = 0, kPartial = 1, kFull = 2 };

// Keys [lo, hi) (or query rows, for the backward) that a tile's rows (keys) may pair with.
struct Span {
  int64_t lo, hi;
};

// One call: shapes, the mask, the features. Built by flash_cpu.cc (or a test harness).
struct Problem {
  int64_t B, Lq, Lk, Hq, Hkv, D;
  const int32_t *q_len, *kv_len, *d_lo, *d_hi;  // [B]
  const int32_t *q_seg = nullptr, *kv_seg = nullptr;  // [B, Lq], [B, Lk]; null: no segments
  PerHead<bool> mask;       // [Bm, Hm, Lq, Lk], True = may attend
  PerHead<float> bias;      // [Bb, Hb, Lq, Lk]
  PerHead<float> sinks;     // [Bs, Hs]
  PerHead<uint32_t> seeds;  // [Bs, Hs] (dropout)
  // [Bc, Hc, nq, nk] TileClass per (query tile, key tile) of this call's grid, Bc in {1, B},
  // Hc in {1, Hq}; absent: every tile the band reaches is visited (kPartial).
  PerHead<int8_t> tiles;
  int64_t tile_cols = 0;  // nk
  ModProgram mods;  // score_mod and mask_mod (mod_program.h); empty: none
  float scale = 1.0f;
  float soft_cap = 0.0f;      // 0: none
  float dropout_rate = 0.0f;  // 0: none

  int64_t groups() const { return Hq / Hkv; }
  int64_t qlen(int64_t b) const { return std::clamp<int64_t>(q_len[b], 0, Lq); }
  int64_t kvlen(int64_t b) const { return std::clamp<int64_t>(kv_len[b], 0, Lk); }

  // Keys [lo, hi) that query rows [i0, i1) of batch row b may attend by rules 1-3 (the C++
  // twin of masking.kv_block_range): 0 <= lo <= hi <= kvlen(b), lo a multiple of `tile` (so
  // that key tiles start on the kernel's grid: the K^T panels), {0, 0} when there are none.
  Span KeySpan(int64_t b, int64_t i0, int64_t i1, int64_t tile) const {
    i1 = std::min(i1, qlen(b));
    if (i1 <= i0) return {0, 0};  // the rows lie past the valid queries
    int64_t lo = std::max<int64_t>(0, i0 + int64_t{d_lo[b]});
    int64_t hi = std::min<int64_t>(kvlen(b), i1 + int64_t{d_hi[b]});  // last row's j <= i + d_hi
    if (hi <= lo) return {0, 0};
    Span s{lo / tile * tile, hi};
    FLASH_CPU_CHECK(0 <= s.lo && s.lo < s.hi && s.hi <= Lk && s.lo % tile == 0);
    return s;
  }
  // Query rows [lo, hi) that may attend keys [j0, j1) (masking.q_block_range's twin):
  // 0 <= lo <= hi <= qlen(b), lo a multiple of `tile`, {0, 0} when there are none.
  Span QuerySpan(int64_t b, int64_t j0, int64_t j1, int64_t tile) const {
    j1 = std::min(j1, kvlen(b));
    if (j1 <= j0) return {0, 0};  // the keys lie past the valid keys
    int64_t lo = std::max<int64_t>(0, j0 - int64_t{d_hi[b]});
    int64_t hi = std::min<int64_t>(qlen(b), j1 - int64_t{d_lo[b]});  // last key's i <= j - d_lo
    if (hi <= lo) return {0, 0};
    Span s{lo / tile * tile, hi};
    FLASH_CPU_CHECK(0 <= s.lo && s.lo < s.hi && s.hi <= Lq && s.lo % tile == 0);
    return s;
  }
  // Whether rules 1-5 allow every pair of rows [i0, i1) x keys [j0, j1) (no per-element mask).
  bool whole(int64_t b, int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    return q_seg == nullptr && !mask && !mods.mask() && i1 <= qlen(b) && j1 <= kvlen(b) &&
           j0 - (i1 - 1) >= d_lo[b] && (j1 - 1) - i0 <= d_hi[b];
  }
  // The class of query tile qi x key tile kj for query head h of batch row b.
  TileClass Class(int64_t b, int64_t h, int64_t qi, int64_t kj) const {
    return tiles ? static_cast<TileClass>(tiles.at(b, h)[qi * tile_cols + kj]) : kPartial;
  }
  // Whether rows [i0, i1) x keys [j0, j1) of class `cls` need no per-pair mask (the non-finite
  // rule aside): all pairs allowed by the band and lengths (`whole`), or a full tile without a
  // dense mask (rules 1-4 hold on it).
  bool unmasked(int64_t b, int64_t i0, int64_t i1, int64_t j0, int64_t j1, TileClass cls) const {
    return (cls == kFull && !mask) || whole(b, i0, i1, j0, j1);
  }
  // How the forward and decode hold a tile's logits: without a bias unscaled (q.k, or the soft
  // cap's tanh), S = t * unit; with one, as S itself (unit 1). The row max is subtracted in
  // that domain before the multiply by unit * log2(e): the max's own exponent is exactly 0
  // and every other one <= 0 at any magnitude (at |S| ~ 1e9 the two roundings of
  // t * unit * log2(e) - max * log2(e) lie hundreds apart).
  float unit() const { return logits_as_s() ? 1.0f : soft_cap > 0.0f ? soft_cap : scale; }
  // Whether the forward holds S itself: a bias or a score_mod acts on it.
  bool logits_as_s() const { return bias || mods.score(); }
  float kept_scale() const { return static_cast<float>(1.0 / (1.0 - double{dropout_rate})); }
  uint32_t keep_threshold() const {
    return static_cast<uint32_t>(std::lround(double{dropout_rate} * (1 << 24)));
  }
};

// Dropout on one query row against keys [j0, j0 + n): x[c] times 1 / (1 - rate) where kept,
// times 0 where dropped (a product, as dropout_sinks.apply_dropout: a NaN stays NaN). The
// row's seed comes already mixed with the row index (RowKey).
inline uint32_t RowKey(uint32_t seed, int64_t i) {
  return mix<uint32_t>(seed ^ (static_cast<uint32_t>(i) * GOLDEN));
}
inline void DropRow(uint32_t seed, uint32_t row_key, int64_t j0, int64_t n, uint32_t threshold,
                    float kept, float* x) {
  vu lane;
  for (int w = 0; w < W; ++w) lane[w] = static_cast<uint32_t>(w);
  int64_t c = 0;
  for (; c + W <= n; c += W) {
    vu cols = static_cast<uint32_t>(j0 + c) + lane;
    vu bits = mix<vu>(row_key ^ (cols * PRIME + seed));
    vi keep = __builtin_convertvector(bits >> 8, vi) >= static_cast<int32_t>(threshold);
    store(x + c, load(x + c) * select(keep, splat(kept), splat(0.0f)));
  }
  for (; c < n; ++c) {
    uint32_t bits = mix<uint32_t>(row_key ^ (static_cast<uint32_t>(j0 + c) * PRIME + seed));
    x[c] *= static_cast<int32_t>(bits >> 8) >= static_cast<int32_t>(threshold) ? kept : 0.0f;
  }
}

// Whether any of x[0, count) is NaN or inf (x * 0 is NaN exactly for those). Four chains of
// adds: one would wait on each add's latency.
inline bool AnyNonFinite(const float* x, int64_t count) {
  vf acc[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
  int64_t i = 0;
  for (; i + 4 * W <= count; i += 4 * W)
    for (int u = 0; u < 4; ++u) acc[u] += load(x + i + u * W) * 0.0f;
  for (; i + W <= count; i += W) acc[0] += load(x + i) * 0.0f;
  float tail = 0.0f;
  for (; i < count; ++i) tail += x[i] * 0.0f;
  const vf all = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  for (int w = 0; w < W; ++w) tail += all[w];
  return tail != tail;
}

// bad[r] = whether row r of n rows of D floats (row stride `stride`) holds a NaN or inf.
inline bool BadRows(const float* src, int64_t stride, int64_t n, int64_t D, uint8_t* bad) {
  bool any = false;
  for (int64_t r = 0; r < n; ++r) any |= (bad[r] = AnyNonFinite(src + r * stride, D));
  return any;
}

// bad[r] for n rows of D floats (row stride `stride`), or null when none holds a NaN or inf
// (contiguous rows are first checked in one pass).
inline const uint8_t* BadRowFlags(const float* src, int64_t stride, int64_t n, int64_t D,
                                  uint8_t* bad) {
  if (stride == D && !AnyNonFinite(src, n * D)) return nullptr;
  return BadRows(src, stride, n, D, bad) ? bad : nullptr;
}

// For K^T panels of D rows (PackPanels' layout, starting at a panel): bad[c] for columns
// [0, cols), whether key c holds a non-finite value.
inline void BadColumns(const float* panels, int64_t D, int64_t cols, uint8_t* bad) {
  for (int64_t c = 0; c < cols; ++c) {
    const float* col = panels + (c / PW) * D * PW + c % PW;
    bool b = false;
    for (int64_t d = 0; d < D; ++d) b |= !finite(col[d * PW]);
    bad[c] = b;
  }
}

// Per tile of an operand, whether it holds a NaN or inf: tile t of head h is floats
// [t * tile_floats, (t + 1) * tile_floats) of that head's head_floats (the last tile shorter).
// One pass over the operand per call, so that the tile loops, which meet each tile once per
// tile of the other side, test a flag instead of the tile.
struct NonFiniteTiles {
  std::vector<uint8_t> bad;  // [heads, tiles]
  int64_t tiles = 0;
  template <typename Pool>
  NonFiniteTiles(Pool& pool, const float* x, int64_t heads, int64_t head_floats,
                 int64_t tile_floats)
      : bad(heads * ((head_floats + tile_floats - 1) / tile_floats)),
        tiles((head_floats + tile_floats - 1) / tile_floats) {
    ParallelFor(pool, heads, [&](int64_t h) {
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t start = t * tile_floats;
        bad[h * tiles + t] = AnyNonFinite(x + h * head_floats + start,
                                          std::min(tile_floats, head_floats - start));
      }
    });
  }
  bool operator()(int64_t head, int64_t tile) const { return bad[head * tiles + tile]; }
};

// Copies `count` floats with the non-finite ones as 0.
inline void CopyFinite(const float* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = finite(src[i]) ? src[i] : 0.0f;
}
// Copies n rows of D floats (row stride `stride`) into dst [n, D], non-finite entries as 0.
inline void CopyRowsFinite(const float* src, int64_t stride, int64_t n, int64_t D, float* dst) {
  for (int64_t r = 0; r < n; ++r) CopyFinite(src + r * stride, D, dst + r * D);
}

// Packs n rows of D floats (row stride D) as K^T panels (see Gemm): dst holds
// round_up(n, PW) / PW panels of [D, PW], columns past n zero; non-finite entries as 0 if
// `finite_only`.
inline void PackPanels(const float* src, int64_t n, int64_t D, float* dst, bool finite_only) {
  const int64_t panels = round_up(n, PW) / PW;
  std::fill(dst, dst + panels * D * PW, 0.0f);
  for (int64_t r = 0; r < n; ++r) {
    const float* s = src + r * D;
    float* col = dst + (r / PW) * D * PW + r % PW;
    for (int64_t d = 0; d < D; ++d) col[d * PW] = (finite_only && !finite(s[d])) ? 0.0f : s[d];
  }
}

// Non-finite flags of a tile's operands (the non-finite rule), null where none is bad.
struct Poison {
  const uint8_t* q = nullptr;  // [m] query rows
  const uint8_t* k = nullptr;  // [n] keys (k rows)
  const uint8_t* v = nullptr;  // [n] keys (v rows)
  bool any() const { return q || k || v; }
};

// Logits of one tile row: t holds q.k (unscaled) of query row i against keys [j0, j0 + n);
// turned in place into S (`scaled`: the backward, whose statistics are S's) or else into the
// domain Problem::unit describes (the soft cap's tanh, or S with a bias or a score_mod); `capped` (when
// not null) receives the tanh for the soft cap's gradient. S is stored here, apart from the
// max's subtraction, so that no multiply-add fuses the two (S = fl(t * unit) as the forward's
// max = fl(t_max * unit)).
inline void RowLogits(const Problem& P, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n,
                      float* t, float* capped, bool scaled) {
  const bool to_s = scaled || P.logits_as_s();
  if (P.soft_cap == 0.0f && !to_s) return;
  const float* bias = P.bias ? P.bias.at(b, h) + i * P.Lk + j0 : nullptr;
  const float cap = P.soft_cap, inner = cap > 0.0f ? P.scale / cap : 0.0f;
  // -> (logit, tanh) of raw products x
  auto logit = [&](vf x, vf bias_v, vf* th) {
    if (cap > 0.0f) {
      *th = tanhv(x * inner);
      x = to_s ? *th * cap : *th;
    } else {
      x = x * P.scale;
    }
    return bias ? x + bias_v : x;
  };
  vf th{};
  int64_t c = 0;
  for (; c + W <= n; c += W) {
    store(t + c, logit(load(t + c), bias ? load(bias + c) : vf{}, &th));
    if (capped != nullptr) store(capped + c, th);
  }
  for (; c < n; ++c) {  // the tail, in lane 0
    t[c] = logit(splat(t[c]), splat(bias ? bias[c] : 0.0f), &th)[0];
    if (capped != nullptr) capped[c] = th[0];
  }
}

// Where register id's value for key c of the current row lies (a uniform register repeats one
// for every key).
inline const float* RegisterLane(ModRegisters& r, int32_t id, int64_t c) {
  return r.lanes(id) + (r.varies(id) ? c : 0);
}
// dst[0, nw) = register id's lanes (a uniform one broadcast).
inline void CopyRegister(ModRegisters& r, int32_t id, int64_t nw, float* dst) {
  if (r.varies(id)) {
    std::memcpy(dst, r.lanes(id), nw * sizeof(float));
  } else {
    const vf x = load(r.at(id));
    for (int64_t c = 0; c < nw; c += W) store(dst + c, x);
  }
}

// score_mod on one tile row of S (query row i; the tile's keys and the item's b, h are set in
// r, and its tile programs ran: ModTile): in place over the row's nw lanes.
inline void ScoreRow(const ModProgram& mods, ModRegisters& r, int64_t i, float* row, int64_t n,
                     int64_t nw) {
  r.SetUniform(kUniformQuery, static_cast<int32_t>(i));
  r.SetRow(i, nw);
  std::memcpy(r.at(kRowScore), row, nw * sizeof(float));
  RunModProgram(mods, mods[kScoreStart], mods[kScoreCount], r, n, nw, nullptr);
  CopyRegister(r, mods[kScoreOut], nw, row);
}

// The backward's score_mod on one row of S: S -> score_mod(S) in place, and `slope` (nw lanes)
// receives d score_mod / dS there; the registers keep the partials for the scatter program.
inline void ScoreGradientRow(const ModProgram& mods, ModRegisters& r, int64_t i, float* row,
                             float* slope, int64_t n, int64_t nw) {
  r.SetUniform(kUniformQuery, static_cast<int32_t>(i));
  r.SetRow(i, nw);
  std::memcpy(r.at(kRowScore), row, nw * sizeof(float));
  RunModProgram(mods, mods[kGradStart], mods[kGradCount], r, n, nw, nullptr);
  CopyRegister(r, mods[kGradOut], nw, row);
  CopyRegister(r, mods[kGradSlope], nw, slope);
}

// The mask on one tile row of logits (query row i, keys [j0, j0 + n)): -inf where rules 1-5 or
// the mask_mod (run on `mods`, with the tile's keys set) exclude the pair, NaN at an allowed
// pair that the poison marks (the non-finite rule). Rules 1-3 allow one interval of keys per
// row, filled without a per-element test.
inline void MaskRow(const Problem& P, int64_t b, int64_t h, int64_t i, int64_t j0, int64_t n,
                    float* row, bool q_bad, const Poison& poison, ModRegisters* mods) {
  int64_t lo = 0, hi = 0;
  if (i < P.qlen(b)) {
    lo = std::clamp<int64_t>(i + int64_t{P.d_lo[b]} - j0, 0, n);
    hi = std::clamp<int64_t>(std::min<int64_t>(P.kvlen(b), i + int64_t{P.d_hi[b]} + 1) - j0, lo, n);
  }
  std::fill(row, row + lo, NEG_INF);
  std::fill(row + hi, row + n, NEG_INF);
  const int32_t* kv_seg = P.q_seg == nullptr ? nullptr : P.kv_seg + b * P.Lk + j0;
  const int32_t q_seg = P.q_seg == nullptr ? 0 : P.q_seg[b * P.Lq + i];
  const bool* mask = P.mask ? P.mask.at(b, h) + i * P.Lk + j0 : nullptr;
  int32_t verdict = -1;  // the mask_mod's result register (int32 0/1 lanes), -1: none
  if (P.mods.mask() && hi > lo) {
    mods->SetUniform(kUniformQuery, static_cast<int32_t>(i));
    mods->SetRow(i, round_up(n, W));
    RunModProgram(P.mods, P.mods[kMaskStart], P.mods[kMaskCount], *mods, n, round_up(n, W), nullptr);
    verdict = P.mods[kMaskOut];
  }
  auto mod_allows = [&](int64_t c) {
    int32_t x;
    std::memcpy(&x, RegisterLane(*mods, verdict, c), sizeof x);
    return x != 0;
  };
  if (kv_seg == nullptr && mask == nullptr && verdict < 0 && !poison.any()) return;
  if (mask == nullptr && verdict < 0 && !poison.any()) {  // segment ids alone (packed documents): SIMD compares
    int64_t c = lo;
    for (; c + W <= hi; c += W) {
      vi ids;
      std::memcpy(&ids, kv_seg + c, sizeof ids);
      store(row + c, select(ids != q_seg, splat(NEG_INF), load(row + c)));
    }
    for (; c < hi; ++c)
      if (kv_seg[c] != q_seg) row[c] = NEG_INF;
    return;
  }
  for (int64_t c = lo; c < hi; ++c) {
    if ((kv_seg != nullptr && kv_seg[c] != q_seg) || (mask != nullptr && !mask[c]) ||
        (verdict >= 0 && !mod_allows(c)))
      row[c] = NEG_INF;
    else if (q_bad || (poison.k && poison.k[c]) || (poison.v && poison.v[c])) row[c] = NAN;
  }
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

// row[c] = 2^((row[c] - max) * mult) for c < n, 0 for n <= c < nw; returns their sum. The
// row max is subtracted first (exact near it), so that logits of 1e9 keep their digits.
inline float ExpRow(float* row, int64_t n, int64_t nw, float max, float mult) {
  vf sum = splat(0.0f), vm = splat(mult), vmax = splat(max);
  int64_t c = 0;
  for (; c + W <= n; c += W) {
    vf p = exp2v((load(row + c) - vmax) * vm);
    store(row + c, p);
    sum += p;
  }
  float total = 0.0f;
  for (; c < n; ++c) {
    row[c] = exp2s((row[c] - max) * mult);
    total += row[c];
  }
  for (; c < nw; ++c) row[c] = 0.0f;
  for (int w = 0; w < W; ++w) total += sum[w];
  return total;
}

// One backward tile row, its logits S and mask applied (excluded pairs at -inf): P recomputed
// from the forward's statistics, 2^((S - max) * log2(e) - log_sum * log2(e)) (the max
// subtracted first, as the forward did); P and dS = P (dP - delta) are exactly 0 at an
// excluded pair, whatever the statistics and delta of a NaN row hold (a NaN row reaches only
// the keys it attends). With a score_mod, S is its result: `ct` (when not null) receives that
// dS, and dS becomes the logits' before it, times `slope` (d score_mod / dS).
// d(q.k) = dS times the soft cap's derivative 1 - tanh^2 (`capped`: the tanh row) when `cap`.
// Leaves P in t, d(q.k) in dp, dS in dbias (unless null); dp arrives dropped (dropout).
inline void GradientRow(int64_t n, int64_t nw, float* t, float* dp, const float* capped,
                        float* dbias, float max, float log_sum, float delta, bool cap,
                        const float* slope, float* ct) {
  const float shift = -log_sum * LOG2_E;
  auto step = [&](vf x, vf dpv, vf cv, vf sv, vf* dqk, vf* ds_out) {
    vi excluded = x == NEG_INF;
    vf p = select(excluded, splat(0.0f), exp2v((x - max) * LOG2_E + shift));
    vf ds = select(excluded, splat(0.0f), p * (dpv - delta));
    *ds_out = ds;
    if (slope != nullptr) ds = select(excluded, splat(0.0f), ds * sv);
    *dqk = cap ? select(excluded, splat(0.0f), ds * (1.0f - cv * cv)) : ds;
    return std::pair<vf, vf>(p, ds);
  };
  int64_t c = 0;
  for (; c + W <= n; c += W) {
    vf dqk, ds_out;
    auto [p, ds] = step(load(t + c), load(dp + c), cap ? load(capped + c) : vf{},
                        slope != nullptr ? load(slope + c) : vf{}, &dqk, &ds_out);
    store(t + c, p);
    store(dp + c, dqk);
    if (dbias != nullptr) store(dbias + c, ds);
    if (ct != nullptr) store(ct + c, ds_out);
  }
  for (; c < n; ++c) {  // the tail, in lane 0
    vf dqk, ds_out;
    auto [p, ds] = step(splat(t[c]), splat(dp[c]), splat(cap ? capped[c] : 0.0f),
                        splat(slope != nullptr ? slope[c] : 0.0f), &dqk, &ds_out);
    t[c] = p[0];
    dp[c] = dqk[0];
    if (dbias != nullptr) dbias[c] = ds[0];
    if (ct != nullptr) ct[c] = ds_out[0];
  }
  for (; c < nw; ++c) {
    t[c] = dp[c] = 0.0f;
    if (ct != nullptr) ct[c] = 0.0f;
  }
}

// One thread's buffers (kept between calls: their size depends only on the tiles).
struct TileScratch {
  std::vector<float> q, k, v, kt, vt, t, dp, capped, acc, slope;  // q, k, v: finite copies
  ModRegisters mods;
  std::vector<uint8_t> q_bad, k_bad, v_bad;
  std::vector<int64_t> chunk_tiles;  // the backward's key tiles of its item (ChunkTiles)
};

// A row's end, in the forward and decode: `parts` partial results (part(p) -> Partial: the
// max of its logits S, -inf where it saw none; its sum and unnormalised acc [D], relative to
// that max) and the sink as one more term, combined by log-sum-exp in part order; writes the
// output row o [D] and the RowStats (an empty row: 0 and max +inf, log_sum 0), whose max is
// the winning part's `stats_max`.
struct Partial {
  float max, sum;
  const float* acc;
  float stats_max;  // the max as the backward's S takes it (decode: summed in its order)
};
template <typename Parts>
inline void FinishRow(int64_t parts, Parts part, float sink, int64_t D, float* o, float* row_max,
                      float* log_sum) {
  float mx = sink, stats_max = sink;
  for (int64_t p = 0; p < parts; ++p) {
    const Partial x = part(p);
    if (x.max > mx) mx = x.max, stats_max = x.stats_max;
  }
  const float safe = mx == NEG_INF ? 0.0f : mx;
  float l = sink > NEG_INF ? exp2s((sink - safe) * LOG2_E) : 0.0f;
  std::fill(o, o + D, 0.0f);
  for (int64_t p = 0; p < parts; ++p) {
    // 0 for a part that saw no finite logit (its max -inf): 0 times its sum keeps a NaN.
    const Partial x = part(p);
    const float w = exp2s((x.max - safe) * LOG2_E);
    l += w * x.sum;
    for (int64_t d = 0; d < D; ++d) o[d] += w * x.acc[d];
  }
  const bool empty = l == 0.0f;  // a NaN sum is not empty: the row's output is NaN
  const float inv = empty ? 0.0f : 1.0f / l;
  for (int64_t d = 0; d < D; ++d) o[d] = empty ? 0.0f : o[d] * inv;
  *row_max = empty ? INFINITY : stats_max;
  *log_sum = empty ? 0.0f : std::log(l);
}

// ---------------------------------------------------------------------------------------------
// Forward: one item per (b, hq, query tile). q [B, Lq, Hq, D] as given; k as K^T panels
// kt [B, Hkv, Lk_pad / PW, D, PW] and v head-major [B, Hkv, Lk, D] (XLA lays them out once per
// call), so that each key tile's operands are contiguous blocks. Outputs: out [B, Lq, Hq, D],
// RowStats row_max and log_sum [B, Hq, Lq] (natural log; an empty row has max = +inf, 0).
template <typename Pool>
void Forward(const Problem& P, const float* q, const float* kt, const float* v, int64_t lk_pad,
             float* out, float* row_max, float* log_sum, int64_t bq, int64_t bk, Pool& pool) {
  const int64_t D = P.D, q_tiles = (P.Lq + bq - 1) / bq, ldt = round_up(bk, PW);
  const float unit = P.unit(), mult = unit * LOG2_E;
  const float kept = P.kept_scale();
  const uint32_t threshold = P.keep_threshold();
  const NonFiniteTiles k_bad_tiles(pool, kt, P.B * P.Hkv, lk_pad * D, bk * D);
  const NonFiniteTiles v_bad_tiles(pool, v, P.B * P.Hkv, P.Lk * D, bk * D);
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
    ModRegisters* mods = P.mods ? &s.mods : nullptr;
    if (mods != nullptr) {
      mods->Resize(P.mods, ldt, bq);
      mods->SetUniform(kUniformBatch, static_cast<int32_t>(b));
      mods->SetUniform(kUniformHead, static_cast<int32_t>(h));
    }
    // The online softmax starts from (m, l) = (-inf, 0), its max in the tile's domain (see
    // Problem::unit); the sink joins at the end (FinishRow).
    std::vector<float> mx(m, NEG_INF), l(m, 0.0f);
    const uint32_t seed = P.dropout_rate > 0.0f ? *P.seeds.at(b, h) : 0;
    const uint8_t* q_bad = BadRowFlags(qa_raw, q_stride, m, D, s.q_bad.data());
    Span keys = P.KeySpan(b, i0, i1, bk);
    for (int64_t j0 = keys.lo; j0 < keys.hi; j0 += bk) {
      const TileClass cls = P.Class(b, h, tile, j0 / bk);
      if (cls == kEmpty) continue;
      int64_t j1 = std::min(keys.hi, j0 + bk), n = j1 - j0, nw = round_up(n, W);
      FLASH_CPU_CHECK(j0 % PW == 0 && j1 <= P.Lk);
      const float* k_panels = kth + (j0 / PW) * D * PW;
      const float* v_rows = vh + j0 * D;
      const int64_t panel_floats = round_up(n, PW) * D;
      // The non-finite rule: clean copies and poisoned pairs, only where something is bad.
      Poison poison;
      if (k_bad_tiles(b * P.Hkv + hk, j0 / bk) && AnyNonFinite(k_panels, panel_floats)) {
        BadColumns(k_panels, D, n, s.k_bad.data());
        poison.k = s.k_bad.data();
      }
      if (v_bad_tiles(b * P.Hkv + hk, j0 / bk))
        poison.v = BadRowFlags(v_rows, D, n, D, s.v_bad.data());
      poison.q = q_bad;
      const bool masked = poison.any() || !P.unmasked(b, i0, i1, j0, j1, cls);
      const float* qa = qa_raw;
      int64_t qa_r = q_stride;
      if (poison.any()) {
        CopyRowsFinite(qa_raw, q_stride, m, D, s.q.data());
        CopyFinite(k_panels, panel_floats, s.kt.data());
        CopyFinite(v_rows, n * D, s.v.data());
        qa = s.q.data(); qa_r = D; k_panels = s.kt.data(); v_rows = s.v.data();
      }
      float* t = s.t.data();
      Gemm(m, nw, D, qa, qa_r, 1, k_panels, PW, D * PW, t, ldt, false);  // t = q k^T
      if (mods != nullptr) {  // the keys, and the values along the tile's diagonals
        mods->SetKeys(j0, nw);
        ModTile(P.mods, *mods, false, i0, m, j0, nw);
      }
      for (int64_t r = 0; r < m; ++r) {
        float* tr = t + r * ldt;
        RowLogits(P, b, h, i0 + r, j0, n, tr, nullptr, false);
        if (P.mods.score()) ScoreRow(P.mods, *mods, i0 + r, tr, n, nw);
        if (masked) MaskRow(P, b, h, i0 + r, j0, n, tr, poison.q && poison.q[r], poison, mods);
        // Online softmax in base 2: p = 2^((t - max) * unit * log2(e)).
        float new_max = std::max(mx[r], RowMax(tr, n));
        float safe_max = new_max == NEG_INF ? 0.0f : new_max;  // no finite logit yet
        float rescale = exp2s((mx[r] - safe_max) * mult);  // 0 while mx is -inf
        l[r] = rescale * l[r] + ExpRow(tr, n, nw, safe_max, mult);
        mx[r] = new_max;
        if (P.dropout_rate > 0.0f)  // on P where it meets V; the sum keeps every p
          DropRow(seed, RowKey(seed, i0 + r), j0, n, threshold, kept, tr);
        if (rescale != 1.0f) {
          float* a = s.acc.data() + r * D;
          for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
        }
      }
      Gemm(m, D, n, t, ldt, 1, v_rows, D, PW, s.acc.data(), D, true);  // acc += p v
    }
    const float sink = P.sinks ? *P.sinks.at(b, h) : NEG_INF;
    for (int64_t r = 0; r < m; ++r) {
      // The row's max as S: fl(t_max * unit), the product the backward's S takes at that key.
      const Partial row{mx[r] * unit, l[r], s.acc.data() + r * D, mx[r] * unit};
      const int64_t st = (b * P.Hq + h) * P.Lq + i0 + r;
      float* o = out + ((b * P.Lq + i0 + r) * P.Hq + h) * D;
      FinishRow(1, [&](int64_t) { return row; }, sink, D, o, row_max + st, log_sum + st);
    }
  };
  ParallelFor(pool, P.B * P.Hq * q_tiles, run);
}

// The key tiles of chunk `chunk` of `chunks` for batch row b, kv head hk, ascending, into
// `tiles`: every chunks-th tile (the band's work spreads evenly so), or, with tile classes,
// each tile in turn to the chunk with the least work so far (its non-empty query tiles over
// the kv head's query heads; ties to the lower chunk): packed documents leave most tiles
// empty, and every chunks-th tile of each document would not be an even share.
inline void ChunkTiles(const Problem& P, int64_t b, int64_t hk, int64_t chunk, int64_t chunks,
                       int64_t bq, int64_t bk, std::vector<int64_t>& tiles) {
  const int64_t k_tiles = (P.Lk + bk - 1) / bk;
  tiles.clear();
  if (!P.tiles || chunks == 1) {
    for (int64_t tile = chunk; tile < k_tiles; tile += chunks) tiles.push_back(tile);
    return;
  }
  std::vector<int64_t> load(chunks, 0);
  for (int64_t tile = 0; tile < k_tiles; ++tile) {
    const Span rows = P.QuerySpan(b, tile * bk, std::min(P.Lk, (tile + 1) * bk), bq);
    int64_t work = 0;
    for (int64_t h = hk * P.groups(); h < (hk + 1) * P.groups(); ++h)
      for (int64_t i0 = rows.lo; i0 < rows.hi; i0 += bq) work += P.Class(b, h, i0 / bq, tile) != kEmpty;
    const int64_t least = std::min_element(load.begin(), load.end()) - load.begin();
    load[least] += work;
    if (least == chunk) tiles.push_back(tile);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward (FlashAttention-2's Algorithm 2): one item per (b, kv head, key chunk), every array
// head-major ([B, H, L, D]). A key tile's dK, dV stay in the scratch while the query tiles of
// its query heads pass; dq accumulates into dq_parts[chunk] (one float32 buffer per chunk,
// summed by the caller), unscaled like dK until the end. dbias [B, Hq, Lq, Lk] (null: not
// wanted) receives dS of every visited pair; the caller zeroes it first. d_mod_aux [items,
// mod_aux floats] (null without a score_mod's mod_aux cotangent): each item's sum, in its own
// order (so the caller's sum over items repeats bit for bit); the caller zeroes it first.
template <typename Pool>
void Backward(const Problem& P, const float* q, const float* k, const float* v, const float* d_out,
              const float* row_max, const float* log_sum, const float* delta, float* dq_parts,
              float* dk, float* dv, float* dbias, int64_t bq, int64_t bk, int64_t chunks,
              Pool& pool, float* d_mod_aux = nullptr) {
  const int64_t D = P.D, G = P.groups(), ldt = round_up(bk, PW);
  const bool cap = P.soft_cap > 0.0f;
  const float kept = P.kept_scale();
  const uint32_t threshold = P.keep_threshold();
  const int64_t dq_size = P.B * P.Hq * P.Lq * D;
  const NonFiniteTiles q_bad_tiles(pool, q, P.B * P.Hq, P.Lq * D, bq * D);
  auto run = [&](int64_t item) {
    static thread_local TileScratch s;
    int64_t chunk = item % chunks, bh = item / chunks, b = bh / P.Hkv, hk = bh % P.Hkv;
    const float* kh = k + bh * P.Lk * D;
    const float* vh = v + bh * P.Lk * D;
    s.kt.resize(D * ldt); s.vt.resize(D * ldt); s.t.resize(bq * ldt); s.dp.resize(bq * ldt);
    if (cap) s.capped.resize(bq * ldt);
    s.q.resize(bq * D); s.k.resize(bk * D); s.acc.resize(2 * bk * D);
    s.q_bad.resize(bq); s.k_bad.resize(bk); s.v_bad.resize(bk);
    ModRegisters* mods = P.mods ? &s.mods : nullptr;
    float* d_aux = P.mods.scatter() ? d_mod_aux + item * P.mods.aux_floats() : nullptr;
    if (mods != nullptr) {
      mods->Resize(P.mods, ldt, bq);
      mods->SetUniform(kUniformBatch, static_cast<int32_t>(b));
      s.slope.resize(ldt);
    }
    ChunkTiles(P, b, hk, chunk, chunks, bq, bk, s.chunk_tiles);
    for (const int64_t tile : s.chunk_tiles) {
      int64_t j0 = tile * bk, j1 = std::min(P.Lk, j0 + bk), n = j1 - j0, nw = round_up(n, W);
      float* dk_acc = s.acc.data();           // [n, D]
      float* dv_acc = s.acc.data() + bk * D;  // [n, D]
      std::fill(dk_acc, dk_acc + 2 * bk * D, 0.0f);
      Span rows = P.QuerySpan(b, j0, j1, bq);
      const float* k_rows = kh + j0 * D;
      const float* v_rows = vh + j0 * D;
      Poison key_poison;
      key_poison.k = BadRowFlags(k_rows, D, n, D, s.k_bad.data());
      key_poison.v = BadRowFlags(v_rows, D, n, D, s.v_bad.data());
      int packed = -1;  // whether kt/vt hold the clean (1) or raw (0) tile
      for (int64_t g = 0; g < G; ++g) {
        int64_t h = hk * G + g, row0 = (b * P.Hq + h) * P.Lq;
        const float* qh = q + row0 * D;
        const float* doh = d_out + row0 * D;
        float* dqh = dq_parts + chunk * dq_size + row0 * D;
        const uint32_t seed = P.dropout_rate > 0.0f ? *P.seeds.at(b, h) : 0;
        if (mods != nullptr) {
          mods->SetUniform(kUniformHead, static_cast<int32_t>(h));
          mods->SetKeys(j0, nw);
        }
        for (int64_t i0 = rows.lo; i0 < rows.hi; i0 += bq) {
          const TileClass cls = P.Class(b, h, i0 / bq, tile);
          if (cls == kEmpty) continue;
          int64_t i1 = std::min(rows.hi, i0 + bq), m = i1 - i0;
          FLASH_CPU_CHECK(i1 <= P.Lq);
          Poison poison = key_poison;
          if (q_bad_tiles(b * P.Hq + h, i0 / bq))
            poison.q = BadRowFlags(qh + i0 * D, D, m, D, s.q_bad.data());
          const bool clean = poison.any();
          const bool masked = clean || !P.unmasked(b, i0, i1, j0, j1, cls);
          if (packed != static_cast<int>(clean)) {  // K^T, V^T panels of the key tile
            PackPanels(k_rows, n, D, s.kt.data(), clean);
            PackPanels(v_rows, n, D, s.vt.data(), clean);
            if (clean) CopyFinite(k_rows, n * D, s.k.data());
            packed = clean;
          }
          const float* qa = qh + i0 * D;
          if (clean) {
            CopyRowsFinite(qa, D, m, D, s.q.data());
            qa = s.q.data();
          }
          const float* do_rows = doh + i0 * D;
          float* t = s.t.data();
          float* dp = s.dp.data();
          if (mods != nullptr) ModTile(P.mods, *mods, true, i0, m, j0, nw);  // the diagonals
          Gemm(m, nw, D, qa, D, 1, s.kt.data(), PW, D * PW, t, ldt, false);        // q k^T
          Gemm(m, nw, D, do_rows, D, 1, s.vt.data(), PW, D * PW, dp, ldt, false);  // dO v^T
          for (int64_t r = 0; r < m; ++r) {
            const int64_t i = i0 + r;
            float* tr = t + r * ldt;
            float* dpr = dp + r * ldt;
            float* cr = cap ? s.capped.data() + r * ldt : nullptr;  // the soft cap's tanh
            RowLogits(P, b, h, i, j0, n, tr, cr, true);
            const float* slope = nullptr;  // d score_mod / dS
            if (P.mods.score()) {
              ScoreGradientRow(P.mods, *mods, i, tr, s.slope.data(), n, nw);
              slope = s.slope.data();
            }
            if (masked) MaskRow(P, b, h, i, j0, n, tr, poison.q && poison.q[r], poison, mods);
            if (P.dropout_rate > 0.0f)  // dP reaches P through the forward's dropout mask
              DropRow(seed, RowKey(seed, i), j0, n, threshold, kept, dpr);
            float* dbr = dbias == nullptr ? nullptr : dbias + (row0 + i) * P.Lk + j0;
            float* ct = d_aux != nullptr ? mods->at(kRowCotangent) : nullptr;
            GradientRow(n, nw, tr, dpr, cr, dbr, row_max[row0 + i], log_sum[row0 + i],
                        delta[row0 + i], cap, slope, ct);
            if (ct != nullptr)  // the mod_aux cotangent: ct times the partials of the reads
              RunModProgram(P.mods, P.mods[kScatterStart], P.mods[kScatterCount], *mods, n, nw,
                            d_aux);
            if (P.dropout_rate > 0.0f)  // dV = P_dropped^T dO
              DropRow(seed, RowKey(seed, i), j0, n, threshold, kept, tr);
          }
          Gemm(n, D, m, t, 1, ldt, do_rows, D, PW, dv_acc, D, true);  // dV += P^T dO
          Gemm(n, D, m, dp, 1, ldt, qa, D, PW, dk_acc, D, true);      // dK += dS^T q
          Gemm(m, D, n, dp, ldt, 1, clean ? s.k.data() : k_rows, D, PW, dqh + i0 * D, D,
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

// ---------------------------------------------------------------------------------------------
// Decode (few query rows against a long KV cache), forward only. The cache is read where it
// lies, never copied or relaid out as a whole: dense k, v [B, Lk, Hkv, Dk], or pages
// [num_pages, page_size, Hkv, Dk] addressed through a page table [B, pages_per_sequence]
// (logical key j of row b: page table[b, j / page_size], slot j % page_size), in float32,
// bfloat16 or float16 (computed in float32). One item per (batch row, kv head, split):
// the G = Hq / Hkv query heads times the Lq rows that share the kv head form the tile's rows
// (query-group packing: each key row is read once per kv head), and the key range is split
// over `splits` items, each leaving a partial (acc, max, sum) that DecodeMerge combines
// exactly (log-sum-exp), in a fixed order: the result does not depend on the threads' timing.

enum class CacheType { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct KvCache {
  const void* k = nullptr;
  const void* v = nullptr;
  CacheType type = CacheType::kF32;
  int64_t Dk = 0;          // the cache's head_dim (the kernel pads its float32 copies to Dp)
  int64_t Lk_dense = 0;    // dense: keys per batch row
  const int32_t* page_table = nullptr;  // null: dense
  int64_t pages_per_sequence = 0, page_size = 0, num_pages = 0;

  // off[c] = the element offset of key j + c's row of kv head 0 in batch row b, for c < n (kv
  // head hk's row follows at + hk * Dk): one page-table read per page, no division per key.
  // Page ids are clamped by the caller; clamped here again so no id can read out of bounds.
  void rows(const Problem& P, int64_t b, int64_t j, int64_t n, int64_t* off) const {
    const int64_t key = P.Hkv * Dk;
    if (page_table == nullptr) {
      for (int64_t c = 0; c < n; ++c) off[c] = (b * Lk_dense + j + c) * key;
      return;
    }
    for (int64_t c = 0; c < n;) {
      const int64_t at = j + c, slot = at % page_size;
      const int64_t page = std::clamp<int64_t>(page_table[b * pages_per_sequence + at / page_size],
                                               0, num_pages - 1);
      const int64_t run = std::min(n - c, page_size - slot), base = (page * page_size + slot) * key;
      for (int64_t t = 0; t < run; ++t) off[c + t] = base + t * key;
      c += run;
    }
  }
  int64_t element_bytes() const { return type == CacheType::kF32 ? 4 : 2; }
};

template <typename T>
inline float ToFloat(T x);
template <>
inline float ToFloat<float>(float x) { return x; }
struct BF16 { uint16_t bits; };
template <>
inline float ToFloat<BF16>(BF16 x) {
  uint32_t u = uint32_t{x.bits} << 16;
  float f; std::memcpy(&f, &u, sizeof f);
  return f;
}
template <>
inline float ToFloat<_Float16>(_Float16 x) { return static_cast<float>(x); }

typedef uint16_t vh16 __attribute__((vector_size(W * sizeof(uint16_t))));
typedef _Float16 vf16 __attribute__((vector_size(W * sizeof(_Float16))));

// W elements of a 16-bit cache row as float32, one vector conversion.
template <typename T>
inline vf VectorToFloat(const T* src) {
  if constexpr (std::is_same_v<T, BF16>) {  // bfloat16: the top half of a float32's bits
    vh16 h;
    std::memcpy(&h, src, sizeof h);
    vu bits = __builtin_convertvector(h, vu) << 16;
    vf f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    static_assert(std::is_same_v<T, _Float16>);
    vf16 h;
    std::memcpy(&h, src, sizeof h);
    return __builtin_convertvector(h, vf);
  }
}

// A cache row of Dk elements as float32 into dst[0, Dp), zeros past Dk.
template <typename T>
inline void RowToFloat(const T* src, int64_t Dk, int64_t Dp, float* dst) {
  int64_t d = 0;
  if constexpr (!std::is_same_v<T, float>) {
    for (; d + W <= Dk; d += W) store(dst + d, VectorToFloat<T>(src + d));
  }
  for (; d < Dk; ++d) dst[d] = ToFloat<T>(src[d]);
  for (; d < Dp; ++d) dst[d] = 0.0f;
}

// The lanes of x summed as a tree (W / 2 adds at the first level: no long chain of adds).
inline float HorizontalSum(vf x) {
  float lanes[W];
  std::memcpy(lanes, &x, sizeof x);
  for (int width = W / 2; width >= 1; width /= 2)
    for (int w = 0; w < width; ++w) lanes[w] += lanes[w + width];
  return lanes[0];
}

// sums[c] = the lane sum of acc[c] for c < W (W accumulators reduced together: a transpose
// by shuffles, W - 1 adds of whole vectors, instead of W horizontal sums).
inline vf LaneSums(const vf* acc) {
#if defined(__AVX512F__)
  static_assert(W == 16);
  vf x[8], y[4], z[2];
  for (int k = 0; k < 8; ++k)  // [key 2k: 8 partials][key 2k+1: 8 partials]
    x[k] = __builtin_shufflevector(acc[2 * k], acc[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                   18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(acc[2 * k], acc[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                   25, 26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)  // 4 keys, 4 partials each
    y[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(x[2 * k], x[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)  // 8 keys, 2 partials each
    z[k] = __builtin_shufflevector(y[2 * k], y[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(y[2 * k], y[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
#else
  vf sums;
  for (int c = 0; c < W; ++c) sums[c] = HorizontalSum(acc[c]);
  return sums;
#endif
}

// t[r * ldt + c] = q[r] . key[c] for r < m, c < round_up(n, W) (keys past n give 0; rows of
// Dp floats, Dp a multiple of W; ldt a multiple of W).
inline void DecodeLogits(int64_t m, int64_t n, int64_t Dp, const float* q, const float* const* key,
                         float* t, int64_t ldt) {
  constexpr int RB = 4;  // query rows per pass over a group of W keys
  for (int64_t c0 = 0; c0 < n; c0 += W) {
    const int64_t keys = std::min<int64_t>(W, n - c0);
    for (int64_t r0 = 0; r0 < m; r0 += RB) {
      const int rows = static_cast<int>(std::min<int64_t>(RB, m - r0));
      vf acc[RB][W];
      // Two keys at a time: 2 * RB independent chains of multiply-adds (one chain per row
      // would wait on the adds' latency).
      for (int64_t c = 0; c < W; c += 2) {
        vf a[RB][2] = {};
        const float* k0 = c < keys ? key[c0 + c] : nullptr;
        const float* k1 = c + 1 < keys ? key[c0 + c + 1] : nullptr;
        if (k1 != nullptr && rows == RB) {
          for (int64_t d = 0; d < Dp; d += W) {
            vf kv0 = load(k0 + d), kv1 = load(k1 + d);
            for (int r = 0; r < RB; ++r) {
              vf qv = load(q + (r0 + r) * Dp + d);
              a[r][0] += qv * kv0;
              a[r][1] += qv * kv1;
            }
          }
        } else {
          for (int u = 0; u < 2; ++u) {
            const float* kr = u == 0 ? k0 : k1;
            if (kr == nullptr) continue;
            for (int64_t d = 0; d < Dp; d += W) {
              vf kv = load(kr + d);
              for (int r = 0; r < rows; ++r) a[r][u] += load(q + (r0 + r) * Dp + d) * kv;
            }
          }
        }
        for (int r = 0; r < RB; ++r) {
          acc[r][c] = a[r][0];
          acc[r][c + 1] = a[r][1];
        }
      }
      for (int r = 0; r < rows; ++r) store(t + (r0 + r) * ldt + c0, LaneSums(acc[r]));
    }
  }
}

// acc[r, d0 + v W] += sum_c p[r * ldt + c] value[c][d0 + v W], R x N vectors in registers.
template <int R, int N>
void DecodeValuesMicro(int64_t n, const float* p, int64_t ldt, const float* const* value,
                       int64_t d0, float* acc, int64_t Dp) {
  vf a[R][N];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < N; ++v) a[r][v] = load(acc + r * Dp + d0 + v * W);
  for (int64_t c = 0; c < n; ++c) {
    vf vv[N];
    for (int v = 0; v < N; ++v) vv[v] = load(value[c] + d0 + v * W);
    for (int r = 0; r < R; ++r) {
      vf pr = splat(p[r * ldt + c]);
      for (int v = 0; v < N; ++v) a[r][v] += pr * vv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < N; ++v) store(acc + r * Dp + d0 + v * W, a[r][v]);
}
template <int R, int N>
void DecodeValuesEdge(int rows, int nv, int64_t n, const float* p, int64_t ldt,
                      const float* const* value, int64_t d0, float* acc, int64_t Dp) {
  if constexpr (R > 1) {
    if (rows < R) return DecodeValuesEdge<R - 1, N>(rows, nv, n, p, ldt, value, d0, acc, Dp);
  }
  if constexpr (N > 1) {
    if (nv < N) return DecodeValuesEdge<R, N - 1>(rows, nv, n, p, ldt, value, d0, acc, Dp);
  }
  DecodeValuesMicro<R, N>(n, p, ldt, value, d0, acc, Dp);
}

// The decode values' microkernel: rows x vectors. With 16 registers, 4 x 2 (8 accumulators)
// rather than the GEMM's 6 x 2: a decode tile has G * Lq rows, often 4, which 4 x 2 covers in
// one pass over the value rows.
#if defined(__AVX512F__)
constexpr int DECODE_MR = MR, DECODE_NV = NV;
#else
constexpr int DECODE_MR = 4, DECODE_NV = 2;
#endif

// acc[r] += sum_c p[r * ldt + c] value[c] for r < m (rows of Dp floats).
inline void DecodeValues(int64_t m, int64_t n, int64_t Dp, const float* p, int64_t ldt,
                         const float* const* value, float* acc) {
  for (int64_t d0 = 0; d0 < Dp; d0 += DECODE_NV * W) {
    const int nv = static_cast<int>(std::min<int64_t>(DECODE_NV, (Dp - d0) / W));
    for (int64_t r0 = 0; r0 < m; r0 += DECODE_MR)
      DecodeValuesEdge<DECODE_MR, DECODE_NV>(static_cast<int>(std::min<int64_t>(DECODE_MR, m - r0)),
                                             nv, n, p + r0 * ldt, ldt, value, d0, acc + r0 * Dp, Dp);
  }
}

// acc[0..3] += x * 0 over x[0, count): NaN in a lane iff some x is NaN or inf.
inline void AccumulateNonFinite(vf* acc, const float* x, int64_t count) {
  int64_t i = 0;
  for (; i + 4 * W <= count; i += 4 * W)
    for (int u = 0; u < 4; ++u) acc[u] += load(x + i + u * W) * 0.0f;
  for (; i + W <= count; i += W) acc[0] += load(x + i) * 0.0f;
  for (; i < count; ++i) acc[1][0] += x[i] * 0.0f;
}

// Whether any of n rows of Dp floats holds a NaN or inf (x * 0 is NaN exactly for those);
// four independent sums, so that the adds do not wait on one another.
inline bool AnyRowNonFinite(const float* const* rows, int64_t n, int64_t Dp) {
  vf acc[4] = {};
  for (int64_t c = 0; c < n; ++c) {
    const float* row = rows[c];
    int64_t d = 0;
    for (; d + 4 * W <= Dp; d += 4 * W)
      for (int u = 0; u < 4; ++u) acc[u] += load(row + d + u * W) * 0.0f;
    for (; d < Dp; d += W) acc[0] += load(row + d) * 0.0f;
  }
  float total = HorizontalSum(acc[0] + acc[1] + acc[2] + acc[3]);
  return total != total;
}

// Keys per tile (32 measured best of 16, 32, 64 on the 2-core AVX-512 machine, under load).
// A tile's K and V rows of every kv head are contiguous in the cache (dense,
// or within a page): the item streams through them in order, which the hardware prefetchers
// follow, and they stay in L2 while the kv heads pass.
constexpr int64_t DECODE_BLOCK_K = 32;

struct DecodeScratch {
  std::vector<float> q, k, v, k_clean, v_clean, t;  // k, v: [Hkv, bk, Dp] converted rows
  std::vector<float> key_panel, dot;  // one key as a K^T panel [Dp, W] (lane 0), its logits
  std::vector<int64_t> key_offset, next_offset;  // kv head 0's row of each key
  std::vector<int64_t> max_key;  // [Hkv * M] the key of each row's running max, -1: none
  std::vector<const float*> krow, vrow;
  std::vector<uint8_t> q_bad, k_bad, v_bad;
  ModRegisters mods;
};

// The key range [lo, hi) of split `split` of `splits` over the keys the rows may attend.
inline Span DecodeSplitRange(const Problem& P, int64_t b, int64_t split, int64_t splits) {
  Span keys = P.KeySpan(b, 0, P.Lq, 1);
  int64_t per = round_up((keys.hi - keys.lo + splits - 1) / splits, DECODE_BLOCK_K);
  int64_t lo = std::min(keys.hi, keys.lo + split * per), hi = std::min(keys.hi, lo + per);
  return {lo, hi};
}

// One split of batch row b over every kv head: its partial acc [Hkv, M, Dp] (unnormalised),
// max and sum [Hkv, M], where M = G * Lq rows r = g * Lq + i of kv head hk are query head
// hk * G + g, query row i. q [B, Lq, Hq, Dp] float32.
template <typename T>
void DecodeSplit(const Problem& P, const KvCache& cache, const float* q, int64_t b, Span keys,
                 float* part_acc, float* part_max, float* part_sum, float* part_stats_max) {
  static thread_local DecodeScratch s;
  const int64_t G = P.groups(), M = G * P.Lq, HM = P.Hkv * M, Dp = P.D, Dk = cache.Dk;
  const int64_t bk = DECODE_BLOCK_K, ldt = round_up(bk, W);
  const float unit = P.unit(), mult = unit * LOG2_E;  // t unscaled, or S with a score_mod
  // Rows read in place when they already are float32 rows of Dp floats; else converted.
  const bool in_place = cache.type == CacheType::kF32 && Dk == Dp;
  s.q.resize(HM * Dp); s.t.resize(M * ldt); s.krow.resize(bk); s.vrow.resize(bk);
  if (!in_place) {
    s.k.resize(P.Hkv * bk * Dp);
    s.v.resize(P.Hkv * bk * Dp);
  }
  s.k_clean.resize(bk * Dp); s.v_clean.resize(bk * Dp); s.key_offset.resize(bk); s.next_offset.resize(bk);
  s.q_bad.resize(HM); s.k_bad.resize(bk); s.v_bad.resize(bk); s.max_key.resize(HM);
  ModRegisters* mods = P.mods ? &s.mods : nullptr;
  if (mods != nullptr) {
    mods->Resize(P.mods, ldt, 1);  // rows of several heads: the tile programs run per row
    mods->SetUniform(kUniformBatch, static_cast<int32_t>(b));
  }
  std::fill(part_acc, part_acc + HM * Dp, 0.0f);
  for (int64_t hr = 0; hr < HM; ++hr) {
    const int64_t hk = hr / M, g = (hr % M) / P.Lq, i = hr % P.Lq;
    std::memcpy(s.q.data() + hr * Dp, q + ((b * P.Lq + i) * P.Hq + hk * G + g) * Dp, Dp * sizeof(float));
    part_max[hr] = NEG_INF;
    part_sum[hr] = 0.0f;
    s.max_key[hr] = -1;
  }
  // The non-finite rule: bad query rows are flagged and computed with as 0.
  const uint8_t* q_bad = BadRows(s.q.data(), Dp, HM, Dp, s.q_bad.data()) ? s.q_bad.data() : nullptr;
  if (q_bad != nullptr) CopyFinite(s.q.data(), HM * Dp, s.q.data());
  const T* kc = static_cast<const T*>(cache.k);
  const T* vc = static_cast<const T*>(cache.v);
  for (int64_t j0 = keys.lo; j0 < keys.hi; j0 += bk) {
    const int64_t j1 = std::min(keys.hi, j0 + bk), n = j1 - j0, nw = round_up(n, W);
    FLASH_CPU_CHECK(0 <= j0 && j1 <= P.Lk);
    const bool whole = P.whole(b, 0, P.Lq, j0, j1);
    // This tile's key offsets were found one tile ago; the next tile's are found now (one
    // page-table read per page) and its key rows' first lines are touched, dense or paged, so
    // that their address translation and the streaming prefetch start while this tile runs
    // (measured on the 2-core machine: about 5% off a dense call, 8% off one with 16-key pages).
    if (j0 == keys.lo) cache.rows(P, b, j0, n, s.next_offset.data());
    std::swap(s.key_offset, s.next_offset);
    const int64_t next = std::max<int64_t>(0, std::min(keys.hi, j1 + bk) - j1);
    cache.rows(P, b, j1, next, s.next_offset.data());
    for (int64_t c = 0; c < next; ++c) {
      __builtin_prefetch(kc + s.next_offset[c]);
      __builtin_prefetch(vc + s.next_offset[c]);
    }
    // First pass, in memory order: each key's rows of every kv head lie together in the cache
    // (dense, or within a page); they are checked for non-finite values (float32 read in
    // place) or converted into the scratch (16-bit, or a head_dim to pad), streaming.
    vf check[4] = {};
    for (int64_t c = 0; c < n; ++c) {
      const int64_t off = s.key_offset[c];  // kv head hk's row is at off + hk * Dk
      if constexpr (std::is_same_v<T, float>) {
        if (in_place) {
          AccumulateNonFinite(check, kc + off, P.Hkv * Dk);
          AccumulateNonFinite(check, vc + off, P.Hkv * Dk);
          continue;
        }
      }
      for (int64_t hk = 0; hk < P.Hkv; ++hk) {
        float* kd = s.k.data() + (hk * bk + c) * Dp;
        float* vd = s.v.data() + (hk * bk + c) * Dp;
        RowToFloat<T>(kc + off + hk * Dk, Dk, Dp, kd);
        RowToFloat<T>(vc + off + hk * Dk, Dk, Dp, vd);
        AccumulateNonFinite(check, kd, Dp);
        AccumulateNonFinite(check, vd, Dp);
      }
    }
    const float checked = HorizontalSum(check[0] + check[1] + check[2] + check[3]);
    const bool tile_bad = checked != checked;
    if (mods != nullptr) mods->SetKeys(j0, nw);
    for (int64_t hk = 0; hk < P.Hkv; ++hk) {
      for (int64_t c = 0; c < n; ++c) {
        s.krow[c] = in_place ? reinterpret_cast<const float*>(kc) + s.key_offset[c] + hk * Dk
                             : s.k.data() + (hk * bk + c) * Dp;
        s.vrow[c] = in_place ? reinterpret_cast<const float*>(vc) + s.key_offset[c] + hk * Dk
                             : s.v.data() + (hk * bk + c) * Dp;
      }
      const uint8_t* head_q_bad = q_bad == nullptr ? nullptr : q_bad + hk * M;
      Poison poison;
      poison.q = head_q_bad;
      if (tile_bad && (AnyRowNonFinite(s.krow.data(), n, Dp) || AnyRowNonFinite(s.vrow.data(), n, Dp))) {
        // Rare: finite copies (the non-finite entries as 0) and per-key flags.
        for (int64_t c = 0; c < n; ++c) {
          float* kd = s.k_clean.data() + c * Dp;
          float* vd = s.v_clean.data() + c * Dp;
          s.k_bad[c] = AnyNonFinite(s.krow[c], Dp);
          s.v_bad[c] = AnyNonFinite(s.vrow[c], Dp);
          CopyFinite(s.krow[c], Dp, kd);
          CopyFinite(s.vrow[c], Dp, vd);
          s.krow[c] = kd;
          s.vrow[c] = vd;
        }
        poison.k = s.k_bad.data();
        poison.v = s.v_bad.data();
      }
      const bool masked = poison.any() || !whole;
      float* t = s.t.data();
      float* acc = part_acc + hk * M * Dp;
      DecodeLogits(M, n, Dp, s.q.data() + hk * M * Dp, s.krow.data(), t, ldt);
      for (int64_t r = 0; r < M; ++r) {
        const int64_t g = r / P.Lq, i = r % P.Lq, h = hk * G + g;
        float* tr = t + r * ldt;
        RowLogits(P, b, h, i, j0, n, tr, nullptr, false);
        if (mods != nullptr) {
          mods->SetUniform(kUniformHead, static_cast<int32_t>(h));
          ModTile(P.mods, *mods, false, i, 1, j0, nw);
        }
        if (P.mods.score()) ScoreRow(P.mods, *mods, i, tr, n, nw);
        if (masked) MaskRow(P, b, h, i, j0, n, tr, head_q_bad != nullptr && head_q_bad[r], poison, mods);
        // The forward's online softmax (its max in the tile's domain until the split's end).
        float& mx = part_max[hk * M + r];
        float& sum = part_sum[hk * M + r];
        const float tile_max = RowMax(tr, n);
        if (tile_max > mx) s.max_key[hk * M + r] = j0 + (std::find(tr, tr + n, tile_max) - tr);
        const float new_max = std::max(mx, tile_max);
        const float safe_max = new_max == NEG_INF ? 0.0f : new_max;
        const float rescale = exp2s((mx - safe_max) * mult);  // 0 while mx is -inf
        sum = rescale * sum + ExpRow(tr, n, nw, safe_max, mult);
        mx = new_max;
        if (rescale != 1.0f) {
          float* a = acc + r * Dp;
          for (int64_t d = 0; d < Dp; ++d) a[d] *= rescale;
        }
      }
      DecodeValues(M, n, Dp, t, ldt, s.vrow.data(), acc);
    }
  }
  // The RowStats' max: the max key's logit recomputed by the backward's product (Gemm: the
  // same sum, in the same order, as its S there), since these dot products sum in another
  // order and at |S| ~ 1e9 one ulp apart is e^64 in the backward's P. The softmax here keeps
  // its own max (the partial sums are relative to it).
  s.key_panel.assign(Dp * W, 0.0f); s.dot.resize(W);
  for (int64_t hr = 0; hr < HM; ++hr) {
    part_max[hr] *= unit;  // as S, as DecodeMerge takes it
    part_stats_max[hr] = part_max[hr];
    const int64_t j = s.max_key[hr];
    if (j < 0) continue;
    const int64_t hk = hr / M, g = (hr % M) / P.Lq, i = hr % P.Lq;
    int64_t off;
    cache.rows(P, b, j, 1, &off);
    for (int64_t d = 0; d < Dk; ++d) s.key_panel[d * W] = ToFloat<T>(kc[off + hk * Dk + d]);
    Gemm(1, W, Dp, s.q.data() + hr * Dp, 0, 1, s.key_panel.data(), W, Dp * W, s.dot.data(), W,
         false);
    RowLogits(P, b, hk * G + g, i, j, 1, s.dot.data(), nullptr, false);
    if (P.mods.score()) {  // the backward's S at that key is score_mod's
      mods->SetUniform(kUniformHead, static_cast<int32_t>(hk * G + g));
      mods->SetKeys(j, W);
      ModTile(P.mods, *mods, false, i, 1, j, W);
      ScoreRow(P.mods, *mods, i, s.dot.data(), 1, W);
    }
    part_stats_max[hr] = s.dot[0] * unit;
  }
}

// Merges the splits of batch row b in split order (log-sum-exp), the sink as one more term,
// and writes out [B, Lq, Hq, Dp], row_max, log_sum [B, Hq, Lq] as the forward does.
// part_* hold [B, splits, Hkv, M, (Dp)].
inline void DecodeMerge(const Problem& P, int64_t splits, const float* part_acc,
                        const float* part_max, const float* part_sum,
                        const float* part_stats_max, int64_t b, float* out, float* row_max,
                        float* log_sum) {
  const int64_t G = P.groups(), M = G * P.Lq, HM = P.Hkv * M, Dp = P.D;
  for (int64_t hr = 0; hr < HM; ++hr) {
    const int64_t hk = hr / M, g = (hr % M) / P.Lq, i = hr % P.Lq, h = hk * G + g;
    const float sink = P.sinks ? *P.sinks.at(b, h) : NEG_INF;
    auto part = [&](int64_t split) {
      const int64_t at = (b * splits + split) * HM + hr;
      return Partial{part_max[at], part_sum[at], part_acc + at * Dp, part_stats_max[at]};
    };
    const int64_t st = (b * P.Hq + h) * P.Lq + i;
    FinishRow(splits, part, sink, Dp, out + ((b * P.Lq + i) * P.Hq + h) * Dp, row_max + st,
              log_sum + st);
  }
}

// P: Lk the logical key count, D = Dp the padded head_dim of q and out; q, out
// [B, Lq, Hq, Dp] float32; row_max, log_sum [B, Hq, Lq]. One item per (b, split).
template <typename Pool>
void Decode(const Problem& P, const KvCache& cache, const float* q, float* out, float* row_max,
            float* log_sum, int64_t splits, Pool& pool) {
  const int64_t HM = P.Hkv * P.groups() * P.Lq, items = P.B * splits;
  std::vector<float> part_acc(items * HM * P.D), part_max(items * HM), part_sum(items * HM),
      part_stats_max(items * HM);
  auto run = [&](int64_t item) {
    const int64_t b = item / splits;
    const Span keys = DecodeSplitRange(P, b, item % splits, splits);
    float* acc = part_acc.data() + item * HM * P.D;
    float* mx = part_max.data() + item * HM;
    float* sum = part_sum.data() + item * HM;
    float* stats_max = part_stats_max.data() + item * HM;
    switch (cache.type) {
      case CacheType::kF32:
        DecodeSplit<float>(P, cache, q, b, keys, acc, mx, sum, stats_max);
        break;
      case CacheType::kBF16:
        DecodeSplit<BF16>(P, cache, q, b, keys, acc, mx, sum, stats_max);
        break;
      case CacheType::kF16:
        DecodeSplit<_Float16>(P, cache, q, b, keys, acc, mx, sum, stats_max);
        break;
    }
  };
  ParallelFor(pool, items, run);
  for (int64_t b = 0; b < P.B; ++b)
    DecodeMerge(P, splits, part_acc.data(), part_max.data(), part_sum.data(),
                part_stats_max.data(), b, out, row_max, log_sum);
}

}  // namespace flash_cpu
