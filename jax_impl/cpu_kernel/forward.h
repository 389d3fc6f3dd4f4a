// The forward kernel: one work item per (batch row, query head, query tile).
#ifndef JAX_FLASH_CPU_FORWARD_H_
#define JAX_FLASH_CPU_FORWARD_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_dot.h"
#include "check.h"
#include "dropout.h"
#include "gemm.h"
#include "nonfinite.h"
#include "parallel.h"
#include "problem.h"
#include "simd.h"
#include "tile_rows.h"

namespace flash_cpu {

// acc[m, D] += P[m, n] V[n, D] for a forward tile (P in t, rows ldt apart, 0 in [n, nw)): in
// float32 on V's rows [n, D]; with bfloat16 pairs, P rounded to bfloat16 (as torch's CPU
// kernel and FlashAttention round it for this product only) and V in pairs of keys [n / 2, D],
// the last pair of an odd n copied with its other key as 0 (that key lies past the tile: it
// may be non-finite, and 0 * inf is NaN).
inline void ValuesProduct(int64_t m, int64_t n, int64_t, const float* t, int64_t ldt,
                          const float* v, int64_t D, float* acc, TileScratch<float>&) {
  Gemm(m, D, n, t, ldt, 1, v, D, PW, acc, D, true);
}
#if defined(__AVX512BF16__)
inline void ValuesProduct(int64_t m, int64_t n, int64_t nw, const float* t, int64_t ldt,
                          const Bf16Pair* v, int64_t D, float* acc, TileScratch<Bf16Pair>& s) {
  const int64_t ldp = ldt / 2;
  s.p_pairs.resize(m * ldp);
  for (int64_t r = 0; r < m; ++r) RowToPairs(t + r * ldt, nw, s.p_pairs.data() + r * ldp);
  Gemm(m, D, n / 2, s.p_pairs.data(), ldp, 1, v, D, PW, acc, D, true);
  if (n % 2) {
    s.last.resize(D);
    for (int64_t d = 0; d < D; ++d) s.last[d] = {v[(n / 2) * D + d].bits & 0xffffu};
    Gemm(m, D, 1, s.p_pairs.data() + n / 2, ldp, 1, s.last.data(), D, PW, acc, D, true);
  }
}
#endif

// Forward: one item per (b, hq, query tile). q [B, Lq, Hq, D] as given; k as K^T panels
// kt [B, Hkv, Lk_pad / PW, D, PW] and v head-major [B, Hkv, Lk, D] (XLA lays them out once per
// call), so that each key tile's operands are contiguous blocks. Outputs: out [B, Lq, Hq, D],
// RowStats row_max and log_sum [B, Hq, Lq] (natural log; an empty row has max = +inf, 0).
// With bfloat16 pairs (E = Bf16Pair) q and kt hold D / 2 pairs where float32 holds D values,
// and v is in pairs of keys [B, Hkv, Lk_pad / 2, D].
template <typename E, typename Pool>
void Forward(const Problem& P, const E* q, const E* kt, const E* v, int64_t lk_pad, float* out,
             float* row_max, float* log_sum, int64_t bq, int64_t bk, Pool& pool) {
  constexpr int64_t per = kValuesPer<E>;
  const int64_t D = P.D, KD = D / per, q_tiles = (P.Lq + bq - 1) / bq, ldt = round_up(bk, PW);
  const int64_t v_rows_per_head = per == 1 ? P.Lk : lk_pad / 2;
  const float unit = P.unit(), mult = unit * LOG2_E;
  const float kept = P.kept_scale();
  const uint32_t threshold = P.keep_threshold();
  const NonFiniteTiles k_bad_tiles(pool, kt, P.B * P.Hkv, lk_pad * KD, bk * KD);
  const NonFiniteTiles v_bad_tiles(pool, v, P.B * P.Hkv, v_rows_per_head * D, bk / per * D);
  auto run = [&](int64_t item) {
    static thread_local TileScratch<E> s;
    int64_t tile = q_tiles - 1 - item % q_tiles;  // heavy query tiles first (causal)
    int64_t bh = item / q_tiles, b = bh / P.Hq, h = bh % P.Hq, hk = h / P.groups();
    int64_t i0 = tile * bq, i1 = std::min(P.Lq, i0 + bq), m = i1 - i0;
    const int64_t q_stride = P.Hq * KD;
    const E* qa_raw = q + ((b * P.Lq + i0) * P.Hq + h) * KD;
    const E* kth = kt + (b * P.Hkv + hk) * lk_pad * KD;
    const E* vh = v + (b * P.Hkv + hk) * v_rows_per_head * D;
    s.q.resize(bq * KD); s.kt.resize(KD * ldt); s.v.resize(bk / per * D); s.t.resize(bq * ldt);
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
    const uint8_t* q_bad = BadRowFlags(qa_raw, q_stride, m, KD, s.q_bad.data());
    Span keys = P.KeySpan(b, i0, i1, bk);
    for (int64_t j0 = keys.lo; j0 < keys.hi; j0 += bk) {
      const TileClass cls = P.Class(b, h, tile, j0 / bk);
      if (cls == kEmpty) continue;
      int64_t j1 = std::min(keys.hi, j0 + bk), n = j1 - j0, nw = round_up(n, W);
      FLASH_CPU_CHECK(j0 % PW == 0 && j1 <= P.Lk);
      const E* k_panels = kth + (j0 / PW) * KD * PW;
      const E* v_rows = vh + j0 / per * D;
      const int64_t panel_elements = round_up(n, PW) * KD, v_elements = (n + per - 1) / per * D;
      // The non-finite rule: clean copies and poisoned pairs, only where something is bad.
      Poison poison;
      if (k_bad_tiles(b * P.Hkv + hk, j0 / bk) && AnyNonFinite(k_panels, panel_elements)) {
        BadColumns(k_panels, KD, n, s.k_bad.data());
        poison.k = s.k_bad.data();
      }
      if (v_bad_tiles(b * P.Hkv + hk, j0 / bk)) poison.v = BadKeys(v_rows, D, n, s.v_bad.data());
      poison.q = q_bad;
      const bool masked = poison.any() || !P.unmasked(b, i0, i1, j0, j1, cls);
      const E* qa = qa_raw;
      int64_t qa_r = q_stride;
      if (poison.any()) {
        CopyRowsFinite(qa_raw, q_stride, m, KD, s.q.data());
        CopyFinite(k_panels, panel_elements, s.kt.data());
        CopyFinite(v_rows, v_elements, s.v.data());
        qa = s.q.data(); qa_r = KD; k_panels = s.kt.data(); v_rows = s.v.data();
      }
      float* t = s.t.data();
      Gemm(m, nw, KD, qa, qa_r, 1, k_panels, PW, KD * PW, t, ldt, false);  // t = q k^T
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
      ValuesProduct(m, n, nw, t, ldt, v_rows, D, s.acc.data(), s);  // acc += p v
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

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_FORWARD_H_
