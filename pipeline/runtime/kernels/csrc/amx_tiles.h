// AMX tile formats (Sapphire Rapids and later): a block of 16 weight rows against every activation row of a step
// in tile multiply-adds, for bf16, int8 and int4 weights. Built into the library only where the CPU has AMX
// (build.py's "amx" instruction set); elsewhere tiles_available() is false and the register tiles of
// gemm_blocks.h run every step.
//
// Layout: the weights stay as stored ([N, K] rows): a weight block is the A operand (16 rows of 64 bytes, one
// tile load with the row stride of W), and the activations are packed per call into the B operand's
// layout (16 k-pairs (bf16) or k-quads (int8) by 16 activation rows), so no engine format changes with the CPU.
// A C tile then holds 16 weight rows by 16 activation rows, transposed on the way out.
//
// Numerics: int8 dots are exact, the same integers as the register tiles: the int16 activation levels
// (quantize_rows_int16) are split into a signed high byte and an unsigned low byte, x = 256 hi + lo, each
// multiplied in its own tile (dpbssd, dpbsud) into int32 sums that cannot overflow (|w hi| <= 127 * 64 and
// w lo <= 127 * 255 per product), joined in int64; W8A8 levels are bytes already, one dpbssd. So an int8 step
// gives the same bits with tiles or without.
// bf16 dots (and int4 ones in steps of more than kInt4DirectMaxRows rows, on weights dequantized to bf16)
// multiply the same bf16-rounded values as the register tiles and sum the products in fp32 in the tile unit's
// order, so they differ from the register tiles' sums by rounding (~1e-6 relative); a row's
// result still does not depend on the rows beside it, since each C element sums its own row and column.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <type_traits>

#include "gemm_blocks.h"

namespace llmp {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define LLMP_TILES 1

constexpr int kTileRows = 16;         // rows of every tile: weight rows of a block, activation rows of a B tile
constexpr int64_t kBf16TileK = 32;    // k a bf16 tile step covers (16 pairs)
constexpr int64_t kInt8TileK = 64;    // k an int8 tile step covers (16 quads)

// Linux gives a process the 8 KB of tile state only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); the permission is process-wide, so once is enough.
inline bool tiles_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

// Off only on request (set_tiles: tests and benchmarks compare both paths in one process).
inline std::atomic<bool> tiles_enabled{true};

inline bool tiles_on() { return tiles_enabled.load(std::memory_order_relaxed) && tiles_permitted(); }

// Fewest activation rows a step takes to the tiles. Below them the register tiles win: a tile load takes one
// 64-byte line from each of 16 weight rows, which streams from memory slower than whole rows do, and an int8
// step pays two tile multiply-adds per line (high and low bytes). Measured on a Sapphire Rapids class Xeon
// (2 threads, SmolLM2-135M, scripts/bench_kernels.py ab, tiles / register tiles time, the tiles' prefetches
// in): the bf16 decoder layers 1.04x at one row (0.91x at 2-4 rows, 0.47x at 16 without them); the int8
// ones 1.00x at 4 rows, 0.87x at 5, 0.92x at 6, 0.78x at 7, 0.75x at 8; the int8 lm_head GEMM (greedy head)
// 0.86x at 3 rows, 0.95x at 4, 0.80x at 6. The widened bf16 lm_head (fp32 logits, TilesWidened): 1.02-1.06x at
// one row, 0.80x at 2, 0.71x at 5, 0.57x at 8, 0.45x at 16.
constexpr int64_t kBf16TileMinRows = 2;
constexpr int64_t kInt8TileMinRows = 5;
constexpr int64_t kW8A8TileMinRows = 2;
constexpr int64_t kInt8GemmTileMinRows = 3;
constexpr int64_t kWidenedTileMinRows = 2;

// Whether a layer's shape walks in whole tiles: 16-row weight blocks (twice that for a gate_up pair, whose
// gate and up halves go in units of 16 columns each) and whole tile steps along K.
inline bool tiles_fit(int64_t N, int64_t K, int64_t tile_k, bool pair) {
  return N % (pair ? 2 * kTileRows : kTileRows) == 0 && K % tile_k == 0;
}

// Palette 1: every tile 16 rows; A tiles (weights) of 64 bytes, B and C tiles of 4 bytes per activation row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate (C), 4-5 hold weights (A), 6-7 activations (B).
constexpr int kFirstWeightTile = 4, kFirstActivationTile = 6;

// Each thread loads the configuration before its tile ops and releases the tiles after them: torch's oneDNN
// kernels configure and release the same registers between our calls. `width`: activation rows per B tile
// (tile_width of the step's rows).
inline void start_tiles(int64_t width) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = static_cast<uint16_t>(t >= kFirstWeightTile && t < kFirstActivationTile ? 64 : 4 * width);
    c.rows[t] = kTileRows;
  }
  _tile_loadconfig(&c);
}
inline void stop_tiles() { _tile_release(); }

