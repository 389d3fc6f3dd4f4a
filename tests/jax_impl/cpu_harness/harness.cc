// A standalone driver of the CPU kernel (jax_impl/cpu_kernel/flash_cpu.h) on exact-size heap
// buffers, for AddressSanitizer: XLA's buffers may have slack that hides an overrun, these
// have none. Built and run by test_cpu_kernel_harness.py.
//
//   harness spans      exhaustive check of Problem::KeySpan / QuerySpan against the rules
//   harness run DIR    DIR/params.txt ("name value" lines) and DIR/<array>.bin (raw, in the
//                      kernel's layouts; with "bf16 1" q, k, v and d_out as bfloat16 pairs,
//                      bf16_dot.h); writes DIR/out.bin, row_max.bin, log_sum.bin, then
//                      reads DIR/delta.bin if present and writes dq_parts.bin, dk.bin, dv.bin
//                      (and dbias.bin); with flags & 32 it reads DIR/tiles.bin, the tile
//                      classes of the grid (block_q, block_k) both passes run on
//   harness decode DIR   the decode kernel: DIR/params.txt, q.bin [B, Lq, Hq, Dp] float32,
//                      k.bin and v.bin the cache exactly (float32 or bfloat16 bits: cache_type
//                      0 or 1; dense [B, Lk, Hkv, Dk] or pages [num_pages, page_size, Hkv, Dk]
//                      with table.bin [B, pages]), lengths and band; writes out.bin,
//                      row_max.bin, log_sum.bin
//   harness exp2 DIR N the kernels' 2^x (flash_cpu::exp2v) of the N float32 values in
//                      DIR/x.bin, written to DIR/exp2.bin
//   harness mods DIR   the mods' row programs (mod_program.h) on one row of n keys: params
//                      (n, b, h, q, words, aux), words.bin, aux.bin, s.bin, kv.bin, ct.bin;
//                      writes score.bin, mask.bin (int32), value.bin, slope.bin, d_aux.bin
//   harness mods_tile DIR   the same on a tile of rows: ModTile, then each row (ModsTile)
#include "flash_cpu.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

// The pool ParallelFor needs: each task a thread of its own, joined when the pool goes.
struct ThreadPool {
  int64_t threads;
  std::vector<std::thread> running;
  int64_t num_threads() const { return threads; }
  template <typename F>
  void Schedule(F&& f) { running.emplace_back(std::forward<F>(f)); }
  ~ThreadPool() {
    for (auto& t : running) t.join();
  }
};

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "harness: %s\n", message.c_str());
  std::exit(2);
}

// An array of exactly `count` elements on the heap (no slack), read from DIR/name.bin, whose
// size must match exactly.
template <typename T>
std::unique_ptr<T[]> Read(const std::string& dir, const std::string& name, int64_t count) {
  std::ifstream in(dir + "/" + name + ".bin", std::ios::binary | std::ios::ate);
  if (!in) Fail("cannot open " + name + ".bin");
  if (static_cast<int64_t>(in.tellg()) != count * static_cast<int64_t>(sizeof(T)))
    Fail(name + ".bin holds " + std::to_string(in.tellg()) + " bytes, expected " +
         std::to_string(count * sizeof(T)));
  in.seekg(0);
  std::unique_ptr<T[]> data(new T[count]);
  in.read(reinterpret_cast<char*>(data.get()), count * sizeof(T));
  return data;
}

template <typename T>
void Write(const std::string& dir, const std::string& name, const T* data, int64_t count) {
  std::ofstream out(dir + "/" + name + ".bin", std::ios::binary);
  out.write(reinterpret_cast<const char*>(data), count * sizeof(T));
}

bool Exists(const std::string& path) { return std::ifstream(path).good(); }

// dir/params.txt: "name value" pairs; param("name") is one as an integer (missing: a failure).
struct Params {
  std::map<std::string, double> values;
  explicit Params(const std::string& dir) {
    std::ifstream in(dir + "/params.txt");
    for (std::string name; in >> name;) in >> values[name];
  }
  int64_t operator()(const char* name) const {
    auto it = values.find(name);
    if (it == values.end()) Fail(std::string("params.txt lacks ") + name);
    return static_cast<int64_t>(it->second);
  }
  double real(const char* name) const {  // missing: 0
    auto it = values.find(name);
    return it == values.end() ? 0.0 : it->second;
  }
};

