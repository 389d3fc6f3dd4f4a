// The CPU kernel (flash_cpu.h) as XLA FFI custom calls (forward, backward, decode):
// jax_impl/cpu_kernel/__init__.py lays out the operands and build.py compiles this file on
// first use.
#include "flash_cpu.h"

#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;
using S8 = ffi::Buffer<ffi::S8>;
using U32 = ffi::Buffer<ffi::U32>;

// The mask and feature operands both calls take after q, k, v. An absent feature is a dummy
// buffer with its flag off.
struct Features {
  S32 q_len, kv_len, d_lo, d_hi, q_seg, kv_seg;
  ffi::Buffer<ffi::PRED> mask;
  F32 bias, sinks;
  ffi::Buffer<ffi::U32> seeds;
  S8 tiles;
  S32 mod_words;  // the mods' row programs (mod_program.h), when flags & 64
  F32 mod_aux;    // their arrays, 32 bits each
};

template <typename T, ffi::DataType dtype>
flash_cpu::PerHead<T> PerHeadOf(ffi::Buffer<dtype>& x, bool present, int64_t inner) {
  if (!present) return {};
  auto d = x.dimensions();
  return {reinterpret_cast<const T*>(x.untyped_data()), d[0], d[1], inner};
}

// q, k, v shapes as (B, Lq, Lk, Hq, Hkv, D) plus the features and attributes.
flash_cpu::Problem MakeProblem(int64_t B, int64_t Lq, int64_t Lk, int64_t Hq, int64_t Hkv,
                               int64_t D, Features& f, float scale, float soft_cap,
                               float dropout_rate, int64_t flags) {
  flash_cpu::Problem P{B, Lq, Lk, Hq, Hkv, D, f.q_len.typed_data(), f.kv_len.typed_data(),
                       f.d_lo.typed_data(), f.d_hi.typed_data()};
  if (flags & 1) {
    P.q_seg = f.q_seg.typed_data();
    P.kv_seg = f.kv_seg.typed_data();
  }
  P.mask = PerHeadOf<bool>(f.mask, flags & 2, Lq * Lk);
  P.bias = PerHeadOf<float>(f.bias, flags & 4, Lq * Lk);
  P.sinks = PerHeadOf<float>(f.sinks, flags & 8, 1);
  P.seeds = PerHeadOf<uint32_t>(f.seeds, dropout_rate > 0.0f, 1);
  if (flags & 64) P.mods = {f.mod_words.typed_data(), f.mod_aux.typed_data()};
  P.scale = scale;
  P.soft_cap = soft_cap;
  P.dropout_rate = dropout_rate;
  return P;
}

// Whether the mods' programs fit their operands: the header, instructions of kModWidth words
// inside the buffer, opcodes and registers in range, mod_aux as long as the header says.
bool ModsFit(const flash_cpu::ModProgram& m, int64_t words, int64_t aux_floats) {
  using namespace flash_cpu;
  if (words < kModHeaderSize || m[kRowRegisters] < kModInputRows ||
      m[kDiagonalRegisters] < kModInputDiagonals || m[kUniformRegisters] < kModInputUniforms ||
      m[kAuxFloats] > aux_floats)
    return false;
  const int64_t registers = int64_t{m[kRowRegisters]} + m[kDiagonalRegisters] + m[kUniformRegisters];
  const int64_t count = (words - kModHeaderSize) / kModWidth;
  for (auto [start, length] : {std::pair{kScoreStart, kScoreCount}, {kMaskStart, kMaskCount},
                               {kGradStart, kGradCount}, {kScatterStart, kScatterCount},
                               {kScoreTileStart, kScoreTileCount}, {kMaskTileStart, kMaskTileCount},
                               {kGradTileStart, kGradTileCount}})
    if (m[start] < 0 || m[length] < 0 || m[start] + int64_t{m[length]} > count) return false;
  for (auto out : {kScoreOut, kMaskOut, kGradOut, kGradSlope})
    if (m[out] < 0 || m[out] >= registers) return false;
  for (int64_t k = 0; k < count; ++k) {
    const int32_t* x = m.words + kModHeaderSize + k * kModWidth;
    if (x[0] < 0 || x[0] >= kModOpCount || x[1] < 0 || x[1] >= registers) return false;
    for (int o = 2; o < 5; ++o)
      if (x[o] < -1 || x[o] >= registers) return false;
    if ((x[0] == kGather || x[0] == kScatterAdd) &&
        (x[6] < 1 || x[5] < 0 || x[5] + int64_t{x[6]} > aux_floats))
      return false;
  }
  // The tile programs run over a tile's diagonal lanes, more than a row register has: they
  // touch diagonal and uniform registers only.
  for (auto [start, length] : {std::pair{kScoreTileStart, kScoreTileCount},
                               {kMaskTileStart, kMaskTileCount}, {kGradTileStart, kGradTileCount}})
    for (int64_t k = m[start]; k < m[start] + int64_t{m[length]}; ++k) {
      const int32_t* x = m.words + kModHeaderSize + k * kModWidth;
      for (int o = 1; o < 5; ++o)
        if (x[o] >= 0 && x[o] < m[kRowRegisters]) return false;
    }
  return true;
}