inline void zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

inline int64_t padded_rows(int64_t M) { return (M + kTileRows - 1) / kTileRows * kTileRows; }

// Activation rows per B tile: a step of up to 16 rows fills one tile of exactly its rows (so a decode step
// loads and multiplies no padding), longer steps tiles of 16, the last one padded with zeros.
inline int64_t tile_width(int64_t M) { return M < kTileRows ? M : kTileRows; }

// p rounded up to a 64-byte line: a tile row that straddles two lines loads at half speed (prepare's scratch
// keeps kAlignSlack floats for it).
constexpr int64_t kAlignSlack = 16;
inline uint32_t* line_aligned(void* p) {
  return reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

// 32-bit units [M, Q] (row stride ld) -> the B tiles of every block of W = tile_width(M) rows:
// packed[(mb Q + q) W + i] = src[W mb + i][q], rows past M zero.
inline void pack_tile_columns(const uint32_t* src, int64_t ld, int64_t M, int64_t Q, uint32_t* packed) {
  const int64_t W = tile_width(M);
  const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int>(ld)));
  for (int64_t mb = 0; mb * W < M; ++mb) {
    const int64_t rows = M - mb * W < W ? M - mb * W : W;
    const uint32_t* base = src + mb * W * ld;
    uint32_t* out = packed + mb * Q * W;
    if (rows < kTileRows / 2) {  // few rows (decode): their values one by one
      if (rows < W) memset(out, 0, sizeof(uint32_t) * Q * W);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t q = 0; q < Q; ++q) out[q * W + i] = base[i * ld + q];
      continue;
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << rows) - 1u), lanes = static_cast<__mmask16>((1u << W) - 1u);
    for (int64_t q = 0; q < Q; ++q)
      _mm512_mask_storeu_epi32(out + q * W, lanes,
                               _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, index, base + q, 4));
  }
  asm volatile("" ::: "memory");  // the tile loads read `packed` through asm the compiler cannot see into
}

// Before k-step c of a block (16 rows of `row_bytes` from `block`, `steps` steps of one 64-byte line per row):
// the lines of step c + kPrefetchSteps, in the next block once past this one's end. A tile load takes one line
// from each of 16 rows, a pattern the hardware prefetchers follow less well than one stream.
constexpr int64_t kPrefetchSteps = 4;
inline void prefetch_rows(const char* block, int64_t row_bytes, int64_t steps, int64_t c) {
  // An address, not a pointer: past the last block the lines lie past the end of the weights.
  const int64_t ahead = c + kPrefetchSteps;
  const uintptr_t line = reinterpret_cast<uintptr_t>(block) +
                         (ahead < steps ? ahead * 64 : kTileRows * row_bytes + (ahead - steps) * 64);
  for (int r = 0; r < kTileRows; ++r) prefetch_line<0>(reinterpret_cast<const void*>(line + r * row_bytes));
}

// out = (C0 + C1) + (C2 + C3), the four C tiles' sums for W activation rows: fp32 (bf16 tiles) or int32 (int8).
template <typename T>
inline void sum_accumulators(int64_t W, T out[kTileRows * kTileRows]) {
  const int64_t ldb = 4 * W;
  alignas(64) T parts[4][kTileRows * kTileRows];
  _tile_stored(0, parts[0], ldb);
  _tile_stored(1, parts[1], ldb);
  _tile_stored(2, parts[2], ldb);
  _tile_stored(3, parts[3], ldb);
  const auto add = [](__m512 a, __m512 b) {
    if constexpr (std::is_same_v<T, float>)
      return _mm512_add_ps(a, b);
    else
      return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  };
  const auto load = [&](int j, int64_t i) { return _mm512_load_ps(reinterpret_cast<const float*>(parts[j] + i)); };
  for (int64_t i = 0; i < kTileRows * W; i += 16)
    _mm512_store_ps(reinterpret_cast<float*>(out + i), add(add(load(0, i), load(1, i)), add(load(2, i), load(3, i))));
}

// Column i of a stored C tile (16 rows of W 32-bit values): the 16 weight rows' outputs for activation row i.
inline __m512i tile_column(const void* block, int64_t W, int64_t i) {
  const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int>(W)));
  return _mm512_i32gather_epi32(index, static_cast<const int*>(block) + i, 4);
}