template <typename E>
int Kernels(const std::string& dir, const flash_cpu::Problem& P, int64_t lk_pad, int64_t bq,
            int64_t bk, int64_t flags, int64_t chunks, ThreadPool& pool);

int Run(const std::string& dir) {
  const Params param(dir);
  const int64_t B = param("B"), Lq = param("Lq"), Lk = param("Lk"), Hq = param("Hq"), Hkv = param("Hkv"), D = param("D");
  const int64_t bq = param("block_q"), bk = param("block_k"), flags = param("flags"), chunks = param("chunks");
  const int64_t lk_pad = flash_cpu::round_up(Lk, flash_cpu::PW);
  ThreadPool pool{param("threads"), {}};

  auto q_len = Read<int32_t>(dir, "q_len", B), kv_len = Read<int32_t>(dir, "kv_len", B);
  auto d_lo = Read<int32_t>(dir, "d_lo", B), d_hi = Read<int32_t>(dir, "d_hi", B);
  flash_cpu::Problem P{B, Lq, Lk, Hq, Hkv, D, q_len.get(), kv_len.get(), d_lo.get(), d_hi.get()};
  std::unique_ptr<int32_t[]> q_seg, kv_seg;
  if (flags & 1) {
    q_seg = Read<int32_t>(dir, "q_seg", B * Lq);
    kv_seg = Read<int32_t>(dir, "kv_seg", B * Lk);
    P.q_seg = q_seg.get();
    P.kv_seg = kv_seg.get();
  }
  // [X0, X1, ...] arrays broadcast over batch and heads: their leading sizes come as params.
  std::unique_ptr<bool[]> mask;
  std::unique_ptr<float[]> bias, sinks;
  std::unique_ptr<uint32_t[]> seeds;
  if (flags & 2) {
    mask = Read<bool>(dir, "mask", param("mask_b") * param("mask_h") * Lq * Lk);
    P.mask = {mask.get(), param("mask_b"), param("mask_h"), Lq * Lk};
  }
  if (flags & 4) {
    bias = Read<float>(dir, "bias", param("bias_b") * param("bias_h") * Lq * Lk);
    P.bias = {bias.get(), param("bias_b"), param("bias_h"), Lq * Lk};
  }
  if (flags & 8) {
    sinks = Read<float>(dir, "sinks", param("sinks_b") * param("sinks_h"));
    P.sinks = {sinks.get(), param("sinks_b"), param("sinks_h"), 1};
  }
  std::unique_ptr<int8_t[]> tiles;
  if (flags & 32) {  // tile classes [tiles_b, tiles_h, nq, nk] of the grid (block_q, block_k)
    const int64_t nk = (Lk + bk - 1) / bk, cells = ((Lq + bq - 1) / bq) * nk;
    tiles = Read<int8_t>(dir, "tiles", param("tiles_b") * param("tiles_h") * cells);
    P.tiles = {tiles.get(), param("tiles_b"), param("tiles_h"), cells};
    P.tile_cols = nk;
  }
  P.scale = static_cast<float>(param.real("scale"));
  P.soft_cap = static_cast<float>(param.real("soft_cap"));
  P.dropout_rate = static_cast<float>(param.real("dropout_rate"));
  if (P.dropout_rate > 0.0f) {
    seeds = Read<uint32_t>(dir, "seeds", param("seeds_b") * param("seeds_h"));
    P.seeds = {seeds.get(), param("seeds_b"), param("seeds_h"), 1};
  }

  if (param.real("bf16") == 0) return Kernels<float>(dir, P, lk_pad, bq, bk, flags, chunks, pool);
#if defined(__AVX512BF16__)
  return Kernels<flash_cpu::Bf16Pair>(dir, P, lk_pad, bq, bk, flags, chunks, pool);
#else
  Fail("this harness was built without AVX512-BF16: no bfloat16 products");
#endif
}

