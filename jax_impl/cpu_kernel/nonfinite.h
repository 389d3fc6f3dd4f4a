// The non-finite rule's bookkeeping: which rows, keys and tiles hold a NaN or inf, and finite
// copies (those entries as 0) of the operands that do.
#ifndef JAX_FLASH_CPU_NONFINITE_H_
#define JAX_FLASH_CPU_NONFINITE_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemm.h"
#include "parallel.h"
#include "simd.h"

namespace flash_cpu {

// Whether any of x[0, count) is NaN or inf (x * 0 is NaN exactly for those). Four chains of
// adds: one would wait on each add's latency.
inline bool AnyNonFinite(const float* x, int64_t count) {
  vf acc[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
  int64_t i = 0;
  for (; i + 4 * W <= count; i += 4 * W)
    for (int u = 0; u < 4; ++u) acc[u] += load(x + i + u * W) * 0.0f;
  for (; i + W <= count; i += W) acc[0] += load(x + i) * 0.0f;
  float tail = 0.0f;
  for (; i < count; ++i) tail += x[i] * 0.0f;
  const vf all = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  for (int w = 0; w < W; ++w) tail += all[w];
  return tail != tail;
}

// bad[r] = whether row r of n rows of D elements (row stride `stride`) holds a NaN or inf.
template <typename E>
bool BadRows(const E* src, int64_t stride, int64_t n, int64_t D, uint8_t* bad) {
  bool any = false;
  for (int64_t r = 0; r < n; ++r) any |= (bad[r] = AnyNonFinite(src + r * stride, D));
  return any;
}

// bad[r] for n rows of D floats (row stride `stride`), or null when none holds a NaN or inf
// (contiguous rows are first checked in one pass).
template <typename E>
const uint8_t* BadRowFlags(const E* src, int64_t stride, int64_t n, int64_t D, uint8_t* bad) {
  if (stride == D && !AnyNonFinite(src, n * D)) return nullptr;
  return BadRows(src, stride, n, D, bad) ? bad : nullptr;
}

// For K^T panels of D rows (PackPanels' layout, starting at a panel): bad[c] for columns
// [0, cols), whether key c holds a non-finite value.
template <typename E>
void BadColumns(const E* panels, int64_t D, int64_t cols, uint8_t* bad) {
  for (int64_t c = 0; c < cols; ++c) {
    const E* col = panels + (c / PW) * D * PW + c % PW;
    bool b = false;
    for (int64_t d = 0; d < D; ++d) b |= !finite(col[d * PW]);
    bad[c] = b;
  }
}

// Per tile of an operand, whether it holds a NaN or inf: tile t of head h is floats
// [t * tile_floats, (t + 1) * tile_floats) of that head's head_floats (the last tile shorter).
// One pass over the operand per call, so that the tile loops, which meet each tile once per
// tile of the other side, test a flag instead of the tile.
struct NonFiniteTiles {
  std::vector<uint8_t> bad;  // [heads, tiles]
  int64_t tiles = 0;
  template <typename Pool, typename E>
  NonFiniteTiles(Pool& pool, const E* x, int64_t heads, int64_t head_floats,
                 int64_t tile_floats)
      : bad(heads * ((head_floats + tile_floats - 1) / tile_floats)),
        tiles((head_floats + tile_floats - 1) / tile_floats) {
    ParallelFor(pool, heads, [&](int64_t h) {
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t start = t * tile_floats;
        bad[h * tiles + t] = AnyNonFinite(x + h * head_floats + start,
                                          std::min(tile_floats, head_floats - start));
      }
    });
  }
  bool operator()(int64_t head, int64_t tile) const { return bad[head * tiles + tile]; }
};

// Copies `count` elements with the non-finite values as 0.
template <typename E>
void CopyFinite(const E* src, int64_t count, E* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = finite_part(src[i]);
}
// Copies n rows of D elements (row stride `stride`) into dst [n, D], non-finite values as 0.
template <typename E>
void CopyRowsFinite(const E* src, int64_t stride, int64_t n, int64_t D, E* dst) {
  for (int64_t r = 0; r < n; ++r) CopyFinite(src + r * stride, D, dst + r * D);
}

// bad[c] = whether key c of n holds a NaN or inf, for float32 value rows of D (the pairs' own
// layout: bf16_dot.h); null when none does.
inline const uint8_t* BadKeys(const float* rows, int64_t D, int64_t n, uint8_t* bad) {
  return BadRowFlags(rows, D, n, D, bad);
}

// Non-finite flags of a tile's operands (the non-finite rule), null where none is bad.
struct Poison {
  const uint8_t* q = nullptr;  // [m] query rows
  const uint8_t* k = nullptr;  // [n] keys (k rows)
  const uint8_t* v = nullptr;  // [n] keys (v rows)
  bool any() const { return q || k || v; }
};

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_NONFINITE_H_
