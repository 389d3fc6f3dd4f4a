// bfloat16 products on AVX512-BF16 (vdpbf16ps): float32 accumulators += the dot product of
// two pairs of bfloat16. An operand holds its bfloat16 values in pairs along the product's k
// axis (`Bf16Pair`: element 2k in the low half, 2k + 1 in the high half), so that Gemm<Bf16Pair>
// runs the same microkernel as float32 with K counting pairs. The products are exact in float32
// (8-bit significands); the instruction adds them to the accumulator with round-to-nearest,
// denormal inputs and outputs as zero.
//
// Layouts: a row-major bfloat16 matrix [R, C] (C even) read as [R, C / 2] pairs is a left
// operand whose k runs along the row (q, P and dS as rows); a right operand or a transposed
// left one needs its pairs across rows (`PackRowPairs`: element (k, c) of [R / 2, C] pairs holds
// rows 2k and 2k + 1 of column c). The non-finite rule reads either half of a pair.
#ifndef JAX_FLASH_CPU_BF16_DOT_H_
#define JAX_FLASH_CPU_BF16_DOT_H_

#include <cstdint>
#include <cstring>

#include "gemm.h"
#include "half.h"
#include "simd.h"

namespace flash_cpu {

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;

template <>
struct Dot<Bf16Pair> {
  static vf broadcast(Bf16Pair a) { return reinterpret_cast<vf>(_mm512_set1_epi32(static_cast<int>(a.bits))); }
  static vf load_b(const Bf16Pair* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
  static vf madd(vf a, vf b, vf acc) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
  }
};

// W float32 values rounded to bfloat16 (nearest even; NaN stays NaN), one per 32-bit lane in
// the low half.
inline __m512i Bf16Lanes(vf x) {
  return _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
}

// dst[c / 2] = the pair (row[c], row[c + 1]) rounded to bfloat16, for c < nw (nw a multiple
// of W): a float32 row as a left operand whose k runs along it (P, dS before P.V, dS.K).
inline void RowToPairs(const float* row, int64_t nw, Bf16Pair* dst) {
  int64_t c = 0;
  for (; c + 2 * W <= nw; c += 2 * W) {
    const __m512bh both = _mm512_cvtne2ps_pbh(load(row + c + W), load(row + c));
    std::memcpy(dst + c / 2, &both, sizeof both);
  }
  if (c < nw) {
    const __m256bh half = _mm512_cvtneps_pbh(load(row + c));
    std::memcpy(dst + c / 2, &half, sizeof half);
  }
}

// dst[k * ldd + c] = (src[2k][c], src[2k + 1][c]) rounded, for k < ceil(rows / 2), c < cols
// (a multiple of W), src rows `stride` floats apart; the high half is 0 past the last row: a
// float32 tile as the left operand of a transposed product (P^T, dS^T: k runs down the rows).
inline void FloatRowsToPairs(const float* src, int64_t stride, int64_t rows, int64_t cols,
                             Bf16Pair* dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; r += 2) {
    const float* lo = src + r * stride;
    const float* hi = r + 1 < rows ? lo + stride : nullptr;
    Bf16Pair* out = dst + (r / 2) * ldd;
    for (int64_t c = 0; c < cols; c += W) {
      __m512i word = Bf16Lanes(load(lo + c));
      if (hi != nullptr) word = _mm512_or_si512(word, _mm512_slli_epi32(Bf16Lanes(load(hi + c)), 16));
      std::memcpy(out + c, &word, sizeof word);
    }
  }
}
// The bfloat16 value (h) is NaN or inf.
inline bool Bf16NonFinite(uint16_t h) { return (h & 0x7f80) == 0x7f80; }
inline bool finite(Bf16Pair x) {
  return !Bf16NonFinite(static_cast<uint16_t>(x.bits)) && !Bf16NonFinite(static_cast<uint16_t>(x.bits >> 16));
}
// x with its non-finite halves as 0.
inline Bf16Pair finite_part(Bf16Pair x) {
  uint32_t bits = x.bits;
  if (Bf16NonFinite(static_cast<uint16_t>(bits))) bits &= 0xffff0000u;
  if (Bf16NonFinite(static_cast<uint16_t>(bits >> 16))) bits &= 0x0000ffffu;
  return {bits};
}