// The forward, then (with DIR/delta.bin) the backward, on operands of element E: float32, or
// bfloat16 pairs (q, kt, q_heads, k, v_heads, d_out hold D / 2 pairs per row; v is in pairs of
// keys [B, Hkv, Lk_pad / 2, D]).
template <typename E>
int Kernels(const std::string& dir, const flash_cpu::Problem& P, int64_t lk_pad, int64_t bq,
            int64_t bk, int64_t flags, int64_t chunks, ThreadPool& pool) {
  constexpr int64_t per = flash_cpu::kValuesPer<E>;
  const int64_t B = P.B, Lq = P.Lq, Lk = P.Lk, Hq = P.Hq, Hkv = P.Hkv, D = P.D, KD = D / per;
  auto q = Read<E>(dir, "q", B * Lq * Hq * KD);  // [B, Lq, Hq, D]
  auto kt = Read<E>(dir, "kt", B * Hkv * lk_pad * KD);  // K^T panels
  auto v = Read<E>(dir, "v", B * Hkv * (per == 1 ? Lk : lk_pad / 2) * D);  // head-major
  const int64_t rows = B * Hq * Lq;
  std::unique_ptr<float[]> out(new float[B * Lq * Hq * D]), row_max(new float[rows]),
      log_sum(new float[rows]);
  flash_cpu::Forward(P, q.get(), kt.get(), v.get(), lk_pad, out.get(), row_max.get(),
                     log_sum.get(), bq, bk, pool);
  Write(dir, "out", out.get(), B * Lq * Hq * D);
  Write(dir, "row_max", row_max.get(), rows);
  Write(dir, "log_sum", log_sum.get(), rows);
  if (!Exists(dir + "/delta.bin")) return 0;

  // The backward takes every array head-major.
  auto qh = Read<E>(dir, "q_heads", B * Hq * Lq * KD);
  auto k = Read<E>(dir, "k", B * Hkv * Lk * KD);
  auto d_out = Read<E>(dir, "d_out", B * Hq * Lq * KD);
  auto vh = per == 1 ? std::unique_ptr<E[]>() : Read<E>(dir, "v_heads", B * Hkv * Lk * KD);
  auto delta = Read<float>(dir, "delta", rows);
  const bool with_dbias = flags & 16;
  std::unique_ptr<float[]> dq_parts(new float[chunks * B * Hq * Lq * D]()),
      dk(new float[B * Hkv * Lk * D]()), dv(new float[B * Hkv * Lk * D]()),
      dbias(with_dbias ? new float[B * Hq * Lq * Lk]() : nullptr);
  flash_cpu::Backward(P, qh.get(), k.get(), per == 1 ? v.get() : vh.get(), d_out.get(), row_max.get(), log_sum.get(),
                      delta.get(), dq_parts.get(), dk.get(), dv.get(), dbias.get(), bq, bk, chunks,
                      pool);
  Write(dir, "dq_parts", dq_parts.get(), chunks * B * Hq * Lq * D);
  Write(dir, "dk", dk.get(), B * Hkv * Lk * D);
  Write(dir, "dv", dv.get(), B * Hkv * Lk * D);
  if (with_dbias) Write(dir, "dbias", dbias.get(), B * Hq * Lq * Lk);
  return 0;
}

