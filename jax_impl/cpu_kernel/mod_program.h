// score_mod and mask_mod in the CPU kernel: row programs that mod_program.py compiles from the
// mods' jaxprs, run here one tile row at a time (the rows of the forward and the backward).
//
// A program is a list of instructions over a register file of float32/int32 lanes: row
// registers hold one tile row (ldt lanes, the keys), uniform registers one SIMD vector whose
// lanes are equal (values that depend on b, h and q only: computed once per row, not per key).
// Each instruction runs over the row's nw lanes (a row destination) or W lanes (a uniform one);
// a uniform operand of a row instruction is read with stride 0. int32 and bool values share the
// float32 storage bit for bit (bool as 0/1). Lanes past the row's n keys hold junk that no
// result reads; indices into mod_aux are clamped, so junk never reads out of bounds.
//
// Diagonal registers hold values that depend on q_idx and kv_idx only through
// d = kv_idx - q_idx (and on b, h, mod_aux): over a tile of rows i0..i0+R-1 and keys
// j0..j0+N-1 they take R+N-1 values, computed once per tile by the tile programs (lane l:
// d = j0 - (i0+R-1) + l, with the tile's uniforms of b and h), and row i reads them from lane
// i0+R-1-i on: the same operations on the same values as per row, R times fewer.
#ifndef JAX_FLASH_CPU_MOD_PROGRAM_H_
#define JAX_FLASH_CPU_MOD_PROGRAM_H_

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "check.h"
#include "simd.h"

