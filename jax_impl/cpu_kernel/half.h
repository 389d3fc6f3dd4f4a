// 16-bit floats (bfloat16, float16) read as float32: one element or W at a time.
#ifndef JAX_FLASH_CPU_HALF_H_
#define JAX_FLASH_CPU_HALF_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace flash_cpu {

template <typename T>
inline float ToFloat(T x);
template <>
inline float ToFloat<float>(float x) { return x; }
struct BF16 { uint16_t bits; };
// Two bfloat16 values of consecutive k in one 32-bit word (element 2k in the low half): the
// operand element of bfloat16 products (bf16_dot.h).
struct Bf16Pair { uint32_t bits; };
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

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_HALF_H_
