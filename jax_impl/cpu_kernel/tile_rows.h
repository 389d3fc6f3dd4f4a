// The per-row steps of a tile shared by the forward, the backward and decode: logits, the
// mods' rows, the mask, the online softmax's max and exponentials, a row's end.
#ifndef JAX_FLASH_CPU_TILE_ROWS_H_
#define JAX_FLASH_CPU_TILE_ROWS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "half.h"
#include "mod_program.h"
#include "nonfinite.h"
#include "problem.h"
#include "simd.h"

namespace flash_cpu {

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

// Values per operand element: 1 for float32, 2 for a pair of bfloat16 (bf16_dot.h).
template <typename E>
constexpr int64_t kValuesPer = std::is_same_v<E, float> ? 1 : 2;

// One thread's buffers (kept between calls: their size depends only on the tiles), for
// operands of element type E (float32, or bf16_dot.h's pairs, with the pair layouts they need).
template <typename E>
struct TileScratch {
  std::vector<E> q, k, v, kt, vt;  // q, k, v: finite copies; kt, vt: K^T, V^T panels
  std::vector<float> t, dp, capped, acc, slope;
  std::vector<Bf16Pair> p_pairs, ds_pairs, pt_pairs, dst_pairs, k_pairs, do_pairs, q_pairs, last;
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

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_TILE_ROWS_H_
