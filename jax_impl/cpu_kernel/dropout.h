// Dropout's keep decision, bit for bit as dropout_sinks.keep.
#ifndef JAX_FLASH_CPU_DROPOUT_H_
#define JAX_FLASH_CPU_DROPOUT_H_

#include <cstdint>

#include "simd.h"

namespace flash_cpu {

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

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_DROPOUT_H_
