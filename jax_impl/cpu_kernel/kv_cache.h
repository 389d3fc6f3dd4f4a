// A KV cache as decode reads it in place: dense rows or pages through a page table.
#ifndef JAX_FLASH_CPU_KV_CACHE_H_
#define JAX_FLASH_CPU_KV_CACHE_H_

#include <algorithm>
#include <cstdint>

#include "problem.h"

namespace flash_cpu {

enum class CacheType { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct KvCache {
  const void* k = nullptr;
  const void* v = nullptr;
  CacheType type = CacheType::kF32;
  int64_t Dk = 0;          // the cache's head_dim (the kernel pads its float32 copies to Dp)
  int64_t Lk_dense = 0;    // dense: keys per batch row
  const int32_t* page_table = nullptr;  // null: dense
  int64_t pages_per_sequence = 0, page_size = 0, num_pages = 0;
  // The call's backward multiplies bfloat16 pairs (q and the cache bfloat16, bf16_dot.h): the
  // RowStats' max is recomputed by that product.
  bool bf16_products = false;

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

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_KV_CACHE_H_
