// Decode (few query rows against a long KV cache), forward only. The cache is read where it
// lies, never copied or relaid out as a whole: dense k, v [B, Lk, Hkv, Dk], or pages
// [num_pages, page_size, Hkv, Dk] addressed through a page table [B, pages_per_sequence]
// (logical key j of row b: page table[b, j / page_size], slot j % page_size), in float32,
// bfloat16 or float16 (computed in float32). One item per (batch row, kv head, split):
// the G = Hq / Hkv query heads times the Lq rows that share the kv head form the tile's rows
// (query-group packing: each key row is read once per kv head), and the key range is split
// over `splits` items, each leaving a partial (acc, max, sum) that DecodeMerge combines
// exactly (log-sum-exp), in a fixed order: the result does not depend on the threads' timing.
#ifndef JAX_FLASH_CPU_DECODE_H_
#define JAX_FLASH_CPU_DECODE_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16_dot.h"
#include "check.h"
#include "gemm.h"
#include "half.h"
#include "kv_cache.h"
#include "mod_program.h"
#include "nonfinite.h"
#include "parallel.h"
#include "problem.h"
#include "simd.h"
#include "tile_rows.h"

namespace flash_cpu {

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

// dot[0] = q . key, as the backward's Gemm sums it: on float32 (key a K^T panel [Dp, W] in
// lane 0), or with `bf16_products` on bfloat16 pairs (the values of q and key are bfloat16
// then: the forward and the backward of such a call run on bf16_dot.h's products).
inline void KeyLogit(bool bf16_products, int64_t Dp, const float* q, const float* key_panel,
                     float* dot) {
#if defined(__AVX512BF16__)
  if (bf16_products) {
    auto pair = [](float lo, float hi) {  // bfloat16 values: their float32 bits' top halves
      uint32_t a, b;
      std::memcpy(&a, &lo, sizeof a);
      std::memcpy(&b, &hi, sizeof b);
      return Bf16Pair{(a >> 16) | (b & 0xffff0000u)};
    };
    std::vector<Bf16Pair> q_pairs(Dp / 2), key_pairs(Dp / 2 * W, Bf16Pair{0});
    for (int64_t d = 0; d < Dp; d += 2) {
      q_pairs[d / 2] = pair(q[d], q[d + 1]);
      key_pairs[d / 2 * W] = pair(key_panel[d * W], key_panel[(d + 1) * W]);
    }
    Gemm(1, W, Dp / 2, q_pairs.data(), 0, 1, key_pairs.data(), W, Dp / 2 * W, dot, W, false);
    return;
  }
#endif
  FLASH_CPU_CHECK(!bf16_products);
  Gemm(1, W, Dp, q, 0, 1, key_panel, W, Dp * W, dot, W, false);
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
    KeyLogit(cache.bf16_products, Dp, s.q.data() + hr * Dp, s.key_panel.data(), s.dot.data());
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

#endif  // JAX_FLASH_CPU_DECODE_H_