int Decode(const std::string& dir) {
  const Params param(dir);
  const int64_t B = param("B"), Lq = param("Lq"), Hq = param("Hq"), Hkv = param("Hkv"), Dp = param("Dp"), Dk = param("Dk");
  const int64_t paged = param("paged"), type = param("cache_type"), splits = param("splits");
  ThreadPool pool{param("threads"), {}};
  flash_cpu::KvCache cache;
  cache.type = type == 0 ? flash_cpu::CacheType::kF32 : flash_cpu::CacheType::kBF16;
  cache.bf16_products = param.real("bf16_products") != 0;  // q's values bfloat16 too
  cache.Dk = Dk;
  int64_t Lk, rows_in_cache;
  std::unique_ptr<int32_t[]> table;
  if (paged) {
    cache.num_pages = param("num_pages");
    cache.page_size = param("page_size");
    cache.pages_per_sequence = param("pages");
    table = Read<int32_t>(dir, "table", B * cache.pages_per_sequence);
    cache.page_table = table.get();
    Lk = cache.pages_per_sequence * cache.page_size;
    rows_in_cache = cache.num_pages * cache.page_size;
  } else {
    cache.Lk_dense = Lk = param("Lk");
    rows_in_cache = B * Lk;
  }
  const int64_t count = rows_in_cache * Hkv * Dk;
  std::unique_ptr<float[]> k32, v32;
  std::unique_ptr<uint16_t[]> k16, v16;
  if (type == 0) {
    k32 = Read<float>(dir, "k", count);
    v32 = Read<float>(dir, "v", count);
    cache.k = k32.get();
    cache.v = v32.get();
  } else {
    k16 = Read<uint16_t>(dir, "k", count);
    v16 = Read<uint16_t>(dir, "v", count);
    cache.k = k16.get();
    cache.v = v16.get();
  }
  auto q_len = Read<int32_t>(dir, "q_len", B), kv_len = Read<int32_t>(dir, "kv_len", B);
  auto d_lo = Read<int32_t>(dir, "d_lo", B), d_hi = Read<int32_t>(dir, "d_hi", B);
  flash_cpu::Problem P{B, Lq, Lk, Hq, Hkv, Dp, q_len.get(), kv_len.get(), d_lo.get(), d_hi.get()};
  std::unique_ptr<float[]> sinks;
  if (param("has_sinks")) {
    sinks = Read<float>(dir, "sinks", Hq);
    P.sinks = {sinks.get(), 1, Hq, 1};
  }
  P.scale = static_cast<float>(param.real("scale"));
  P.soft_cap = static_cast<float>(param.real("soft_cap"));
  auto q = Read<float>(dir, "q", B * Lq * Hq * Dp);
  const int64_t rows = B * Hq * Lq;
  std::unique_ptr<float[]> out(new float[B * Lq * Hq * Dp]), row_max(new float[rows]),
      log_sum(new float[rows]);
  flash_cpu::Decode(P, cache, q.get(), out.get(), row_max.get(), log_sum.get(), splits, pool);
  Write(dir, "out", out.get(), B * Lq * Hq * Dp);
  Write(dir, "row_max", row_max.get(), rows);
  Write(dir, "log_sum", log_sum.get(), rows);
  return 0;
}

// Every (rows, lengths, band, tile) in a small range, plus unbounded band sides: the spans
// keep 0 <= lo <= hi <= length with lo a tile multiple, contain every allowed pair's key
// (query), and for a band that allows any pair (d_lo <= d_hi, as every call's does) are as
// tight as the tile grid allows.
int Spans() {
  const int32_t unbounded = 1 << 30;
  const std::vector<int32_t> sides = {-unbounded, -9, -4, -1, 0, 1, 3, 8, unbounded};
  int64_t checked = 0;
  auto fail = [](const char* what, const flash_cpu::Problem& P, int64_t a, int64_t z,
                 int64_t tile, flash_cpu::Span s) {
    std::fprintf(stderr, "spans: %s: L=%lld q_len=%d kv_len=%d band [%d, %d], range [%lld, %lld), "
                 "tile %lld -> [%lld, %lld)\n", what, static_cast<long long>(P.Lq), *P.q_len,
                 *P.kv_len, *P.d_lo, *P.d_hi, static_cast<long long>(a), static_cast<long long>(z),
                 static_cast<long long>(tile), static_cast<long long>(s.lo), static_cast<long long>(s.hi));
    std::exit(1);
  };
  for (int64_t L = 1; L <= 9; ++L)
    for (int32_t qlen = 0; qlen <= L + 1; ++qlen)  // one past L: clamped like a traced length
      for (int32_t kvlen = 0; kvlen <= L + 1; ++kvlen)
        for (int32_t lo_side : sides)
          for (int32_t hi_side : sides)
            for (int64_t tile : {1, 2, 3, 4, 64}) {
              int32_t ql = qlen, kl = kvlen, dl = lo_side, dh = hi_side;
              flash_cpu::Problem P{1, L, L, 1, 1, 16, &ql, &kl, &dl, &dh};
              auto ok = [&](int64_t i, int64_t j) {  // rules 1-3
                return i < P.qlen(0) && j < P.kvlen(0) && j - i >= dl && j - i <= dh;
              };
              for (int64_t a = 0; a < L; ++a)
                for (int64_t z = a + 1; z <= L; ++z) {
                  ++checked;
                  // Keys of rows [a, z), queries of keys [a, z).
                  for (int dir = 0; dir < 2; ++dir) {
                    flash_cpu::Span s = dir == 0 ? P.KeySpan(0, a, z, tile) : P.QuerySpan(0, a, z, tile);
                    int64_t first = L, last = -1;
                    for (int64_t x = a; x < z; ++x)
                      for (int64_t y = 0; y < L; ++y)
                        if (dir == 0 ? ok(x, y) : ok(y, x)) {
                          first = std::min(first, y);
                          last = std::max(last, y);
                        }
                    const int64_t bound = dir == 0 ? P.kvlen(0) : P.qlen(0);
                    if (s.lo < 0 || s.lo > s.hi || s.hi > bound || s.lo % tile) fail("bounds", P, a, z, tile, s);
                    if (last >= 0 && (s.lo > first || s.hi <= last))
                      fail("an allowed pair outside", P, a, z, tile, s);
                    if (dl > dh) continue;  // no pair at all: a span may still be returned
                    if (last < 0 ? s.lo != 0 || s.hi != 0
                                 : s.lo != first / tile * tile || s.hi != last + 1)
                      fail("not as tight as the tiles allow", P, a, z, tile, s);
                  }
                }
            }
  std::printf("spans: %lld row and key ranges checked\n", static_cast<long long>(checked));
  return 0;
}