// Checks the tiles and, when flags & 32, takes the tile classes [Bc, Hc, nq, nk] of the grid
// (block_q, block_k), Bc in {1, B}, Hc in {1, Hq}.
ffi::Error Check(flash_cpu::Problem& P, int64_t bq, int64_t bk, Features& f, int64_t flags) {
  S8& tiles = f.tiles;
  S32& mod_words = f.mod_words;
  F32& mod_aux = f.mod_aux;
  if (P.D % flash_cpu::W != 0)
    return ffi::Error::InvalidArgument("head_dim must be a multiple of the SIMD width");
  if (bq < 1 || bk < flash_cpu::PW || bk % flash_cpu::PW != 0)
    return ffi::Error::InvalidArgument("block_q must be >= 1 and block_k a multiple of 64");
  if ((flags & 64) && !ModsFit(P.mods, mod_words.element_count(), mod_aux.element_count()))
    return ffi::Error::InvalidArgument("the mods' programs do not fit their operands");
  if (!(flags & 32)) return ffi::Error::Success();
  auto d = tiles.dimensions();
  const int64_t nq = (P.Lq + bq - 1) / bq, nk = (P.Lk + bk - 1) / bk;
  if (d.size() != 4 || (d[0] != 1 && d[0] != P.B) || (d[1] != 1 && d[1] != P.Hq) || d[2] != nq ||
      d[3] != nk)
    return ffi::Error::InvalidArgument(
        "tile classes must be int8 [1 or B, 1 or Hq, ceil(Lq / block_q), ceil(Lk / block_k)]");
  P.tiles = flash_cpu::PerHead<int8_t>(tiles.typed_data(), d[0], d[1], nq * nk);
  P.tile_cols = nk;
  return ffi::Error::Success();
}

// The operand element of a buffer type: float32, or two bfloat16 in a uint32 (bf16_dot.h).
template <ffi::DataType T>
using Element = std::conditional_t<T == ffi::DataType::F32, float, flash_cpu::Bf16Pair>;
template <ffi::DataType T>
const Element<T>* Elements(ffi::Buffer<T>& x) {
  return reinterpret_cast<const Element<T>*>(x.untyped_data());
}

// q [B, Lq, Hq, D], kt [B, Hkv, Lk_pad / 64, D, 64], v [B, Hkv, Lk, D] float32; or with
// bfloat16 pairs (U32) q and kt hold D / 2 pairs and v is in pairs of keys
// [B, Hkv, Lk_pad / 2, D]. Tile classes of the forward's grid.
template <ffi::DataType T>
ffi::Error RunForward(ffi::ThreadPool pool, ffi::Buffer<T> q, ffi::Buffer<T> kt, ffi::Buffer<T> v,
                      int64_t Lk, Features& f, float scale, float soft_cap, float dropout_rate,
                      int64_t block_q, int64_t block_k, int64_t flags, F32* out, F32* row_max,
                      F32* log_sum) {
  auto qd = q.dimensions(), vd = v.dimensions(), ktd = kt.dimensions();
  constexpr int64_t per = flash_cpu::kValuesPer<Element<T>>;
  const int64_t lk_pad = ktd[2] * flash_cpu::PW, D = qd[3] * per;
  if (ktd[3] != qd[3] || vd[3] != D || Lk > lk_pad || vd[2] != (per == 1 ? Lk : lk_pad / 2))
    return ffi::Error::InvalidArgument("q, K^T panels and v disagree on head_dim or keys");
  auto P = MakeProblem(qd[0], qd[1], Lk, qd[2], vd[1], D, f, scale, soft_cap, dropout_rate, flags);
  if (ffi::Error e = Check(P, block_q, block_k, f, flags); e.failure()) return e;
  flash_cpu::Forward(P, Elements(q), Elements(kt), Elements(v), lk_pad, out->typed_data(),
                     row_max->typed_data(), log_sum->typed_data(), block_q, block_k, pool);
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, F32 q, F32 kt, F32 v, S32 q_len, S32 kv_len,
                       S32 d_lo, S32 d_hi, S32 q_seg, S32 kv_seg, ffi::Buffer<ffi::PRED> mask,
                       F32 bias, F32 sinks, ffi::Buffer<ffi::U32> seeds, S8 tiles, S32 mod_words,
                       F32 mod_aux, float scale, float soft_cap, float dropout_rate,
                       int64_t block_q, int64_t block_k, int64_t flags,
                       ffi::ResultBuffer<ffi::F32> out,
                       ffi::ResultBuffer<ffi::F32> row_max, ffi::ResultBuffer<ffi::F32> log_sum) {
  Features f{q_len, kv_len, d_lo, d_hi, q_seg, kv_seg, mask, bias, sinks, seeds, tiles, mod_words,
             mod_aux};
  return RunForward(pool, q, kt, v, v.dimensions()[2], f, scale, soft_cap, dropout_rate, block_q,
                    block_k, flags, &*out, &*row_max, &*log_sum);
}