// y[m, n0 .. n0 + 15] = v * scale + bias, or += with p.accumulate, as emit() computes them.
inline void put_tile_row(const Problem& p, int64_t n0, int64_t m, __m512 v, __m512 scale) {
  v = _mm512_fmadd_ps(v, scale, p.bias != nullptr ? _mm512_loadu_ps(p.bias + n0) : _mm512_setzero_ps());
  float* y = p.y + m * p.ldy + n0;
  _mm512_storeu_ps(y, p.accumulate ? _mm512_add_ps(_mm512_loadu_ps(y), v) : v);
}

// bf16 weights. xp: the activation rows rounded to bf16 (round_rows_bf16) and packed as k-pairs.
struct TilesBF16 {
  static constexpr int kBlockRows = kTileRows;
  const bf16* w;
  const uint32_t* xp;  // [blocks, K / 2, tile_width(M)]

  // Floats of scratch prepare() takes for M rows of K.
  static int64_t scratch_floats(int64_t M, int64_t K) { return (M * K + padded_rows(M) * K) / 2 + 1 + kAlignSlack; }

  static TilesBF16 prepare(const bf16* w, const Problem& p, float* scratch) {
    auto* rounded = reinterpret_cast<bf16*>(scratch);
    uint32_t* packed = line_aligned(rounded + p.M * p.K);
    round_rows_bf16(p.x, p.M, p.K, p.ldx, rounded);
    pack_tile_columns(reinterpret_cast<const uint32_t*>(rounded), p.K / 2, p.M, p.K / 2, packed);
    return TilesBF16{w, packed};
  }

  // Activation block mb against the 16 weight rows at wb (row stride K): k-step c into C tile c % 4 (four
  // independent accumulators keep the tile unit busy where one would wait out each multiply-add's latency),
  // summed as (C0 + C1) + (C2 + C3) whatever the step's row count.
  void pass(const Problem& p, const bf16* wb, int64_t mb, bool prefetch, float out[kTileRows * kTileRows]) const {
    const int64_t K = p.K, steps = K / kBf16TileK;
    const int64_t W = tile_width(p.M), ldb = 4 * W;
    const uint32_t* xb = xp + mb * (K / 2) * W;
    const auto fetch = [&](int64_t c) {
      if (prefetch) prefetch_rows(reinterpret_cast<const char*>(wb), K * 2, steps, c);
    };
    const auto a = [&](int64_t c) { return wb + c * kBf16TileK; };
    const auto b = [&](int64_t c) { return xb + c * 16 * W; };
    zero_accumulators();
    int64_t c = 0;
    for (; c + 4 <= steps; c += 4) {
      fetch(c);
      fetch(c + 1);
      fetch(c + 2);
      fetch(c + 3);
      step_into<0>(a(c), K * 2, b(c), ldb);
      step_into<1>(a(c + 1), K * 2, b(c + 1), ldb);
      step_into<2>(a(c + 2), K * 2, b(c + 2), ldb);
      step_into<3>(a(c + 3), K * 2, b(c + 3), ldb);
    }
    if (c < steps) {
      fetch(c);
      step_into<0>(a(c), K * 2, b(c), ldb);
    }
    if (++c < steps) {
      fetch(c);
      step_into<1>(a(c), K * 2, b(c), ldb);
    }
    if (++c < steps) {
      fetch(c);
      step_into<2>(a(c), K * 2, b(c), ldb);
    }
    sum_accumulators(W, out);
  }

  // One k-step into C tile kAcc: the 16 weight rows' 32 k at a (row stride lda bytes) against the packed
  // activations at b (row stride ldb bytes). Weight and activation tiles alternate between two registers each
  // (GCC's tile intrinsics paste their register numbers into the assembly, so they are spelled out).
  template <int kAcc>
  static void step_into(const void* a, int64_t lda, const void* b, int64_t ldb) {
    if constexpr (kAcc % 2 == 0) {
      _tile_loadd(4, a, lda);
      _tile_loadd(6, b, ldb);
    } else {
      _tile_loadd(5, a, lda);
      _tile_loadd(7, b, ldb);
    }
    if constexpr (kAcc == 0) _tile_dpbf16ps(0, 4, 6);
    if constexpr (kAcc == 1) _tile_dpbf16ps(1, 5, 7);
    if constexpr (kAcc == 2) _tile_dpbf16ps(2, 4, 6);
    if constexpr (kAcc == 3) _tile_dpbf16ps(3, 5, 7);
  }

