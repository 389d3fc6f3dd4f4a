// The register-blocked GEMM every product of the kernels runs on: C[M, N] (+)= A[M, K] B[K, N],
// A read one scalar at a time through two strides (so P^T and dS^T need no transposed copy), B
// in panels of rows of SIMD vectors.
#ifndef JAX_FLASH_CPU_GEMM_H_
#define JAX_FLASH_CPU_GEMM_H_

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace flash_cpu {

// The microkernel's register block: MR rows x NV vectors of accumulators.
#if defined(__AVX512F__)
constexpr int MR = 6, NV = 4;  // 24 of 32 registers
#else
// 16 registers and no broadcast operand in an FMA: 6 x 2 holds 12 accumulators, 2 B vectors
// and one broadcast A scalar, 8 loads per 12 FMAs; 3 x 4 would need 17 registers, so that the
// compiler reads B from memory in every FMA (15 loads per 12 FMAs: load-bound, 0.6x the
// speed of 6 x 2 on the 2-core AVX2 host).
constexpr int MR = 6, NV = 2;
#endif

// How a microkernel multiplies an element of A by a vector of B into float32 accumulators:
// float32 elements by a fused multiply-add; other element types (bf16_dot.h: pairs of
// bfloat16) specialise it with their own broadcast, load and dot product.
template <typename E>
struct Dot;
template <>
struct Dot<float> {
  static vf broadcast(float a) { return splat(a); }
  static vf load_b(const float* p) { return load(p); }
  static vf madd(vf a, vf b, vf acc) { return fmadd(a, b, acc); }
};

// C[m, nv*W] (+)= sum_k A[r*ar + k*ak] * B[k*ldb + c], m <= MR rows, nv <= NV vectors.
// A's k stride is a template parameter (1: rows of A, else A^T), so that each instance has one
// loop and keeps its accumulators in registers (with both loops in one function, GCC passed
// them through the stack between the loop versions).
template <typename E, int M, int N, bool UnitK>
void micro_strided(int64_t K, const E* A, int64_t ar, int64_t ak, const E* B, int64_t ldb,
                   float* C, int64_t ldc, bool accumulate) {
  vf acc[M][N];
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) acc[r][c] = accumulate ? load(C + r * ldc + c * W) : splat(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    vf b[N];
    for (int c = 0; c < N; ++c) b[c] = Dot<E>::load_b(B + k * ldb + c * W);
    for (int r = 0; r < M; ++r) {
      vf a = Dot<E>::broadcast(A[r * ar + k * (UnitK ? 1 : ak)]);
      for (int c = 0; c < N; ++c) acc[r][c] = Dot<E>::madd(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) store(C + r * ldc + c * W, acc[r][c]);
}
template <typename E, int M, int N>
void micro(int64_t K, const E* A, int64_t ar, int64_t ak, const E* B, int64_t ldb, float* C,
           int64_t ldc, bool accumulate) {
  if (ak == 1) return micro_strided<E, M, N, true>(K, A, ar, ak, B, ldb, C, ldc, accumulate);
  micro_strided<E, M, N, false>(K, A, ar, ak, B, ldb, C, ldc, accumulate);
}

// micro<rows, nv> for rows <= M and nv <= N known only at run time (the tiles' edges).
template <typename E, int M, int N>
void micro_edge(int rows, int nv, int64_t K, const E* A, int64_t ar, int64_t ak, const E* B,
                int64_t ldb, float* C, int64_t ldc, bool acc) {
  if constexpr (M > 1) {
    if (rows < M) return micro_edge<E, M - 1, N>(rows, nv, K, A, ar, ak, B, ldb, C, ldc, acc);
  }
  if constexpr (N > 1) {
    if (nv < N) return micro_edge<E, M, N - 1>(rows, nv, K, A, ar, ak, B, ldb, C, ldc, acc);
  }
  micro<E, M, N>(K, A, ar, ak, B, ldb, C, ldc, acc);
}

// B operands are read in panels of PW columns: element (k, c) of B is at
// B[(c / PW) * panel + k * ldb + c % PW]. A row-major B is panel = PW; a packed K^T tile is
// ldb = PW, panel = D * PW, so that each microkernel call streams one contiguous block.
constexpr int64_t PW = 64;
static_assert(PW % (NV * W) == 0, "a microkernel call stays inside one panel");

// C[M, N] (+)= A[M, K] B[K, N]; N a multiple of W. A's element (r, k) is A[r*ar + k*ak]. The
// elements are float32, or pairs of bfloat16 along k (bf16_dot.h: K counts pairs).
template <typename E>
void Gemm(int64_t M, int64_t N, int64_t K, const E* A, int64_t ar, int64_t ak, const E* B,
          int64_t ldb, int64_t panel, float* C, int64_t ldc, bool accumulate) {
  for (int64_t c0 = 0; c0 < N; c0 += NV * W) {
    int nv = static_cast<int>(std::min<int64_t>(NV, (N - c0) / W));
    for (int64_t r0 = 0; r0 < M; r0 += MR) {
      const E* a = A + r0 * ar;
      float* c = C + r0 * ldc + c0;
      const E* b = B + (c0 / PW) * panel + c0 % PW;
      micro_edge<E, MR, NV>(static_cast<int>(std::min<int64_t>(MR, M - r0)), nv, K, a, ar, ak, b,
                            ldb, c, ldc, accumulate);
    }
  }
}

// Packs n rows of D elements (row stride D) as K^T panels (see Gemm): dst holds
// round_up(n, PW) / PW panels of [D, PW], columns past n zero; non-finite entries as 0 if
// `finite_only`.
template <typename E>
void PackPanels(const E* src, int64_t n, int64_t D, E* dst, bool finite_only) {
  const int64_t panels = round_up(n, PW) / PW;
  std::fill(dst, dst + panels * D * PW, E{});
  for (int64_t r = 0; r < n; ++r) {
    const E* s = src + r * D;
    E* col = dst + (r / PW) * D * PW + r % PW;
    for (int64_t d = 0; d < D; ++d) col[d * PW] = finite_only ? finite_part(s[d]) : s[d];
  }
}

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_GEMM_H_