#if defined(__AVX512BF16__)
// The same on bfloat16 pairs; `keys` is Lk (v's pairs of keys leave it open by one).
ffi::Error ForwardBf16Impl(ffi::ThreadPool pool, U32 q, U32 kt, U32 v, S32 q_len, S32 kv_len,
                           S32 d_lo, S32 d_hi, S32 q_seg, S32 kv_seg,
                           ffi::Buffer<ffi::PRED> mask, F32 bias, F32 sinks,
                           ffi::Buffer<ffi::U32> seeds, S8 tiles, S32 mod_words, F32 mod_aux,
                           float scale, float soft_cap, float dropout_rate, int64_t block_q,
                           int64_t block_k, int64_t flags, int64_t keys,
                           ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> row_max,
                           ffi::ResultBuffer<ffi::F32> log_sum) {
  Features f{q_len, kv_len, d_lo, d_hi, q_seg, kv_seg, mask, bias, sinks, seeds, tiles, mod_words,
             mod_aux};
  return RunForward(pool, q, kt, v, keys, f, scale, soft_cap, dropout_rate, block_q, block_k,
                    flags, &*out, &*row_max, &*log_sum);
}
#endif

// Every array head-major: q, d_out [B, Hq, Lq, D], k, v [B, Hkv, Lk, D]; stats [B, Hq, Lq];
// dbias [B, Hq, Lq, Lk] when flags & 16 (else a dummy); tile classes of the backward's grid.
// With bfloat16 pairs (U32) q, k, v and d_out hold D / 2 pairs per row.
template <ffi::DataType T>
ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
                        S32 q_len, S32 kv_len,
                        S32 d_lo, S32 d_hi, S32 q_seg, S32 kv_seg, ffi::Buffer<ffi::PRED> mask,
                        F32 bias, F32 sinks, ffi::Buffer<ffi::U32> seeds, S8 tiles,
                        S32 mod_words, F32 mod_aux, ffi::Buffer<T> d_out, F32 row_max, F32 log_sum,
                        F32 delta, float scale, float soft_cap, float dropout_rate,
                        int64_t block_q, int64_t block_k, int64_t flags, int64_t chunks,
                        ffi::ResultBuffer<ffi::F32> dq_parts, ffi::ResultBuffer<ffi::F32> dk,
                        ffi::ResultBuffer<ffi::F32> dv, ffi::ResultBuffer<ffi::F32> dbias,
                        ffi::ResultBuffer<ffi::F32> d_mod_aux) {
  auto qd = q.dimensions(), vd = v.dimensions();
  Features f{q_len, kv_len, d_lo, d_hi, q_seg, kv_seg, mask, bias, sinks, seeds, tiles, mod_words,
             mod_aux};
  const int64_t D = qd[3] * flash_cpu::kValuesPer<Element<T>>;
  auto P = MakeProblem(qd[0], qd[2], vd[2], qd[1], vd[1], D, f, scale, soft_cap, dropout_rate,
                       flags);
  if (ffi::Error e = Check(P, block_q, block_k, f, flags); e.failure()) return e;
  const bool with_dbias = flags & 16;
  // d_mod_aux [B * Hkv * chunks, aux floats]: an item's cotangent of mod_aux, when it has one
  const bool with_d_aux = P.mods.scatter();
  if (with_d_aux && d_mod_aux->element_count() != P.B * P.Hkv * chunks * P.mods.aux_floats())
    return ffi::Error::InvalidArgument("d_mod_aux must hold B * Hkv * chunks * mod_aux floats");
  for (auto* x : {&dq_parts, &dk, &dv, &dbias, &d_mod_aux})  // keys no query sees; pairs never visited
    if ((x != &dbias || with_dbias) && (x != &d_mod_aux || with_d_aux))
      std::fill((*x)->typed_data(), (*x)->typed_data() + (*x)->element_count(), 0.0f);
  flash_cpu::Backward(P, Elements(q), Elements(k), Elements(v), Elements(d_out),
                      row_max.typed_data(), log_sum.typed_data(), delta.typed_data(),
                      dq_parts->typed_data(), dk->typed_data(), dv->typed_data(),
                      with_dbias ? dbias->typed_data() : nullptr, block_q, block_k, chunks, pool,
                      with_d_aux ? d_mod_aux->typed_data() : nullptr);
  return ffi::Error::Success();
}