  // k-step c of activation block mb against the 16 weight rows at a (row stride lda bytes), into C tile c % 4
  // as pass() accumulates it.
  void step(const Problem& p, int64_t mb, int64_t c, const bf16* a, int64_t lda) const {
    const int64_t W = tile_width(p.M);
    const uint32_t* b = xp + mb * (p.K / 2) * W + c * 16 * W;
    switch (c % 4) {
      case 0: return step_into<0>(a, lda, b, 4 * W);
      case 1: return step_into<1>(a, lda, b, 4 * W);
      case 2: return step_into<2>(a, lda, b, 4 * W);
      default: return step_into<3>(a, lda, b, 4 * W);
    }
  }

  void whole_block(const Problem& p, int64_t n0) const { block_rows(p, n0, w + n0 * p.K, true); }

  // Every activation row against the 16 weight rows at wb (output rows n0 .. n0 + 15); `prefetch`: stream the
  // rows after them (weights read from memory, not a tile dequantized into cache).
  void block_rows(const Problem& p, int64_t n0, const bf16* wb, bool prefetch) const {
    alignas(64) float out[kTileRows * kTileRows];
    const int64_t W = tile_width(p.M);
    for (int64_t mb = 0; mb * W < p.M; ++mb) {
      pass(p, wb, mb, prefetch && mb == 0, out);
      put_rows(p, n0, mb, out);
    }
  }

  // The outputs of activation block mb (summed C tiles `out`) for weight rows n0 .. n0 + 15.
  static void put_rows(const Problem& p, int64_t n0, int64_t mb, const float out[kTileRows * kTileRows]) {
    const int64_t W = tile_width(p.M);
    for (int64_t i = 0; i < W && mb * W + i < p.M; ++i)
      put_tile_row(p, n0, mb * W + i, _mm512_castsi512_ps(tile_column(out, W, i)), _mm512_set1_ps(1.0f));
  }
};

// bf16 weights read widened (a bf16 checkpoint's lm_head under fp32 compute): the fp32 logits with the bf16
// tile unit. Each fp32 activation splits exactly into three bf16 parts, x = hi + mid + lo (hi = bf16(x), mid =
// bf16(x - hi), lo = x - hi - mid: 8 + 8 + 8 significant bits cover fp32's 24), so every product w * part is
// exact in fp32 and only the order of the fp32 sums differs from the register tiles' (DenseF32<bf16>): ~1e-7
// relative, like any two fp32 GEMMs. Parts are summed on their own, then joined as (hi + mid) + lo, and no sum
// depends on the rows beside its own: a row's logits do not change with the rows that share its step.
// Each part sums along K in one accumulator. Up to 5 rows the three parts share one B tile; from 6 rows each
// part of a group of up to 16 rows has a tile of its own, and every k-step loads its weights once into three
// multiply-adds, one accumulator per part: three passes of TilesBF16 instead, each loading the weights again,
// took 1.2-1.4x as long (SmolLM2's lm_head, 2 threads, 6-16 rows).
struct TilesWidened {
  static constexpr int kBlockRows = kTileRows;
  static constexpr int kParts = 3;
  const bf16* w;
  const uint32_t* xp;  // the B tiles of every group of activation rows in turn

  // Activation rows per group, and whether its parts share one tile (else one tile per part).
  static bool shared(int64_t M) { return kParts * M < kTileRows; }
  static int64_t group_rows(int64_t M) { return shared(M) ? M : tile_width(M); }
  static int64_t tiles_per_group(int64_t M) { return shared(M) ? 1 : kParts; }
  // Columns of every B tile (what start_tiles configures).
  static int64_t columns(int64_t M) { return shared(M) ? kParts * M : tile_width(M); }
  static int64_t num_tiles(int64_t M) { return (M + group_rows(M) - 1) / group_rows(M) * tiles_per_group(M); }

  static int64_t scratch_floats(int64_t M, int64_t K) { return num_tiles(M) * columns(M) * K / 2 + kAlignSlack; }

  static TilesWidened prepare(const bf16* w, const Problem& p, float* scratch) {
    const int64_t R = group_rows(p.M), T = tiles_per_group(p.M), W = columns(p.M), Q = p.K / 2;
    auto* packed = reinterpret_cast<uint16_t*>(line_aligned(scratch));
    if (p.M % R != 0) memset(packed, 0, sizeof(uint16_t) * 2 * num_tiles(p.M) * W * Q);  // a short last group
    for (int64_t m = 0; m < p.M; ++m) {
      const float* xm = p.x + m * p.ldx;
      // Part t of row m: column (T == 1 ? t R : 0) + m % R of tile (m / R) T + (T == 1 ? 0 : t), k-pairs.
      uint16_t* column[kParts];
      for (int t = 0; t < kParts; ++t)
        column[t] = packed + ((m / R) * T + (T == 1 ? 0 : t)) * Q * W * 2 + ((T == 1 ? t * R : 0) + m % R) * 2;
      for (int64_t k = 0; k < p.K; ++k) {
        const int64_t at = (k / 2) * W * 2 + k % 2;
        const uint16_t hi = narrow(xm[k]);
        const float rest = xm[k] - widen(hi);
        const uint16_t mid = narrow(rest);
        column[0][at] = hi;
        column[1][at] = mid;
        column[2][at] = narrow(rest - widen(mid));
      }
    }
    asm volatile("" ::: "memory");  // the tile loads read `packed` through asm the compiler cannot see into
    return TilesWidened{w, reinterpret_cast<const uint32_t*>(packed)};
  }