// exp2v of DIR/x.bin (count floats) into DIR/exp2.bin, W values at a time.
int Exp2(const std::string& dir, int64_t count) {
  auto x = Read<float>(dir, "x", count);
  std::unique_ptr<float[]> y(new float[count]);
  for (int64_t i = 0; i < count; i += flash_cpu::W) {
    float lanes[flash_cpu::W] = {};  // the tail padded with zeros, dropped below
    const int64_t n = std::min<int64_t>(flash_cpu::W, count - i);
    std::copy(x.get() + i, x.get() + i + n, lanes);
    flash_cpu::store(lanes, flash_cpu::exp2v(flash_cpu::load(lanes)));
    std::copy(lanes, lanes + n, y.get() + i);
  }
  Write(dir, "exp2", y.get(), count);
  return 0;
}

// The programs as the kernels run them on a row (tile_rows.h: ScoreRow, MaskRow's mask_mod,
// ScoreGradientRow and the scatter), each present one written out. The keys kv are any
// int32s: the row is a tile of one row whose diagonal input is kv - q per key.
int Mods(const std::string& dir) {
  using namespace flash_cpu;
  const Params param(dir);
  const int64_t n = param("n"), nw = round_up(n, W);
  auto words = Read<int32_t>(dir, "words", param("words"));
  auto aux = Read<float>(dir, "aux", param("aux"));
  auto s = Read<float>(dir, "s", n), ct = Read<float>(dir, "ct", n);
  auto kv = Read<int32_t>(dir, "kv", n);
  const ModProgram program{words.get(), aux.get()};
  ModRegisters r;
  r.Resize(program, nw, 1);
  r.SetUniform(kUniformBatch, static_cast<int32_t>(param("b")));
  r.SetUniform(kUniformHead, static_cast<int32_t>(param("h")));
  std::memcpy(r.at(kRowKey), kv.get(), n * sizeof(int32_t));
  const int64_t i = param("q");
  r.SetTile(i, 1, 0, nw);
  float* diagonal = r.at(static_cast<int32_t>(r.rows) + kDiagonal);
  for (int64_t c = 0; c < nw; ++c) {
    const int32_t d = c < n ? static_cast<int32_t>(static_cast<uint32_t>(kv[c]) - static_cast<uint32_t>(i)) : 0;
    std::memcpy(diagonal + c, &d, sizeof d);
  }
  std::vector<float> row(nw, 0.0f), slope(nw, 0.0f), d_aux(program.aux_floats(), 0.0f);
  if (program.score()) {
    RunModTile(program, r, false);
    std::copy(s.get(), s.get() + n, row.begin());
    ScoreRow(program, r, i, row.data(), n, nw);
    Write(dir, "score", row.data(), n);
    RunModTile(program, r, true);
    std::copy(s.get(), s.get() + n, row.begin());
    ScoreGradientRow(program, r, i, row.data(), slope.data(), n, nw);
    Write(dir, "value", row.data(), n);
    Write(dir, "slope", slope.data(), n);
    std::copy(ct.get(), ct.get() + n, r.at(kRowCotangent));
    RunModProgram(program, program[kScatterStart], program[kScatterCount], r, n, nw, d_aux.data());
    Write(dir, "d_aux", d_aux.data(), program.aux_floats());
  }
  if (program.mask()) {
    RunModTile(program, r, false);
    r.SetUniform(kUniformQuery, static_cast<int32_t>(i));
    r.SetRow(i, nw);
    RunModProgram(program, program[kMaskStart], program[kMaskCount], r, n, nw, nullptr);
    std::vector<int32_t> verdict(n);
    for (int64_t c = 0; c < n; ++c) std::memcpy(&verdict[c], RegisterLane(r, program[kMaskOut], c), 4);
    Write(dir, "mask", verdict.data(), n);
  }
  return 0;
}