// Decode: q [B, Lq, Hq, Dp] float32 (Dp = head_dim padded to the SIMD width); k, v the cache
// as it lies, float32, bfloat16 or float16: dense [B, Lk, Hkv, Dk], or (flags & 1) pages
// [num_pages, page_size, Hkv, Dk] with page_table [B, pages_per_sequence] int32 (else a dummy);
// sinks [Bs, Hs] when flags & 8; the mods' programs and mod_aux when flags & 64.
ffi::Error DecodeImpl(ffi::ThreadPool pool, F32 q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      S32 page_table, S32 q_len, S32 kv_len, S32 d_lo, S32 d_hi, F32 sinks,
                      S32 mod_words, F32 mod_aux, float scale, float soft_cap, int64_t flags,
                      int64_t splits,
                      ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> row_max,
                      ffi::ResultBuffer<ffi::F32> log_sum) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), pd = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("decode: q, k, v must have rank 4, page_table rank 2");
  for (int a = 0; a < 4; ++a)
    if (kd[a] != vd[a]) return ffi::Error::InvalidArgument("decode: k and v shapes differ");
  if (k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("decode: k and v dtypes differ");
  flash_cpu::KvCache cache;
  switch (k.element_type()) {
    case ffi::DataType::F32: cache.type = flash_cpu::CacheType::kF32; break;
    case ffi::DataType::BF16: cache.type = flash_cpu::CacheType::kBF16; break;
    case ffi::DataType::F16: cache.type = flash_cpu::CacheType::kF16; break;
    default: return ffi::Error::InvalidArgument("decode: the cache must be float32, bfloat16 or float16");
  }
  const bool paged = flags & 1;
  const int64_t B = qd[0], Lq = qd[1], Hq = qd[2], Dp = qd[3], Hkv = kd[2], Dk = kd[3];
  cache.k = k.untyped_data();
  cache.v = v.untyped_data();
  cache.Dk = Dk;
  int64_t Lk;
  if (paged) {
    cache.page_table = page_table.typed_data();
    cache.pages_per_sequence = pd[1];
    cache.page_size = kd[1];
    cache.num_pages = kd[0];
    Lk = pd[1] * kd[1];
    if (pd[0] != B || kd[0] < 1)
      return ffi::Error::InvalidArgument("decode: page_table must be [B, pages] and pages >= 1");
  } else {
    cache.Lk_dense = Lk = kd[1];
    if (kd[0] != B) return ffi::Error::InvalidArgument("decode: k's batch differs from q's");
  }
  if (Dp % flash_cpu::W != 0 || Dk > Dp || Hkv < 1 || Hq % Hkv != 0 || splits < 1)
    return ffi::Error::InvalidArgument(
        "decode: q's head_dim must be the cache's padded to the SIMD width, Hq a multiple of "
        "Hkv, splits >= 1");
  cache.bf16_products = flags & 128;
  if (cache.bf16_products && (!flash_cpu::kHasBf16Dot || cache.type != flash_cpu::CacheType::kBF16))
    return ffi::Error::InvalidArgument(
        "decode: bfloat16 products need a bfloat16 cache and a build with AVX512-BF16");
  flash_cpu::Problem P{B, Lq, Lk, Hq, Hkv, Dp, q_len.typed_data(), kv_len.typed_data(),
                       d_lo.typed_data(), d_hi.typed_data()};
  P.sinks = PerHeadOf<float>(sinks, flags & 8, 1);
  P.scale = scale;
  P.soft_cap = soft_cap;
  if (flags & 64) {
    P.mods = {mod_words.typed_data(), mod_aux.typed_data()};
    if (!ModsFit(P.mods, mod_words.element_count(), mod_aux.element_count()))
      return ffi::Error::InvalidArgument("decode: the mods' programs do not fit their operands");
  }
  flash_cpu::Decode(P, cache, q.typed_data(), out->typed_data(), row_max->typed_data(),
                    log_sum->typed_data(), splits, pool);
  return ffi::Error::Success();
}