  // x rounded to the nearest bf16 (ties to even), and back: both exact where the split needs them.
  static uint16_t narrow(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return static_cast<uint16_t>(bf16_round_bits(b) >> 16);
  }
  static float widen(uint16_t h) {
    const uint32_t b = uint32_t{h} << 16;
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
  }

  // The one group's shared tile (up to 5 rows) against the 16 weight rows at wb, into C0 along K as
  // part_pass sums each part, so both paths give a row the same bits.
  void shared_pass(const Problem& p, const bf16* wb, bool prefetch, float out[kTileRows * kTileRows]) const {
    const int64_t K = p.K, steps = K / kBf16TileK, ldb = 4 * columns(p.M);
    _tile_zero(0);
    for (int64_t c = 0; c < steps; ++c) {
      if (prefetch) prefetch_rows(reinterpret_cast<const char*>(wb), K * 2, steps, c);
      const bf16* a = wb + c * kBf16TileK;
      const uint32_t* b = xp + c * 16 * (ldb / 4);
      if (c % 2 == 0) {
        _tile_loadd(4, a, K * 2);
        _tile_loadd(6, b, ldb);
        _tile_dpbf16ps(0, 4, 6);
      } else {
        _tile_loadd(5, a, K * 2);
        _tile_loadd(7, b, ldb);
        _tile_dpbf16ps(0, 5, 7);
      }
    }
    _tile_stored(0, out, ldb);
  }

  // Group g's three part tiles against the 16 weight rows at wb: C0 (hi), C1 (mid) and C2 (lo). The weights
  // alternate between tiles 4 and 5 by k-step; the parts go through 6, 7 and 3 (an accumulator-shaped tile
  // is a B tile's shape).
  void part_pass(const Problem& p, const bf16* wb, int64_t g, bool prefetch, float out[kParts][kTileRows * kTileRows]) const {
    const int64_t K = p.K, steps = K / kBf16TileK, W = columns(p.M), ldb = 4 * W, tile = (K / 2) * W;
    const uint32_t* xb = xp + g * kParts * tile;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t c = 0; c < steps; ++c) {
      if (prefetch) prefetch_rows(reinterpret_cast<const char*>(wb), K * 2, steps, c);
      const uint32_t* b = xb + c * 16 * W;
      if (c % 2 == 0)
        part_step<4>(wb + c * kBf16TileK, K * 2, b, tile, ldb);
      else
        part_step<5>(wb + c * kBf16TileK, K * 2, b, tile, ldb);
    }
    _tile_stored(0, out[0], ldb);
    _tile_stored(1, out[1], ldb);
    _tile_stored(2, out[2], ldb);
  }

  // GCC pastes tile register numbers into the assembly as written, so the weight tile is a macro argument.
#define LLMP_WIDENED_PART_STEP(A)          \
  _tile_loadd(A, a, lda);                  \
  _tile_loadd(6, b, ldb);                  \
  _tile_dpbf16ps(0, A, 6);                 \
  _tile_loadd(7, b + tile, ldb);           \
  _tile_dpbf16ps(1, A, 7);                 \
  _tile_loadd(3, b + 2 * tile, ldb);       \
  _tile_dpbf16ps(2, A, 3)
  template <int kA>
  static void part_step(const void* a, int64_t lda, const uint32_t* b, int64_t tile, int64_t ldb) {
    if constexpr (kA == 4) {
      LLMP_WIDENED_PART_STEP(4);
    } else {
      LLMP_WIDENED_PART_STEP(5);
    }
  }
