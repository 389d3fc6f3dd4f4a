// One call as the kernels see it: shapes, the mask rules and the features (`Problem`), the
// per-(batch, head) broadcast arrays and the tile classes.
#ifndef JAX_FLASH_CPU_PROBLEM_H_
#define JAX_FLASH_CPU_PROBLEM_H_

#include <algorithm>
#include <cstdint>

#include "check.h"
#include "mod_program.h"

namespace flash_cpu {

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

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_PROBLEM_H_