// What the attention handlers take first: XLA's thread pool, q, k (the forward's K^T panels), v
// (float32, or bfloat16 pairs as U32), the mask operands q_len, kv_len, d_lo, d_hi, q_seg,
// kv_seg, mask, and bias, sinks, seeds, and the tile classes of the call's grid, the mods'
// programs and their mod_aux.
// (A macro, as the binding's type is spelled through the chain.)
#define FLASH_CPU_BIND_ATTENTION(Operand)                                                        \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<Operand>().Arg<Operand>().Arg<Operand>()          \
      .Arg<S32>().Arg<S32>().Arg<S32>().Arg<S32>().Arg<S32>().Arg<S32>()                        \
      .Arg<ffi::Buffer<ffi::PRED>>().Arg<F32>().Arg<F32>().Arg<ffi::Buffer<ffi::U32>>().Arg<S8>() \
      .Arg<S32>().Arg<F32>()
#define FLASH_CPU_BIND_FORWARD(Operand)                                                          \
  FLASH_CPU_BIND_ATTENTION(Operand).Attr<float>("scale").Attr<float>("soft_cap")                \
      .Attr<float>("dropout_rate").Attr<int64_t>("block_q").Attr<int64_t>("block_k")            \
      .Attr<int64_t>("flags")
// After the common operands: d_out, row_max, log_sum, delta; results dq_parts, dk, dv, dbias,
// d_mod_aux.
#define FLASH_CPU_BIND_BACKWARD(Operand)                                                         \
  FLASH_CPU_BIND_ATTENTION(Operand).Arg<Operand>().Arg<F32>().Arg<F32>().Arg<F32>()             \
      .Attr<float>("scale").Attr<float>("soft_cap").Attr<float>("dropout_rate")                 \
      .Attr<int64_t>("block_q").Attr<int64_t>("block_k").Attr<int64_t>("flags")                 \
      .Attr<int64_t>("chunks").Ret<F32>().Ret<F32>().Ret<F32>().Ret<F32>().Ret<F32>()

}  // namespace

// What this build's kernels can do, as bits: 1 bfloat16 products (AVX512-BF16: the
// FlashForwardBf16Cpu and FlashBackwardBf16Cpu handlers exist; decode takes flags & 128).
extern "C" int64_t FlashCpuFeatures() { return flash_cpu::kHasBf16Dot ? 1 : 0; }

// flags: 1 segment ids, 2 mask, 4 bias, 8 sinks, 32 tile classes, 64 mods (16: dbias wanted,
// backward only).
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashForwardCpu, ForwardImpl,
                              FLASH_CPU_BIND_FORWARD(F32).Ret<F32>().Ret<F32>().Ret<F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashBackwardCpu, BackwardImpl<ffi::DataType::F32>,
                              FLASH_CPU_BIND_BACKWARD(F32));
#if defined(__AVX512BF16__)
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashForwardBf16Cpu, ForwardBf16Impl,
                              FLASH_CPU_BIND_FORWARD(U32).Attr<int64_t>("keys").Ret<F32>().Ret<F32>().Ret<F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashBackwardBf16Cpu, BackwardImpl<ffi::DataType::U32>,
                              FLASH_CPU_BIND_BACKWARD(U32));
#endif

// flags: 1 paged cache, 8 sinks, 64 mods, 128 bfloat16 products (KvCache::bf16_products).
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashDecodeCpu, DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<S32>()
                                  .Arg<S32>()
                                  .Arg<S32>()
                                  .Arg<S32>()
                                  .Arg<S32>()
                                  .Arg<F32>()
                                  .Arg<S32>()
                                  .Arg<F32>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("flags")
                                  .Attr<int64_t>("splits")
                                  .Ret<F32>()
                                  .Ret<F32>()
                                  .Ret<F32>());