#undef LLMP_WIDENED_PART_STEP

  void whole_block(const Problem& p, int64_t n0) const {
    const int64_t R = group_rows(p.M), T = tiles_per_group(p.M), W = columns(p.M);
    const bf16* wb = w + n0 * p.K;
    alignas(64) float out[kParts][kTileRows * kTileRows];
    for (int64_t g = 0; g * R < p.M; ++g) {
      if (T == 1)
        shared_pass(p, wb, g == 0, out[0]);
      else
        part_pass(p, wb, g, g == 0, out);
      for (int64_t i = 0; i < R && g * R + i < p.M; ++i) {
        const auto part = [&](int t) {
          return _mm512_castsi512_ps(tile_column(out[T == 1 ? 0 : t], W, (T == 1 ? t * R : 0) + i));
        };
        put_tile_row(p, n0, g * R + i, _mm512_add_ps(_mm512_add_ps(part(0), part(1)), part(2)), _mm512_set1_ps(1.0f));
      }
    }
  }
};

// int8 weights. xh / xl: the high (signed) and low (unsigned) bytes of the int16 activation levels, packed as
// k-quads; xs: the levels' per-row scales. W8A8 layers' levels are int8 already (kW8A8QMax): xh holds them and
// xl is null, one tile multiply-add per k-step instead of two.
struct TilesInt8 {
  static constexpr int kBlockRows = kTileRows;
  const int8_t* w;
  const float* scales;  // [N]
  const uint32_t* xh;   // [blocks, K / 4, tile_width(M)]
  const uint32_t* xl;   // the same, or null (W8A8)
  const float* xs;      // [M]

  // Scratch: the row scales [M] and int16 levels [M, K], their high and low bytes [2, M, K], the packed tiles.
  static int64_t bytes_offset(int64_t M, int64_t K) { return M + (M * K + 1) / 2; }
  static int64_t scratch_floats(int64_t M, int64_t K) {
    return bytes_offset(M, K) + (2 * M * K + 3) / 4 + (2 * padded_rows(M) * K + 3) / 4 + kAlignSlack;
  }

  // Quantizes p's rows (quantize_rows_int16, to int8 levels with `int8_activations`) into `scratch` and packs
  // their bytes.
  static TilesInt8 prepare(const int8_t* w, const float* scales, const Problem& p, float* scratch,
                           bool int8_activations) {
    const int64_t M = p.M, K = p.K;
    float* xs = scratch;
    auto* xq = reinterpret_cast<int16_t*>(xs + M);
    quantize_rows_int16(p.x, M, K, p.ldx, xq, xs, act_qmax(int8_activations));
    auto* bytes = reinterpret_cast<uint8_t*>(scratch + bytes_offset(M, K));
    uint32_t* xh = line_aligned(bytes + 2 * M * K);
    if (int8_activations) {
      narrow_bytes(xq, M * K, bytes);
      pack_tile_columns(reinterpret_cast<const uint32_t*>(bytes), K / 4, M, K / 4, xh);
      return TilesInt8{w, scales, xh, nullptr, xs};
    }
    split_bytes(xq, M * K, bytes, bytes + M * K);
    uint32_t* xl = xh + padded_rows(M) * K / 4;
    pack_tile_columns(reinterpret_cast<const uint32_t*>(bytes), K / 4, M, K / 4, xh);
    pack_tile_columns(reinterpret_cast<const uint32_t*>(bytes + M * K), K / 4, M, K / 4, xl);
    return TilesInt8{w, scales, xh, xl, xs};
  }

  // Levels within a byte's range, as bytes.
  static void narrow_bytes(const int16_t* xq, int64_t count, uint8_t* out) {
    int64_t i = 0;
    for (; i + 32 <= count; i += 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi16_epi8(_mm512_loadu_si512(xq + i)));
    for (; i < count; ++i) out[i] = static_cast<uint8_t>(static_cast<int8_t>(xq[i]));
  }