// The programs on a tile as the forward and the backward run them (ModTile, then each row):
// params (rows, n, i0, j0, b, h, words, aux), words.bin, aux.bin, s.bin and ct.bin [rows, n];
// writes score.bin, value.bin, slope.bin, mask.bin (int32) [rows, n] and d_aux.bin (the rows'
// sum, in row order).
int ModsTile(const std::string& dir) {
  using namespace flash_cpu;
  const Params param(dir);
  const int64_t rows = param("rows"), n = param("n"), nw = round_up(n, W);
  const int64_t i0 = param("i0"), j0 = param("j0");
  auto words = Read<int32_t>(dir, "words", param("words"));
  auto aux = Read<float>(dir, "aux", param("aux"));
  auto s = Read<float>(dir, "s", rows * n), ct = Read<float>(dir, "ct", rows * n);
  const ModProgram program{words.get(), aux.get()};
  ModRegisters r;
  r.Resize(program, nw, rows);
  r.SetUniform(kUniformBatch, static_cast<int32_t>(param("b")));
  r.SetUniform(kUniformHead, static_cast<int32_t>(param("h")));
  r.SetKeys(j0, nw);
  std::vector<float> row(nw, 0.0f), slope(nw, 0.0f), d_aux(program.aux_floats(), 0.0f);
  std::vector<float> score(rows * n), value(rows * n), slopes(rows * n);
  std::vector<int32_t> verdict(rows * n);
  if (program.score()) {
    ModTile(program, r, false, i0, rows, j0, nw);
    for (int64_t k = 0; k < rows; ++k) {
      std::copy(s.get() + k * n, s.get() + (k + 1) * n, row.begin());
      ScoreRow(program, r, i0 + k, row.data(), n, nw);
      std::copy(row.begin(), row.begin() + n, score.begin() + k * n);
    }
    ModTile(program, r, true, i0, rows, j0, nw);
    for (int64_t k = 0; k < rows; ++k) {
      std::copy(s.get() + k * n, s.get() + (k + 1) * n, row.begin());
      ScoreGradientRow(program, r, i0 + k, row.data(), slope.data(), n, nw);
      std::copy(row.begin(), row.begin() + n, value.begin() + k * n);
      std::copy(slope.begin(), slope.begin() + n, slopes.begin() + k * n);
      float* ctr = r.at(kRowCotangent);
      std::fill(ctr, ctr + nw, 0.0f);
      std::copy(ct.get() + k * n, ct.get() + (k + 1) * n, ctr);
      RunModProgram(program, program[kScatterStart], program[kScatterCount], r, n, nw, d_aux.data());
    }
    Write(dir, "score", score.data(), rows * n);
    Write(dir, "value", value.data(), rows * n);
    Write(dir, "slope", slopes.data(), rows * n);
    Write(dir, "d_aux", d_aux.data(), program.aux_floats());
  }
  if (program.mask()) {
    ModTile(program, r, false, i0, rows, j0, nw);
    for (int64_t k = 0; k < rows; ++k) {
      r.SetUniform(kUniformQuery, static_cast<int32_t>(i0 + k));
      r.SetRow(i0 + k, nw);
      RunModProgram(program, program[kMaskStart], program[kMaskCount], r, n, nw, nullptr);
      for (int64_t c = 0; c < n; ++c)
        std::memcpy(&verdict[k * n + c], RegisterLane(r, program[kMaskOut], c), 4);
    }
    Write(dir, "mask", verdict.data(), rows * n);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "spans") return Spans();
  if (mode == "run" && argc == 3) return Run(argv[2]);
  if (mode == "decode" && argc == 3) return Decode(argv[2]);
  if (mode == "exp2" && argc == 4) return Exp2(argv[2], std::atoll(argv[3]));
  if (mode == "mods" && argc == 3) return Mods(argv[2]);
  if (mode == "mods_tile" && argc == 3) return ModsTile(argv[2]);
  Fail("usage: harness spans | harness run DIR | harness decode DIR | harness exp2 DIR N | "
       "harness mods DIR | harness mods_tile DIR");
}
