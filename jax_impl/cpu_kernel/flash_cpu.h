// FlashAttention forward and backward for the CPU: the algorithm, free of XLA (flash_cpu.cc
// binds it as XLA FFI custom calls; the tests' harness calls it on exact-size buffers).
//
// The same algorithm as the Pallas kernels and the xla path (FlashAttention-2, the online
// softmax in base 2: online_softmax.Base2Softmax), fused so that a tile never leaves the caches
// between its products: the forward works one (batch row, head, query tile) at a time, the
// backward one (batch row, kv head, chunk of key tiles). Every product is one register-blocked
// microkernel (`Gemm`, gemm.h): C[M, N] (+)= A[M, K] B[K, N], A read one scalar at a time through two
// strides (so P^T and dS^T need no transposed copy), B in rows of SIMD vectors.
//
// Layouts (float32, head_dim D a multiple of the SIMD width: the caller pads it with zeros):
// the forward takes q [B, Lq, Hq, D] as the library holds it, K^T in panels of 64 keys and v
// head-major; the backward takes every array head-major [B, H, L, D]. Row statistics and delta
// are [B, Hq, Lq]. A bias [Bb, Hb, Lq, Lk], a mask [Bm, Hm, Lq, Lk], sinks and dropout seeds
// [Bs, Hs] may be broadcast over batch and heads (size 1 there).
//
// The mask (masking.py's rules 1-5): the band d_lo[b] <= j - i <= d_hi[b] inside i < q_len[b],
// j < kv_len[b], segment ids, the dense mask; and an additive -inf bias excludes a pair as the
// rules do. The non-finite rule (online_softmax.py): a pair whose query row or key row (k or v)
// holds a NaN or inf gets a NaN logit, computed with those entries as 0, so it reaches only the
// rows that may attend it; excluded pairs contribute exactly 0 to every gradient. Tile classes
// (Problem::tiles, when given) skip the tiles with no allowed pair and the per-pair mask on
// those whose pairs rules 1-4 all allow.
//
// The parts, one header each (each includes what it uses): check.h (invariant checks),
// simd.h (vectors and their math), mod_program.h (the mods' row programs), gemm.h, parallel.h
// (the thread pool's use), problem.h (a call), dropout.h, nonfinite.h, tile_rows.h (the row
// steps the kernels share), forward.h, backward.h, half.h (16-bit reads), bf16_dot.h (bfloat16
// products on AVX512-BF16), kv_cache.h, decode.h.
#ifndef JAX_FLASH_CPU_FLASH_CPU_H_
#define JAX_FLASH_CPU_FLASH_CPU_H_

#include "backward.h"
#include "decode.h"
#include "forward.h"

#endif  // JAX_FLASH_CPU_FLASH_CPU_H_
