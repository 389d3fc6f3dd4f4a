// The backward kernel (FlashAttention-2's Algorithm 2): one work item per (batch row, kv head,
// chunk of key tiles).
#ifndef JAX_FLASH_CPU_BACKWARD_H_
#define JAX_FLASH_CPU_BACKWARD_H_

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "bf16_dot.h"
#include "check.h"
#include "dropout.h"
#include "gemm.h"
#include "mod_program.h"
#include "nonfinite.h"
#include "parallel.h"
#include "problem.h"
#include "simd.h"
#include "tile_rows.h"

namespace flash_cpu {

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

// The right operand of dq += dS k for a key tile of n keys: k's float32 rows (a finite copy
// when `clean`), or k in bfloat16 pairs of keys [n / 2, D].
inline const float* DqKeys(const float* k_rows, int64_t n, int64_t D, bool clean,
                           TileScratch<float>& s) {
  if (!clean) return k_rows;
  CopyFinite(k_rows, n * D, s.k.data());
  return s.k.data();
}

// A backward tile's three products after its rows (t: P, dropped; dp: d(q.k); rows ldt apart,
// 0 in [n, nw)): dV += P^T dO, dK += dS^T q, dq += dS k.
inline void TileGradients(int64_t m, int64_t n, int64_t, const float* t, const float* dp,
                          int64_t ldt, const float* do_rows, const float* qa, const float* dq_keys,
                          int64_t D, float* dv_acc, float* dk_acc, float* dq, TileScratch<float>&) {
  Gemm(n, D, m, t, 1, ldt, do_rows, D, PW, dv_acc, D, true);  // dV += P^T dO
  Gemm(n, D, m, dp, 1, ldt, qa, D, PW, dk_acc, D, true);      // dK += dS^T q
  Gemm(m, D, n, dp, ldt, 1, dq_keys, D, PW, dq, D, true);     // dq += dS k
}

#if defined(__AVX512BF16__)
inline const Bf16Pair* DqKeys(const Bf16Pair* k_rows, int64_t n, int64_t D, bool clean,
                              TileScratch<Bf16Pair>& s) {
  s.k_pairs.resize((n + 1) / 2 * D);
  PackRowPairs(k_rows, D / 2, n, D, s.k_pairs.data(), D, clean);
  return s.k_pairs.data();
}

// The same on bfloat16: P and dS rounded to it, in pairs of query rows for the transposed
// products (dO and q likewise) and in pairs of keys for dS k; odd edges padded with 0.
inline void TileGradients(int64_t m, int64_t n, int64_t nw, const float* t, const float* dp,
                          int64_t ldt, const Bf16Pair* do_rows, const Bf16Pair* qa,
                          const Bf16Pair* dq_keys, int64_t D, float* dv_acc, float* dk_acc,
                          float* dq, TileScratch<Bf16Pair>& s) {
  const int64_t row_pairs = (m + 1) / 2, key_pairs = (n + 1) / 2, ldp = nw / 2;
  s.pt_pairs.resize(row_pairs * nw); s.dst_pairs.resize(row_pairs * nw);
  s.do_pairs.resize(row_pairs * D); s.q_pairs.resize(row_pairs * D); s.ds_pairs.resize(m * ldp);
  FloatRowsToPairs(t, ldt, m, nw, s.pt_pairs.data(), nw);
  FloatRowsToPairs(dp, ldt, m, nw, s.dst_pairs.data(), nw);
  PackRowPairs(do_rows, D / 2, m, D, s.do_pairs.data(), D, false);
  PackRowPairs(qa, D / 2, m, D, s.q_pairs.data(), D, false);
  for (int64_t r = 0; r < m; ++r) RowToPairs(dp + r * ldt, nw, s.ds_pairs.data() + r * ldp);
  Gemm(n, D, row_pairs, s.pt_pairs.data(), 1, nw, s.do_pairs.data(), D, PW, dv_acc, D, true);
  Gemm(n, D, row_pairs, s.dst_pairs.data(), 1, nw, s.q_pairs.data(), D, PW, dk_acc, D, true);
  Gemm(m, D, key_pairs, s.ds_pairs.data(), ldp, 1, dq_keys, D, PW, dq, D, true);
}
#endif

// Backward (FlashAttention-2's Algorithm 2): one item per (b, kv head, key chunk), every array
// head-major ([B, H, L, D]). A key tile's dK, dV stay in the scratch while the query tiles of
// its query heads pass; dq accumulates into dq_parts[chunk] (one float32 buffer per chunk,
// summed by the caller), unscaled like dK until the end. dbias [B, Hq, Lq, Lk] (null: not
// wanted) receives dS of every visited pair; the caller zeroes it first. d_mod_aux [items,
// mod_aux floats] (null without a score_mod's mod_aux cotangent): each item's sum, in its own
// order (so the caller's sum over items repeats bit for bit); the caller zeroes it first.
// With bfloat16 pairs (E = Bf16Pair) q, k, v and d_out hold D / 2 pairs per row; the products
// run on bfloat16, P and dS rounded to it where they meet dO, q and k (as FlashAttention's).
template <typename E, typename Pool>
void Backward(const Problem& P, const E* q, const E* k, const E* v, const E* d_out,
              const float* row_max, const float* log_sum, const float* delta, float* dq_parts,
              float* dk, float* dv, float* dbias, int64_t bq, int64_t bk, int64_t chunks,
              Pool& pool, float* d_mod_aux = nullptr) {
  const int64_t D = P.D, KD = D / kValuesPer<E>, G = P.groups(), ldt = round_up(bk, PW);
  const bool cap = P.soft_cap > 0.0f;
  const float kept = P.kept_scale();
  const uint32_t threshold = P.keep_threshold();
  const int64_t dq_size = P.B * P.Hq * P.Lq * D;
  const NonFiniteTiles q_bad_tiles(pool, q, P.B * P.Hq, P.Lq * KD, bq * KD);
  auto run = [&](int64_t item) {
    static thread_local TileScratch<E> s;
    int64_t chunk = item % chunks, bh = item / chunks, b = bh / P.Hkv, hk = bh % P.Hkv;
    const E* kh = k + bh * P.Lk * KD;
    const E* vh = v + bh * P.Lk * KD;
    s.kt.resize(KD * ldt); s.vt.resize(KD * ldt); s.t.resize(bq * ldt); s.dp.resize(bq * ldt);
    if (cap) s.capped.resize(bq * ldt);
    s.q.resize(bq * KD); s.k.resize(bk * KD); s.acc.resize(2 * bk * D);
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
      const E* k_rows = kh + j0 * KD;
      const E* v_rows = vh + j0 * KD;
      Poison key_poison;
      key_poison.k = BadRowFlags(k_rows, KD, n, KD, s.k_bad.data());
      key_poison.v = BadRowFlags(v_rows, KD, n, KD, s.v_bad.data());
      int packed = -1;  // whether kt/vt hold the clean (1) or raw (0) tile
      const E* dq_keys = nullptr;  // the right operand of dq += dS k
      for (int64_t g = 0; g < G; ++g) {
        int64_t h = hk * G + g, row0 = (b * P.Hq + h) * P.Lq;
        const E* qh = q + row0 * KD;
        const E* doh = d_out + row0 * KD;
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
            poison.q = BadRowFlags(qh + i0 * KD, KD, m, KD, s.q_bad.data());
          const bool clean = poison.any();
          const bool masked = clean || !P.unmasked(b, i0, i1, j0, j1, cls);
          if (packed != static_cast<int>(clean)) {  // K^T, V^T panels of the key tile
            PackPanels(k_rows, n, KD, s.kt.data(), clean);
            PackPanels(v_rows, n, KD, s.vt.data(), clean);
            dq_keys = DqKeys(k_rows, n, D, clean, s);
            packed = clean;
          }
          const E* qa = qh + i0 * KD;
          if (clean) {
            CopyRowsFinite(qa, KD, m, KD, s.q.data());
            qa = s.q.data();
          }
          const E* do_rows = doh + i0 * KD;
          float* t = s.t.data();
          float* dp = s.dp.data();
          if (mods != nullptr) ModTile(P.mods, *mods, true, i0, m, j0, nw);  // the diagonals
          Gemm(m, nw, KD, qa, KD, 1, s.kt.data(), PW, KD * PW, t, ldt, false);        // q k^T
          Gemm(m, nw, KD, do_rows, KD, 1, s.vt.data(), PW, KD * PW, dp, ldt, false);  // dO v^T
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
          TileGradients(m, n, nw, t, dp, ldt, do_rows, qa, dq_keys, D, dv_acc, dk_acc,
                        dqh + i0 * D, s);
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

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_BACKWARD_H_
