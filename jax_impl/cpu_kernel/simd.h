// The SIMD layer: W floats per vector (16 with AVX-512, 8 with AVX, 4 otherwise), as GCC/Clang
// vector types, and the vector math every kernel shares (2^x, tanh, a fused multiply-add).
#ifndef JAX_FLASH_CPU_SIMD_H_
#define JAX_FLASH_CPU_SIMD_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace flash_cpu {

#if defined(__AVX512F__)
constexpr int W = 16;  // floats per SIMD vector
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
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

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

inline bool finite(float x) { return std::fabs(x) < INFINITY; }
inline float finite_part(float x) { return finite(x) ? x : 0.0f; }  // NaN, inf -> 0

// The lanes of x summed as a tree (W / 2 adds at the first level: no long chain of adds).
inline float HorizontalSum(vf x) {
  float lanes[W];
  std::memcpy(lanes, &x, sizeof x);
  for (int width = W / 2; width >= 1; width /= 2)
    for (int w = 0; w < width; ++w) lanes[w] += lanes[w + width];
  return lanes[0];
}

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_SIMD_H_