  // x = 256 hi + lo: hi = x >> 8 in [-64, 63], lo = x & 255.
  static void split_bytes(const int16_t* xq, int64_t count, uint8_t* hi, uint8_t* lo) {
    int64_t i = 0;
    for (; i + 32 <= count; i += 32) {
      const __m512i v = _mm512_loadu_si512(xq + i);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i),
                          _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(0xFF))));
    }
    for (; i < count; ++i) {
      hi[i] = static_cast<uint8_t>(static_cast<int8_t>(xq[i] >> 8));
      lo[i] = static_cast<uint8_t>(xq[i] & 0xFF);
    }
  }

  // Activation block mb against weight rows n0 .. n0 + 15: high-byte sums of even k-steps in C tile 0, odd
  // ones in 1, low-byte sums in 2 and 3 (four independent accumulators, as TilesBF16); joined exactly.
  void pass(const Problem& p, int64_t n0, int64_t mb, bool prefetch, int32_t hi[kTileRows * kTileRows],
            int32_t lo[kTileRows * kTileRows]) const {
    const int64_t K = p.K, steps = K / kInt8TileK, W = tile_width(p.M), ldb = 4 * W, at = mb * (K / 4) * W;
    const int8_t* wb = w + n0 * K;
    const auto fetch = [&](int64_t c) {
      if (prefetch) prefetch_rows(reinterpret_cast<const char*>(wb), K, steps, c);
    };
    zero_accumulators();
    int64_t c = 0;
    for (; c + 2 <= steps; c += 2) {
      fetch(c);
      fetch(c + 1);
      _tile_loadd(4, wb + c * kInt8TileK, K);
      _tile_loadd(6, xh + at + c * 16 * W, ldb);
      _tile_loadd(7, xl + at + c * 16 * W, ldb);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbsud(2, 4, 7);
      _tile_loadd(5, wb + (c + 1) * kInt8TileK, K);
      _tile_loadd(6, xh + at + (c + 1) * 16 * W, ldb);
      _tile_loadd(7, xl + at + (c + 1) * 16 * W, ldb);
      _tile_dpbssd(1, 5, 6);
      _tile_dpbsud(3, 5, 7);
    }
    if (c < steps) {
      fetch(c);
      _tile_loadd(4, wb + c * kInt8TileK, K);
      _tile_loadd(6, xh + at + c * 16 * W, ldb);
      _tile_loadd(7, xl + at + c * 16 * W, ldb);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbsud(2, 4, 7);
    }
    alignas(64) int32_t parts[2][kTileRows * kTileRows];
    _tile_stored(0, hi, ldb);
    _tile_stored(1, parts[0], ldb);
    _tile_stored(2, lo, ldb);
    _tile_stored(3, parts[1], ldb);
    for (int64_t i = 0; i < kTileRows * W; i += 16) {
      _mm512_store_si512(hi + i, _mm512_add_epi32(_mm512_load_si512(hi + i), _mm512_load_si512(parts[0] + i)));
      _mm512_store_si512(lo + i, _mm512_add_epi32(_mm512_load_si512(lo + i), _mm512_load_si512(parts[1] + i)));
    }
  }

  // W8A8: activation block mb against weight rows n0 .. n0 + 15, k-step c into C tile c % 4 (as TilesBF16);
  // the integer sums are exact in any order.
  void pass_int8(const Problem& p, int64_t n0, int64_t mb, bool prefetch, int32_t dots[kTileRows * kTileRows]) const {
    const int64_t K = p.K, steps = K / kInt8TileK, W = tile_width(p.M), ldb = 4 * W;
    const int8_t* wb = w + n0 * K;
    const uint32_t* xb = xh + mb * (K / 4) * W;
    const auto step = [&](auto acc, int64_t c) {
      if (prefetch) prefetch_rows(reinterpret_cast<const char*>(wb), K, steps, c);
      constexpr int kAcc = decltype(acc)::value;
      if constexpr (kAcc % 2 == 0) {
        _tile_loadd(4, wb + c * kInt8TileK, K);
        _tile_loadd(6, xb + c * 16 * W, ldb);
      } else {
        _tile_loadd(5, wb + c * kInt8TileK, K);
        _tile_loadd(7, xb + c * 16 * W, ldb);
      }
      if constexpr (kAcc == 0) _tile_dpbssd(0, 4, 6);
      if constexpr (kAcc == 1) _tile_dpbssd(1, 5, 7);
      if constexpr (kAcc == 2) _tile_dpbssd(2, 4, 6);
      if constexpr (kAcc == 3) _tile_dpbssd(3, 5, 7);
    };
    using A0 = std::integral_constant<int, 0>;
    using A1 = std::integral_constant<int, 1>;
    using A2 = std::integral_constant<int, 2>;
    using A3 = std::integral_constant<int, 3>;
    zero_accumulators();
    int64_t c = 0;
    for (; c + 4 <= steps; c += 4) {
      step(A0{}, c);
      step(A1{}, c + 1);
      step(A2{}, c + 2);
      step(A3{}, c + 3);
    }
    if (c < steps) step(A0{}, c);
    if (++c < steps) step(A1{}, c);
    if (++c < steps) step(A2{}, c);
    sum_accumulators(W, dots);
  }

  void whole_block(const Problem& p, int64_t n0) const {
    alignas(64) int32_t hi[kTileRows * kTileRows], lo[kTileRows * kTileRows];
    const __m512 s = _mm512_loadu_ps(scales + n0);
    const int64_t W = tile_width(p.M);
    for (int64_t mb = 0; mb * W < p.M; ++mb) {
      if (xl == nullptr) {
        pass_int8(p, n0, mb, mb == 0, hi);
        // Each dot is below 2^31 (K < 2^31 / 127^2) and converts to fp32 as the register tiles' int64 sum does.
        for (int64_t i = 0; i < W && mb * W + i < p.M; ++i)
          put_tile_row(p, n0, mb * W + i,
                       _mm512_mul_ps(_mm512_cvtepi32_ps(tile_column(hi, W, i)), _mm512_set1_ps(xs[mb * W + i])), s);
        continue;
      }
      pass(p, n0, mb, mb == 0, hi, lo);
      for (int64_t i = 0; i < W && mb * W + i < p.M; ++i) {
        const int64_t m = mb * W + i;
        const __m512i h = tile_column(hi, W, i), l = tile_column(lo, W, i);
        // The exact dot 256 hi + lo in int64, rounded once to fp32 as the register tiles' int64 sums are.
        const auto dot = [](__m256i h8, __m256i l8) {
          return _mm512_cvtepi64_ps(
              _mm512_add_epi64(_mm512_slli_epi64(_mm512_cvtepi32_epi64(h8), 8), _mm512_cvtepi32_epi64(l8)));
        };
        const __m512 d = _mm512_insertf32x8(
            _mm512_castps256_ps512(dot(_mm512_castsi512_si256(h), _mm512_castsi512_si256(l))),
            dot(_mm512_extracti64x4_epi64(h, 1), _mm512_extracti64x4_epi64(l, 1)), 1);
        put_tile_row(p, n0, m, _mm512_mul_ps(d, _mm512_set1_ps(xs[m])), s);
      }
    }
  }
};