// Whether any of x[0, count) holds a NaN or inf in either half: exponent bits all set.
inline bool AnyNonFinite(const Bf16Pair* x, int64_t count) {
  const vu exponent = vu{} + 0x7f80u;
  vi bad = vi{};
  int64_t i = 0;
  for (; i + W <= count; i += W) {
    vu bits;
    std::memcpy(&bits, x + i, sizeof bits);
    bad |= ((bits & exponent) == exponent) | (((bits >> 16) & exponent) == exponent);
  }
  bool any = false;
  for (int w = 0; w < W; ++w) any |= bad[w] != 0;
  for (; i < count; ++i) any |= !finite(x[i]);
  return any;
}

// bad[c] = whether key c of n holds a NaN or inf, for value rows in pairs of keys ([n / 2, D]
// pairs: key c is half c % 2 of row c / 2); null when none does.
inline const uint8_t* BadKeys(const Bf16Pair* rows, int64_t D, int64_t n, uint8_t* bad) {
  bool any = false;
  for (int64_t c = 0; c < n; ++c) {
    const uint16_t* half = reinterpret_cast<const uint16_t*>(rows + (c / 2) * D) + c % 2;
    bool b = false;
    for (int64_t d = 0; d < D; ++d) b |= Bf16NonFinite(half[2 * d]);
    any |= (bad[c] = b);
  }
  return any ? bad : nullptr;
}

// dst[k * ldd + c] = (row 2k, row 2k + 1) of column c, for k < ceil(rows / 2), c < cols: a
// row-major bfloat16 matrix (rows `stride` pairs apart, so 2 * stride values; cols values per
// row, even) with its pairs moved across rows; 0 in the high half past the last row; its
// non-finite values as 0 if `finite_only`. The right operand of P.V, dS.k, P^T.dO, dS^T.q.
inline void PackRowPairs(const Bf16Pair* src, int64_t stride, int64_t rows, int64_t cols,
                         Bf16Pair* dst, int64_t ldd, bool finite_only) {
  const __m512i exponent = _mm512_set1_epi32(0x7f80), zero = _mm512_setzero_si512();
  auto widen = [&](const uint16_t* x) {  // W bfloat16 -> the low halves of W lanes
    __m256i h;
    std::memcpy(&h, x, sizeof h);
    __m512i w = _mm512_cvtepu16_epi32(h);
    if (finite_only)
      w = _mm512_mask_mov_epi32(w, _mm512_cmpeq_epi32_mask(_mm512_and_si512(w, exponent), exponent), zero);
    return w;
  };
  for (int64_t r = 0; r < rows; r += 2) {
    const uint16_t* lo = reinterpret_cast<const uint16_t*>(src + r * stride);
    const uint16_t* hi = r + 1 < rows ? lo + 2 * stride : nullptr;
    Bf16Pair* out = dst + (r / 2) * ldd;
    int64_t c = 0;
    for (; c + W <= cols; c += W) {
      const __m512i word = _mm512_or_si512(widen(lo + c), hi != nullptr ? _mm512_slli_epi32(widen(hi + c), 16) : zero);
      std::memcpy(out + c, &word, sizeof word);
    }
    for (; c < cols; ++c) {
      uint16_t a = lo[c], b = hi != nullptr ? hi[c] : uint16_t{0};
      if (finite_only) {
        a = Bf16NonFinite(a) ? 0 : a;
        b = Bf16NonFinite(b) ? 0 : b;
      }
      out[c] = {uint32_t{a} | uint32_t{b} << 16};
    }
  }
}
#else
constexpr bool kHasBf16Dot = false;
#endif

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_BF16_DOT_H_