namespace flash_cpu {

// The opcodes; mod_program.py reads their values from this enum (its names, in this order).
enum ModOp : int32_t {
  kFAdd, kFSub, kFMul, kFDiv, kFMax, kFMin, kFPow, kFRem, kFAtan2,  // float32 (a, b)
  kFNeg, kFAbs, kFSign, kFFloor, kFCeil, kFRoundEven, kFRoundAway, kFSqrt, kFRsqrt, kFExp,
  kFExp2, kFLog, kFLog1p, kFExpm1, kFTanh, kFLogistic, kFSin, kFCos, kFIsFinite,  // (a)
  kIAdd, kISub, kIMul, kIDiv, kIRem, kIMax, kIMin, kIAnd, kIOr, kIXor, kIShl, kIShrA,
  kIShrL,                                                            // int32 (a, b)
  kINeg, kIAbs, kISign, kINot,                                       // int32 (a)
  kFEq, kFNe, kFLt, kFLe, kFGt, kFGe, kIEq, kINe, kILt, kILe, kIGt, kIGe,  // -> bool
  kF2I,         // float32 -> int32: toward zero, saturating, NaN -> 0 (XLA's rule)
  kI2F,         // int32 -> float32
  kSelect,      // a (bool) ? c : b (lax.select_n(a, b, c))
  kCopy,        // a
  kConst,       // the 32 bits imm0 (a uniform destination)
  kGather,      // mod_aux[imm0 + clamp(a, 0, imm1 - 1)] (32 bits)
  kScatterAdd,  // d_mod_aux[imm0 + clamp(a, 0, imm1 - 1)] += ct * b over the keys where ct != 0
  kModOpCount
};

// One instruction: opcode, destination, three operands (register ids; unused: -1), two
// immediates.
constexpr int kModWidth = 7;

// The header of a call's programs (int32 words before the instructions): the register file,
// then (first instruction, count) of each program and where its results lie.
enum ModHeader : int32_t {
  kRowRegisters, kDiagonalRegisters, kUniformRegisters,
  kScoreStart, kScoreCount, kScoreOut,             // forward: S -> score_mod(S)
  kMaskStart, kMaskCount, kMaskOut,                // mask_mod -> bool
  kGradStart, kGradCount, kGradOut, kGradSlope,    // backward: score_mod(S) and d/dS
  kScatterStart, kScatterCount,                    // backward: the mod_aux cotangents
  kScoreTileStart, kScoreTileCount,                // the tile programs (diagonal registers and
  kMaskTileStart, kMaskTileCount,                  // uniforms of b, h only) of score, mask
  kGradTileStart, kGradTileCount,                  // and grad, run before their rows
  kAuxFloats,                                      // floats of mod_aux (and of its cotangent)
  kModHeaderSize
};
// Registers the kernel fills: rows (the logits S, the key indices, the cotangent of
// score_mod's result), the diagonal d = kv_idx - q_idx and uniforms (b, h, q). Register ids:
// rows from 0, then diagonals, then uniforms.
enum ModInput : int32_t { kRowScore = 0, kRowKey = 1, kRowCotangent = 2, kModInputRows = 3 };
enum ModDiagonalInput : int32_t { kDiagonal = 0, kModInputDiagonals = 1 };
enum ModUniformInput : int32_t { kUniformBatch = 0, kUniformHead = 1, kUniformQuery = 2,
                                 kModInputUniforms = 3 };

inline vi as_int(vf x) { vi i; std::memcpy(&i, &x, sizeof i); return i; }
inline vf as_float(vi i) { vf x; std::memcpy(&x, &i, sizeof x); return x; }
inline vf from_bool(vi mask) { return as_float(mask ? vi{} + 1 : vi{}); }  // lanes -1/0 -> 1/0

template <typename F>
inline vf each_lane(vf x, F f) {
  for (int w = 0; w < W; ++w) x[w] = f(x[w]);
  return x;
}
template <typename F>
inline vf each_lane(vf x, vf y, F f) {
  for (int w = 0; w < W; ++w) x[w] = f(x[w], y[w]);
  return x;
}
inline vi wrap(vu x) { return reinterpret_cast<vi&>(x); }  // int32 arithmetic wraps, as in XLA
inline vu bits_of(vi x) { return reinterpret_cast<vu&>(x); }
inline vf nan_of(vf x, vf y, vf r) {  // XLA's max/min: NaN if either is
  r = x != x ? x : r;
  return y != y ? y : r;
}

// One instruction's operation on one vector of lanes (ints in float storage).
__attribute__((always_inline)) inline vf ModLanes(int32_t op, vf a, vf b, vf c) {
  const vi ia = as_int(a), ib = as_int(b);
  switch (op) {
    case kFAdd: return a + b;
    case kFSub: return a - b;
    case kFMul: return a * b;
    case kFDiv: return a / b;
    case kFMax: return nan_of(a, b, a > b ? a : b);
    case kFMin: return nan_of(a, b, a < b ? a : b);
    case kFPow: return each_lane(a, b, [](float x, float y) { return std::pow(x, y); });
    case kFRem: return each_lane(a, b, [](float x, float y) { return std::fmod(x, y); });
    case kFAtan2: return each_lane(a, b, [](float x, float y) { return std::atan2(x, y); });
    case kFNeg: return -a;
    case kFAbs: return as_float(ia & 0x7fffffff);
    case kFSign: return a > 0.0f ? splat(1.0f) : a < 0.0f ? splat(-1.0f) : a;
    case kFFloor: return each_lane(a, [](float x) { return std::floor(x); });
    case kFCeil: return each_lane(a, [](float x) { return std::ceil(x); });
    case kFRoundEven: return each_lane(a, [](float x) { return std::nearbyint(x); });
    case kFRoundAway: return each_lane(a, [](float x) { return std::round(x); });
    case kFSqrt: return each_lane(a, [](float x) { return std::sqrt(x); });
    case kFRsqrt: return each_lane(a, [](float x) { return 1.0f / std::sqrt(x); });
    case kFExp: return each_lane(a, [](float x) { return std::exp(x); });
    case kFExp2: return each_lane(a, [](float x) { return std::exp2(x); });
    case kFLog: return each_lane(a, [](float x) { return std::log(x); });
    case kFLog1p: return each_lane(a, [](float x) { return std::log1p(x); });
    case kFExpm1: return each_lane(a, [](float x) { return std::expm1(x); });
    case kFTanh: return tanhv(a);
    case kFLogistic: return each_lane(a, [](float x) { return 1.0f / (1.0f + std::exp(-x)); });
    case kFSin: return each_lane(a, [](float x) { return std::sin(x); });
    case kFCos: return each_lane(a, [](float x) { return std::cos(x); });
    case kFIsFinite: return from_bool((ia & 0x7f800000) != 0x7f800000);
    case kIAdd: return as_float(wrap(bits_of(ia) + bits_of(ib)));
    case kISub: return as_float(wrap(bits_of(ia) - bits_of(ib)));
    case kIMul: return as_float(wrap(bits_of(ia) * bits_of(ib)));
    case kIDiv:
    case kIRem: {  // XLA: x / 0 = -1, x % 0 = x, INT_MIN / -1 = INT_MIN, INT_MIN % -1 = 0
      vi out;
      for (int w = 0; w < W; ++w) {
        const int32_t x = ia[w], y = ib[w];
        const bool overflow = x == INT32_MIN && y == -1;
        out[w] = op == kIDiv ? (y == 0 ? -1 : overflow ? INT32_MIN : x / y)
                             : (y == 0 ? x : overflow ? 0 : x % y);
      }
      return as_float(out);
    }
    case kIMax: return as_float(ia > ib ? ia : ib);
    case kIMin: return as_float(ia < ib ? ia : ib);
    case kIAnd: return as_float(ia & ib);
    case kIOr: return as_float(ia | ib);
    case kIXor: return as_float(ia ^ ib);
    case kIShl:
    case kIShrA:
    case kIShrL: {  // XLA: a shift by a count outside [0, 32) gives 0 (arithmetic right: the sign)
      vi out;
      for (int w = 0; w < W; ++w) {
        const int32_t x = ia[w], n = ib[w];
        const bool inside = n >= 0 && n < 32;
        out[w] = op == kIShl ? (inside ? static_cast<int32_t>(static_cast<uint32_t>(x) << n) : 0)
                 : op == kIShrA ? (inside ? x >> n : (x < 0 ? -1 : 0))
                                : (inside ? static_cast<int32_t>(static_cast<uint32_t>(x) >> n) : 0);
      }
      return as_float(out);
    }
    case kINeg: return as_float(wrap(-bits_of(ia)));
    case kIAbs: return as_float(ia < 0 ? wrap(-bits_of(ia)) : ia);
    case kISign: return as_float((ia > 0 ? vi{} + 1 : vi{}) - (ia < 0 ? vi{} + 1 : vi{}));
    case kINot: return as_float(~ia);
    case kFEq: return from_bool(a == b);
    case kFNe: return from_bool(a != b);
    case kFLt: return from_bool(a < b);
    case kFLe: return from_bool(a <= b);
    case kFGt: return from_bool(a > b);
    case kFGe: return from_bool(a >= b);
    case kIEq: return from_bool(ia == ib);
    case kINe: return from_bool(ia != ib);
    case kILt: return from_bool(ia < ib);
    case kILe: return from_bool(ia <= ib);
    case kIGt: return from_bool(ia > ib);
    case kIGe: return from_bool(ia >= ib);
    case kF2I: {
      vi out;
      for (int w = 0; w < W; ++w) {
        const float x = a[w];
        out[w] = x != x ? 0 : x >= 2147483648.0f ? INT32_MAX : x <= -2147483648.0f ? INT32_MIN
                                                                                   : static_cast<int32_t>(x);
      }
      return as_float(out);
    }
    case kI2F: return __builtin_convertvector(ia, vf);
    case kSelect: return as_int(a) != 0 ? c : b;
    case kCopy: return a;
    default: return a;  // kConst, kGather and kScatterAdd do not come here
  }
}

// out[l] = op(a[l * sa], b[l * sb], c[l * sc]) for lanes l < `lanes` (a multiple of W), one
// loop per opcode (its switch folded away).
template <int32_t Op>
void ModLoop(float* out, const float* a, int64_t sa, const float* b, int64_t sb, const float* c,
             int64_t sc, int64_t lanes) {
  for (int64_t l = 0; l < lanes; l += W)
    store(out + l, ModLanes(Op, load(a + l * sa), load(b + l * sb), load(c + l * sc)));
}
using ModLoopFn = void (*)(float*, const float*, int64_t, const float*, int64_t, const float*,
                           int64_t, int64_t);
template <int32_t... Ops>
constexpr std::array<ModLoopFn, sizeof...(Ops)> ModLoops(std::integer_sequence<int32_t, Ops...>) {
  return {&ModLoop<Ops>...};
}
inline constexpr std::array<ModLoopFn, kModOpCount> kModLoops =
    ModLoops(std::make_integer_sequence<int32_t, kModOpCount>{});

// A call's programs (the header and instructions, int32) and its mod_aux (float32 words: ints
// and bools as their 32 bits), with one thread's register file.
struct ModProgram {
  const int32_t* words = nullptr;  // null: the call has no mods
  const float* aux = nullptr;