// int4 weights in steps of more than kInt4DirectMaxRows rows: each 16-row block dequantized into this thread's
// bf16 tile (as Int4Tile rounds it) and multiplied there as a bf16 block, the activations rounded to bf16. Up
// to 16 rows (one activation tile) the block goes one quantization group at a time, each group's tile steps
// right after its dequantization, so the tile stays in L1 and the vector and tile units take turns:
// `scripts/bench_kernels.py ab` on the int4 engine's decoder layers at 16 rows, 9.3 -> 8.2 ms against the
// whole block first, then its tile steps (as longer steps still go).
struct TilesInt4 {
  static constexpr int kBlockRows = kTileRows;
  const uint8_t* w;
  const float* scales;
  const float* zeros;
  int64_t gs, G;
  bf16* tiles;  // [threads, 16, K]: each thread's tile is tiles + thread * tile_stride
  int64_t tile_stride;
  TilesBF16 activations;  // the packed activation rows (its w unused)

  static int64_t tile_floats(int64_t K) { return kTileRows * K / 2 + kAlignSlack; }

  static TilesInt4 prepare(const uint8_t* w, const float* scales, const float* zeros, int64_t gs, const Problem& p,
                           float* tiles, int64_t tile_stride, float* scratch) {
    return TilesInt4{w,           scales, zeros, gs, int4_groups(p.K, gs), reinterpret_cast<bf16*>(line_aligned(tiles)),
                     tile_stride, TilesBF16::prepare(nullptr, p, scratch)};
  }

  void whole_block(const Problem& p, int64_t n0) const {
    const int64_t K = p.K, ldw = K / 2;
    bf16* tile = tiles + omp_get_thread_num() * tile_stride;
    if (p.M <= kTileRows) {
      // One group at a time: its 16 rows dequantized (a few KB, in L1) between the tile steps over them.
      zero_accumulators();
      for (int64_t g0 = 0; g0 < K; g0 += gs) {
        const int64_t g1 = g0 + gs < K ? g0 + gs : K, width = g1 - g0;
        for (int r = 0; r < kTileRows; ++r) {
          const int64_t n = n0 + r;
          dequant_int4_row<true>(w + n * ldw + g0 / 2, scales + n * G + g0 / gs, zeros + n * G + g0 / gs, width,
                                 gs, w + (n + kTileRows) * ldw + g0 / 2, tile + r * width);
        }
        for (int64_t k = g0; k < g1; k += kBf16TileK) activations.step(p, 0, k / kBf16TileK, tile + (k - g0), 2 * width);
      }
      alignas(64) float out[kTileRows * kTileRows];
      sum_accumulators(tile_width(p.M), out);
      TilesBF16::put_rows(p, n0, 0, out);
      return;
    }
    for (int r = 0; r < kTileRows; ++r)
      dequant_int4_row<true>(w + (n0 + r) * ldw, scales + (n0 + r) * G, zeros + (n0 + r) * G, K, gs,
                             w + (n0 + kTileRows + r) * ldw, tile + r * K);
    activations.block_rows(p, n0, tile, false);
  }
};
#endif

}  // namespace llmp