  explicit operator bool() const { return words != nullptr; }
  int32_t operator[](ModHeader field) const { return words[field]; }
  // Whether the call has a score_mod (not the identity), a mask_mod: instructions in either part.
  bool score() const { return words && words[kScoreCount] + words[kScoreTileCount] > 0; }
  bool mask() const { return words && words[kMaskCount] + words[kMaskTileCount] > 0; }
  bool scatter() const { return words && words[kScatterCount] > 0; }
  int64_t aux_floats() const { return words ? words[kAuxFloats] : 0; }
};

struct ModRegisters {
  std::vector<float> file;
  int64_t ldt = 0, rows = 0, diagonals = 0, diagonal_ldt = 0;
  // The tile the diagonal registers hold: its last row, its rows, their lanes; and the lane
  // the current row reads them from (0 in the tile programs).
  int64_t tile_last = 0, tile_rows = 0, diagonal_lanes = 0, offset = 0;

  // Registers for rows of row_width lanes, tiles of up to max_rows rows.
  void Resize(const ModProgram& p, int64_t row_width, int64_t max_rows) {
    ldt = row_width;
    rows = p[kRowRegisters];
    diagonals = p[kDiagonalRegisters];
    diagonal_ldt = round_up(max_rows - 1 + row_width, W);
    file.resize(rows * ldt + diagonals * diagonal_ldt + int64_t{p[kUniformRegisters]} * W);
  }
  bool is_row(int32_t id) const { return id < rows; }
  bool is_diagonal(int32_t id) const { return id >= rows && id < rows + diagonals; }
  bool varies(int32_t id) const { return id < rows + diagonals; }  // one value per key
  float* at(int32_t id) {
    return file.data() + (is_row(id) ? id * ldt
                          : is_diagonal(id) ? rows * ldt + (id - rows) * diagonal_ldt
                                            : rows * ldt + diagonals * diagonal_ldt +
                                                  (id - rows - diagonals) * W);
  }
  // Register id's lanes as the current row reads them (a diagonal one from the row's offset).
  const float* lanes(int32_t id) { return at(id) + (is_diagonal(id) ? offset : 0); }
  void SetUniform(int32_t input, int32_t value) {
    const vi v = vi{} + value;
    store(at(static_cast<int32_t>(rows + diagonals) + input), as_float(v));
  }
  // The diagonal input for the tile of rows [i0, i0 + tile) and keys [j0, j0 + nw).
  void SetTile(int64_t i0, int64_t tile, int64_t j0, int64_t nw) {
    FLASH_CPU_CHECK(tile >= 1 && round_up(tile - 1 + nw, W) <= diagonal_ldt);
    tile_last = i0 + tile - 1;
    tile_rows = tile;
    diagonal_lanes = round_up(tile - 1 + nw, W);
    float* d = at(static_cast<int32_t>(rows) + kDiagonal);
    for (int64_t l = 0; l < diagonal_lanes; ++l) {
      const int32_t x = static_cast<int32_t>(j0 - tile_last + l);
      std::memcpy(d + l, &x, sizeof x);
    }
  }
  // Row i of the tile: where it reads the diagonal registers.
  void SetRow(int64_t i, int64_t nw) {
    offset = tile_last - i;
    FLASH_CPU_CHECK(offset >= 0 && offset < tile_rows && offset + nw <= diagonal_lanes);
  }
  // The key indices j0 + c of a tile's row (the same for every row of the tile).
  void SetKeys(int64_t j0, int64_t nw) {
    float* kv = at(kRowKey);
    for (int64_t c = 0; c < nw; ++c) {
      const int32_t j = static_cast<int32_t>(j0 + c);
      std::memcpy(kv + c, &j, sizeof j);
    }
  }
};

// Runs `count` instructions from `first` over a row of n keys (nw lanes); ct is the cotangent
// row (kScatterAdd), d_aux the item's mod_aux cotangent.
inline void RunModProgram(const ModProgram& p, int32_t first, int32_t count, ModRegisters& r,
                          int64_t n, int64_t nw, float* d_aux) {
  const int32_t* code = p.words + kModHeaderSize + int64_t{first} * kModWidth;
  for (int32_t k = 0; k < count; ++k, code += kModWidth) {
    const int32_t op = code[0], dst = code[1];
    float* out = r.at(dst);
    const int64_t lanes = r.is_row(dst) ? nw : r.is_diagonal(dst) ? r.diagonal_lanes : W;
    const int32_t imm0 = code[5], imm1 = code[6];
    auto operand = [&](int32_t id, int64_t* stride) -> const float* {
      if (id < 0) { *stride = 0; return out; }  // unused: any readable lanes
      *stride = r.varies(id) ? 1 : 0;
      return r.lanes(id);
    };
    int64_t sa, sb, sc;
    const float* a = operand(code[2], &sa);
    const float* b = operand(code[3], &sb);
    const float* c = operand(code[4], &sc);
    if (op == kConst) {
      int32_t bits = imm0;
      float x;
      std::memcpy(&x, &bits, sizeof x);
      store(out, splat(x));
    } else if (op == kGather) {
      for (int64_t l = 0; l < lanes; ++l) {
        int32_t index;
        std::memcpy(&index, a + l * sa, sizeof index);
        out[l] = p.aux[imm0 + std::clamp<int32_t>(index, 0, imm1 - 1)];
      }
    } else if (op == kScatterAdd) {  // b: the partial derivative; ct: the row's cotangent
      const float* ct = r.at(kRowCotangent);
      float uniform_sum = 0.0f;
      for (int64_t l = 0; l < n; ++l) {
        if (ct[l] == 0.0f) continue;  // excluded pairs add nothing (their partials may be NaN)
        const float x = ct[l] * b[l * sb];
        if (sa == 0) {
          uniform_sum += x;
        } else {
          int32_t index;
          std::memcpy(&index, a + l, sizeof index);
          d_aux[imm0 + std::clamp<int32_t>(index, 0, imm1 - 1)] += x;
        }
      }
      if (sa == 0) {
        int32_t index;
        std::memcpy(&index, a, sizeof index);
        d_aux[imm0 + std::clamp<int32_t>(index, 0, imm1 - 1)] += uniform_sum;
      }
    } else {
      kModLoops[op](out, a, sa, b, sb, c, sc, lanes);
    }
  }
}

// The tile programs (the mask's, then the forward's score or the backward's grad) for the tile
// whose diagonal input SetTile set.
inline void RunModTile(const ModProgram& p, ModRegisters& r, bool backward) {
  r.offset = 0;
  const int64_t lanes = r.diagonal_lanes;
  if (p.mask()) RunModProgram(p, p[kMaskTileStart], p[kMaskTileCount], r, lanes, lanes, nullptr);
  if (p.score()) {
    const ModHeader start = backward ? kGradTileStart : kScoreTileStart;
    const ModHeader count = backward ? kGradTileCount : kScoreTileCount;
    RunModProgram(p, p[start], p[count], r, lanes, lanes, nullptr);
  }
}
// SetTile, then the tile programs: rows [i0, i0 + tile), keys [j0, j0 + nw).
inline void ModTile(const ModProgram& p, ModRegisters& r, bool backward, int64_t i0, int64_t tile,
                    int64_t j0, int64_t nw) {
  r.SetTile(i0, tile, j0, nw);
  RunModTile(p, r, backward);
}

}  // namespace flash_cpu

#endif  // JAX_FLASH_CPU_MOD_PROGRAM_H_
