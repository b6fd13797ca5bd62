// Blocks of the fused dequantize + dot-product kernels, shared by qgemv.cpp (one op per linear layer) and
// decoder.cpp (a decoder layer's linears in one parallel region). See qgemv.cpp for the layouts.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <cmath>
#include <type_traits>

#include "prefetch.h"

namespace llmp {

// A bfloat16 bit pattern: the upper half of an fp32.
struct bf16 {
  uint16_t bits;
};

inline float to_f32(float v) { return v; }
inline float to_f32(bf16 v) {
  const uint32_t b = uint32_t{v.bits} << 16;
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}


inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const bf16* p) {  // widening is exact
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Every dot product runs over k-steps of kStep weights. AVX-512 builds take 16 (two ymm halves or one zmm);
// a row's products land in the same lane in either form, and the two halves add as the zmm's halves do before
// one horizontal sum, so both forms give the same bits: a row's result never depends on which rows share its
// step. The zmm form (Wide) runs steps of many rows, where it has the work to fill 512-bit units; the ymm form
// (Narrow) runs steps of few rows, where 512-bit ops slowed some CPUs (Zen 4 splits them in two).
#if defined(__AVX512F__)
constexpr int kStep = 16;
#else
constexpr int kStep = 8;
#endif

struct Narrow {
  __m256 h[kStep / 8];
};

inline void vzero(Narrow& a) {
  #pragma GCC unroll 16
  for (auto& h : a.h) h = _mm256_setzero_ps();
}
template <typename T>
inline void vload(Narrow& a, const T* p) {
  #pragma GCC unroll 16
  for (int i = 0; i < kStep / 8; ++i) a.h[i] = load8(p + 8 * i);
}
inline void vdot(const Narrow& w, const Narrow& x, Narrow& acc) {
  #pragma GCC unroll 16
  for (int i = 0; i < kStep / 8; ++i) acc.h[i] = _mm256_fmadd_ps(w.h[i], x.h[i], acc.h[i]);
}
inline float vsum(const Narrow& a) {
  __m256 s = a.h[0];
  #pragma GCC unroll 16
  for (int i = 1; i < kStep / 8; ++i) s = _mm256_add_ps(s, a.h[i]);
  return hsum(s);
}

#if defined(__AVX512F__)
struct Wide {
  __m512 v;
};

inline void vzero(Wide& a) { a.v = _mm512_setzero_ps(); }
inline void vload(Wide& a, const float* p) { a.v = _mm512_loadu_ps(p); }
inline void vload(Wide& a, const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a.v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vdot(const Wide& w, const Wide& x, Wide& acc) { acc.v = _mm512_fmadd_ps(w.v, x.v, acc.v); }
inline float vsum(const Wide& a) {
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1)));
}

// Horizontal sums of 16 zmm accumulators at once, lane i of the result holding a[i]'s: each addition pairs the
// lanes vsum pairs (i and i+8, then i+4, i+2, i+1), so every sum has vsum's bits; 46 vector ops where 16 vsums
// take 128. A tile of 4 x 6 accumulators over K = 576 bf16 weights does 18 dpbf16 per output, so summing them
// one by one was a third of its work. kInt: the lanes are int32 (WideInt), else fp32.
template <bool kInt>
inline __m512 lane_sums16(const __m512 a[16]) {
  const auto add = [](__m512 x, __m512 y) {
    if constexpr (kInt)
      return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_castps_si512(y)));
    else
      return _mm512_add_ps(x, y);
  };
  __m512 b[8], c[4], d[2];
  #pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // 256-bit half h: accumulator 2i + h, after its lanes i + (i+8)
    b[i] = add(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  #pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // 128-bit lane q: accumulator 4i + q, after i + (i+4)
    c[i] = add(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  #pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // lane q: elements 0-1 accumulator 8i + q, 2-3 accumulator 8i + 4 + q
    d[i] = add(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
               _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane q, element j: accumulator 4j + q
  const __m512 e = add(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}
#endif

// out[r][m] = vsum(acc[r][m]) for a tile of any form (defined below, after the integer forms).
template <int NB, int MB, typename V, typename T>
inline void tile_sums(const V acc[NB][MB], T out[NB][MB]);

// fp32 weights in tiles of several activation rows prefetch kFarAheadBlocks blocks ahead into L2, not one block
// ahead into L1: such a block takes long enough to multiply that the L1 prefetches (a few line-fill buffers,
// each held for a DRAM round trip) left the weight stream behind. fp32 decoder layers on an AMX Xeon (2 threads,
// `scripts/bench_kernels.py ab`), L1 one ahead / L2 three ahead: 2 rows 22.1 / 20.7 ms, 4 rows 23.0 / 19.5,
// 16 rows 41.3 / 35.0. One row (bound by the stream itself) was 2-5 % slower that way; bf16 weights without
// AMX ran alike and int8 weights 10-20 % slower at 4-8 rows, so those keep L1 one block ahead.
constexpr int kFarPrefetchMinRows = 2;
constexpr int64_t kFarAheadBlocks = 3;
// Whether every weight stream (every format, every row count) prefetches far ahead into L2. On Zen 4 (2 threads,
// `scripts/bench_kernels.py ab`, SmolLM2-135M decoder layers, near / far) that ran faster throughout: fp32 one row
// 13.11 / 10.48 ms; bf16 1 row 6.27 / 5.37, 2 rows 6.78 / 5.03, 4 rows 9.10 / 7.10, 8 rows 10.41 / 7.23, 16 rows
// 13.79 / 11.17; int8 1 row 3.77 / 3.38, 4 rows 5.01 / 4.05, 16 rows 12.04 / 11.79. On the AMX Xeon above it was
// slower where the two differ. Results are the same bits either way: the runner times a one- and a four-row step
// both ways at load and sets this (set_far_prefetch).
inline std::atomic<bool> far_prefetch{false};

// A weight vector that MB > 1 activation rows multiply is read into a register once. GCC 12 instead folded the
// read into each of its FMAs as a memory operand in the AVX2 build's 4 x 2 fp32 tiles: 10 loads for 8 FMAs a
// k-step (7 for 12 in the 4 x 3 tiles), so a 2-row tile took as long as a 3-row one. The empty asm claims to
// change the register, which leaves GCC nothing to re-read. fp32 layers of 4 x 576 weights in L1, one thread of
// a Zen 3, GFLOP/s before / after: 2 rows 35.7-39.9 / 55.3-58.3, 4 rows 33.4-38.8 / 53.6-54.9, 16 rows
// 52.5-65.6 / 69.6-69.8; 3 and 6 rows alike. All decoder layers at 16 rows (`scripts/bench_kernels.py ab`): fp32
// 1.08x, int4 1.11x (its multi-row tiles are fp32 on AVX2). AVX-512 builds (not measured) keep GCC's choice.
template <typename O>
inline void load_once(O&) {}
#if !defined(__AVX512F__)
inline void load_once(Narrow& v) {
  #pragma GCC unroll 16
  for (auto& h : v.h) asm("" : "+x"(h));
}
#endif

// The register tile every format shares: over the k-steps of `step` elements in [k0, k1), MB activation vectors
// (form O, rows of x with stride ldx) and one weight vector at a time (rows of w with stride ldw), multiplied
// into acc[NB][MB] by vdot; the weights from `next` (where the following block starts; a block that is no
// stream passes its own w) are streamed into cache a step at a time, further ahead for many rows (above). Where
// `shares` tiles of activation rows take the same block in turn (sliced_tiles), tile `share` streams the k-steps
// s with s % shares == share: each line is fetched once, and the stream runs through the block's whole
// computation instead of all of it in the block's first tile.
// NOTE: each (row, activation) dot is summed in the same order whatever the form, NB and MB are.
template <typename O, int NB, int MB, typename A, typename TX, typename TW>
inline void tile_steps(const TX* x, int64_t ldx, const TW* w, int64_t ldw, int64_t k0, int64_t k1, int step,
                       const void* next, A acc[NB][MB], int64_t share = 0, int64_t shares = 1) {
  const bool far = (std::is_same_v<TW, float> && MB >= kFarPrefetchMinRows) ||
                   far_prefetch.load(std::memory_order_relaxed);
  // An address, not a pointer: the far lines may lie past the end of the weights (a prefetch never faults).
  uintptr_t pf = reinterpret_cast<uintptr_t>(next);
  if (far) pf += (kFarAheadBlocks - 1) * (pf - reinterpret_cast<uintptr_t>(w));
  int64_t turn = k0 / step % shares;  // whose share the k-step's lines are
  for (int64_t k = k0; k + step <= k1; k += step) {
    if (turn == share)
      for (int j = 0; j < NB * step * int(sizeof(TW)); j += 64) {
        const char* line = reinterpret_cast<const char*>(pf + k * NB * sizeof(TW) + j);
        if (far)
          prefetch_line<1>(line);
        else
          prefetch_line<0>(line);
      }
    if (++turn == shares) turn = 0;
    O xv[MB];
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) vload(xv[m], x + m * ldx + k);
    #pragma GCC unroll 16
    for (int r = 0; r < NB; ++r) {
      O wv;
      vload(wv, w + r * ldw + k);
      if constexpr (MB > 1) load_once(wv);
      #pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) vdot(wv, xv[m], acc[r][m]);
    }
  }
}

template <typename A, int NB, int MB>
inline void zero_tile(A acc[NB][MB]) {
  #pragma GCC unroll 16
  for (int r = 0; r < NB; ++r)
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) vzero(acc[r][m]);
}

// The k in [t0, K) past a tile's last whole k-step, one by one, into its finished sums.
// NOTE: an explicit fma. GCC contracts `out += w * x` into one in some of a kernel's instantiations and not in
// others (C++ compiles with -ffp-contract=fast), so a row's result changed with the tile shape it ran in.
template <int NB, int MB, typename TX, typename TW>
inline void tail_dots(const TX* x, int64_t ldx, const TW* w, int64_t ldw, int64_t t0, int64_t K,
                      float out[NB][MB]) {
  for (int64_t t = t0; t < K; ++t)
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m)
        out[r][m] = std::fma(to_f32(w[r * ldw + t]), to_f32(x[m * ldx + t]), out[r][m]);
}

// The finished dots of a dense tile: its accumulators' sums, then the k past the last whole k-step.
template <int NB, int MB, typename V, typename T>
inline void dense_sums(const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, const V acc[NB][MB],
                       float out[NB][MB]) {
  tile_sums<NB, MB>(acc, out);
  tail_dots<NB, MB>(x, ldx, w, ldw, K / kStep * kStep, K, out);
}

// Dot products of NB weight rows (fp32 or bf16, row stride ldw) with MB activation rows (row stride ldx),
// in vector form V (Narrow or Wide, see kStep). `next` is where the following block's weights start.
template <typename V, typename T, int NB, int MB>
inline void dense_block(const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, const void* next,
                        float out[NB][MB]) {
  V acc[NB][MB];
  zero_tile<V, NB, MB>(acc);
  tile_steps<V, NB, MB>(x, ldx, w, ldw, 0, K, kStep, next, acc);
  dense_sums<NB, MB>(x, ldx, w, ldw, K, acc, out);
}

// bf16 weights take bf16 activations: each call rounds its activation rows once (to nearest even, like
// torch's .bfloat16()) and the products accumulate in fp32. With AVX512_BF16 a dpbf16 instruction does 16
// multiply-adds where an fp32 FMA does 8; elsewhere the rounded activations stay fp32 and the weights are
// widened exactly, so both builds compute the same products (summed in another order).
inline uint32_t bf16_round_bits(uint32_t b) { return b + 0x7FFFu + ((b >> 16) & 1u); }

// A float rounded to the nearest bf16 (ties to even), kept as a float: what dpbf16 multiplies, for builds
// without it.
inline float round_bf16(float v) {
  uint32_t b;
  memcpy(&b, &v, sizeof b);
  b = bf16_round_bits(b) & 0xFFFF0000u;
  memcpy(&v, &b, sizeof b);
  return v;
}
inline __m256 round_bf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), odd);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#if defined(__AVX512F__)
inline __m512 round_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif

#if defined(__AVX512BF16__)
using Bf16Activation = bf16;

// x [M, K] fp32 (row stride ldx) -> xb [M, K] bf16.
inline void round_rows_bf16(const float* x, int64_t M, int64_t K, int64_t ldx, bf16* xb) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * ldx;
    bf16* o = xb + m * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + k), (__m128i)_mm256_cvtneps_pbh(_mm256_loadu_ps(xm + k)));
    for (; k < K; ++k) {
      uint32_t b;
      memcpy(&b, xm + k, sizeof b);
      o[k].bits = static_cast<uint16_t>(bf16_round_bits(b) >> 16);
    }
  }
}

// dpbf16 forms of Narrow and Wide: a k-step holds 2 * kStep bf16 values, each lane summing a pair per op.
struct NarrowBf16 {
  __m256bh h[2];
};
struct WideBf16 {
  __m512bh v;
};
template <typename V>
struct Bf16Form;
template <>
struct Bf16Form<Narrow> {
  using type = NarrowBf16;
};
template <>
struct Bf16Form<Wide> {
  using type = WideBf16;
};

inline void vload(NarrowBf16& a, const bf16* p) {
  #pragma GCC unroll 16
  for (int i = 0; i < 2; ++i)
    a.h[i] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * i));
}
inline void vdot(const NarrowBf16& w, const NarrowBf16& x, Narrow& acc) {
  #pragma GCC unroll 16
  for (int i = 0; i < 2; ++i) acc.h[i] = _mm256_dpbf16_ps(acc.h[i], w.h[i], x.h[i]);
}
inline void vload(WideBf16& a, const bf16* p) {
  a.v = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}
inline void vdot(const WideBf16& w, const WideBf16& x, Wide& acc) { acc.v = _mm512_dpbf16_ps(acc.v, w.v, x.v); }

// NarrowBf16's products by FMAs, with dpbf16's bits: a lane takes its odd element's product and then its even
// one's, each rounded once (a product of two bf16 is exact in fp32), denormals in and out taken as zero, as the
// instruction does (Intel SDM, VDPBF16PS) under FlushDenormals below. Checked on Zen 4 against the instruction
// over 3.2 million lanes with operands down in the denormal range: no bit differed. Steps of up to
// kBf16FmaMaxRows rows run it, since on Zen 4 they were faster so: all bf16 SmolLM2-135M decoder layers, 2
// threads (`scripts/bench_kernels.py ab`, fastest of 4 rounds), dpbf16 / FMAs: 1 row 6.50 / 5.44 ms, 2 rows
// 6.69 / 5.80, 3 rows 7.04 / 7.27. The cause is not settled: in a loop there, dpbf16 issued as fast as FMAs and
// had less latency than the two dependent FMAs it stands for.
struct NarrowBf16Fma {
  __m256 odd[2], even[2];
};
inline void vload(NarrowBf16Fma& a, const bf16* p) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  #pragma GCC unroll 16
  for (int i = 0; i < 2; ++i) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * i));
    a.odd[i] = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
    a.even[i] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  }
}
inline void vdot(const NarrowBf16Fma& w, const NarrowBf16Fma& x, Narrow& acc) {
  #pragma GCC unroll 16
  for (int i = 0; i < 2; ++i)
    acc.h[i] = _mm256_fmadd_ps(w.even[i], x.even[i], _mm256_fmadd_ps(w.odd[i], x.odd[i], acc.h[i]));
}
constexpr int kBf16FmaMaxRows = 2;

// MXCSR's denormals-are-zero and flush-to-zero for this thread while in scope.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kDaz | kFtz); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  static constexpr unsigned kDaz = 0x0040, kFtz = 0x8000;
  unsigned saved_;
};

// Dot products of NB bf16 weight rows with MB bf16 activation rows (row stride K for both), as dense_block.
template <typename V, int NB, int MB>
inline void bf16_block(const bf16* x, const bf16* w, int64_t K, const void* next, float out[NB][MB]) {
  constexpr int step = 2 * kStep;
  V acc[NB][MB];
  zero_tile<V, NB, MB>(acc);
  if constexpr (std::is_same_v<V, Narrow> && MB <= kBf16FmaMaxRows) {
    const FlushDenormals flush;
    tile_steps<NarrowBf16Fma, NB, MB>(x, K, w, K, 0, K, step, next, acc);
  } else {
    tile_steps<typename Bf16Form<V>::type, NB, MB>(x, K, w, K, 0, K, step, next, acc);
  }
  tile_sums<NB, MB>(acc, out);
  tail_dots<NB, MB>(x, K, w, K, K / step * step, K, out);
}
#else
using Bf16Activation = float;

// x [M, K] fp32 (row stride ldx) -> xr [M, K] fp32 holding the bf16-rounded values.
inline void round_rows_bf16(const float* x, int64_t M, int64_t K, int64_t ldx, float* xr) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * ldx;
    float* o = xr + m * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(o + k, round_bf16(_mm256_loadu_ps(xm + k)));
    for (; k < K; ++k) o[k] = round_bf16(xm[k]);
  }
}
#endif

// int8 weights take int16 activations: each call rounds its activation rows once to 16-bit fixed point, one
// scale per row (amax / kActQMax, the nearest level by IEEE division and round-half-even like torch.round),
// and the products accumulate exactly in int32 lanes. With AVX512_VNNI one dpwssd does 32 multiply-adds
// where the fp32 path converted 16 weights in two ops and then did 16 FMAs; without it, madd + add do the
// same in two. Integer sums make a row's dot the same bits in every vector form, tile and ISA.
// NOTE: 15 bits + sign leave each product at most 2,097,024 in magnitude, so any 1024 of them sum below 2^31:
// a span of kActSpan k is summed in int32, in lanes and then across them, and the spans into int64.
constexpr float kActQMax = 16383.0f;
constexpr int64_t kActSpan = 1024;
// W8A8 layers (SmoothQuant's per-token activations) round each row to int8 levels instead, the same way with
// this bound: the same integer dots on levels that fit a byte, which AMX tiles multiply in one pass.
constexpr float kW8A8QMax = 127.0f;

inline float act_scale(float amax, float qmax) { return amax > 0.0f ? amax / qmax : 1.0f; }
// The largest activation level of an int8 layer: W8A8 (`int8_activations`) or int8_wo's int16 levels.
inline float act_qmax(bool int8_activations) { return int8_activations ? kW8A8QMax : kActQMax; }

// x [M, K] fp32 (row stride ldx) -> xq [M, K] int16 levels in [-qmax, qmax] and their scales [M].
inline void quantize_rows_int16(const float* x, int64_t M, int64_t K, int64_t ldx, int16_t* xq, float* scales,
                                float qmax = kActQMax) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * ldx;
    int16_t* o = xq + m * K;
    __m256 vmax = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(xm + k), abs_mask));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    for (; k < K; ++k) amax = fabsf(xm[k]) > amax ? fabsf(xm[k]) : amax;
    const float s = act_scale(amax, qmax);
    scales[m] = s;
    const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
    for (k = 0; k + 8 <= K; k += 8) {
      const __m256 q = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(xm + k), sv), lo), hi);
      const __m256i i = _mm256_cvtps_epi32(q);  // round half to even (MXCSR default)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + k),
                       _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
    }
    for (; k < K; ++k) {
      const float q = nearbyintf(xm[k] / s);
      o[k] = static_cast<int16_t>(q > qmax ? qmax : q < -qmax ? -qmax : q);
    }
  }
}

// Integer forms of Narrow and Wide: a k-step holds 2 * kStep int16 values, each int32 lane summing a pair.
struct NarrowInt {
  __m256i h[kStep / 8];
};
template <typename V>
struct IntForm;
template <>
struct IntForm<Narrow> {
  using type = NarrowInt;
};

inline void vzero(NarrowInt& a) {
  #pragma GCC unroll 16
  for (auto& h : a.h) h = _mm256_setzero_si256();
}
inline void vload(NarrowInt& a, const int16_t* p) {
  #pragma GCC unroll 16
  for (int i = 0; i < kStep / 8; ++i) a.h[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * i));
}
inline void vload(NarrowInt& a, const int8_t* p) {
  #pragma GCC unroll 16
  for (int i = 0; i < kStep / 8; ++i)
    a.h[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i)));
}
// acc += the products of w's and x's int16 pairs, summed per int32 lane: dpwssd with AVX512_VNNI, else madd + add.
// NOTE: written as asm because GCC 12 spilled every accumulator of the intrinsic's form to the stack (1.5-2x
// slower blocks); the asm's tied operand keeps them in registers.
inline void dot_pairs(__m256i& acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__)
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
#else
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}
#if defined(__AVX512F__)
inline void dot_pairs(__m512i& acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
#else
  acc = _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
#endif

inline void vdot(const NarrowInt& w, const NarrowInt& x, NarrowInt& acc) {
  #pragma GCC unroll 16
  for (int i = 0; i < kStep / 8; ++i) dot_pairs(acc.h[i], w.h[i], x.h[i]);
}
inline int32_t vsum(const NarrowInt& a) {
  __m256i s = a.h[0];
  #pragma GCC unroll 16
  for (int i = 1; i < kStep / 8; ++i) s = _mm256_add_epi32(s, a.h[i]);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1))));
}

#if defined(__AVX512F__)
struct WideInt {
  __m512i v;
};
template <>
struct IntForm<Wide> {
  using type = WideInt;
};
inline void vzero(WideInt& a) { a.v = _mm512_setzero_si512(); }
inline void vload(WideInt& a, const int16_t* p) { a.v = _mm512_loadu_si512(p); }
inline void vload(WideInt& a, const int8_t* p) {
  a.v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vdot(const WideInt& w, const WideInt& x, WideInt& acc) { dot_pairs(acc.v, w.v, x.v); }
inline int32_t vsum(const WideInt& a) { return _mm512_reduce_add_epi32(a.v); }
// A Wide or WideInt accumulator's 512 bits, as lane_sums16 takes them.
inline __m512 lanes(const Wide& a) { return a.v; }
inline __m512 lanes(const WideInt& a) { return _mm512_castsi512_ps(a.v); }
#endif

// Wide and WideInt tiles sum 16 accumulators at a time (a few left over go one by one).
template <int NB, int MB, typename V, typename T>
inline void tile_sums(const V acc[NB][MB], T out[NB][MB]) {
  constexpr int n = NB * MB;
  int i = 0;
#if defined(__AVX512F__)
  constexpr bool kInt = std::is_same_v<V, WideInt>;
  if constexpr (kInt || std::is_same_v<V, Wide>) {
    #pragma GCC unroll 4
    for (; n - i > 4; i += 16) {
      __m512 a[16];
      #pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) a[j] = i + j < n ? lanes(acc[(i + j) / MB][(i + j) % MB]) : _mm512_setzero_ps();
      alignas(64) T sums[16];
      _mm512_store_ps(reinterpret_cast<float*>(sums), lane_sums16<kInt>(a));
      #pragma GCC unroll 16
      for (int j = 0; j < 16 && i + j < n; ++j) out[(i + j) / MB][(i + j) % MB] = sums[j];
    }
  }
#endif
  #pragma GCC unroll 16
  for (; i < n; ++i) out[i / MB][i % MB] = vsum(acc[i / MB][i % MB]);
}

// Exact integer dots of NB int8 weight rows (row stride K) with MB integer activation rows (row stride K): k-steps
// of `step` loaded as form O into int32 accumulators A, folded into int64 every `span` k (before any lane can
// overflow), the k past the last whole step one by one.
template <typename O, typename A, int NB, int MB, typename TX>
inline void exact_dots(const TX* x, const int8_t* w, int64_t K, int step, int64_t span, const void* next,
                       int64_t out[NB][MB]) {
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) out[r][m] = 0;
  const int64_t vec_end = K / step * step;
  for (int64_t k0 = 0; k0 < vec_end; k0 += span) {
    A acc[NB][MB];
    zero_tile<A, NB, MB>(acc);
    tile_steps<O, NB, MB>(x, K, w, K, k0, k0 + span < vec_end ? k0 + span : vec_end, step, next, acc);
    int32_t sums[NB][MB];
    tile_sums<NB, MB>(acc, sums);
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m) out[r][m] += sums[r][m];
  }
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m)
      for (int64_t t = vec_end; t < K; ++t) out[r][m] += int64_t{w[r * K + t]} * x[m * K + t];
}

// Exact integer dots of NB int8 weight rows with MB int16 activation rows.
template <typename V, int NB, int MB>
inline void int8_block(const int16_t* x, const int8_t* w, int64_t K, const void* next, int64_t out[NB][MB]) {
  using I = typename IntForm<V>::type;
  exact_dots<I, I, NB, MB>(x, w, K, 2 * kStep, kActSpan, next, out);
}

struct Problem {
  const float* x;
  int64_t M, K, ldx, N;
  const float* bias;  // [N] or null
  float* y;           // [M, N] with row stride ldy
  int64_t ldy;
  bool accumulate;  // y += result (a residual add) instead of y = result
};

// int4 steps of few rows (decode) take integer dots, like int8 layers: the activation rows rounded to int16
// levels (quantize_rows_int16), the packed bytes zero-extended to 16-bit words, each word's low nibble (the
// even column's level) masked and its high nibble (the odd column's) shifted down, and the activations
// de-interleaved to match (a chunk of C weights: xp[c + j] = xq[c + 2j], xp[c + C/2 + j] = xq[c + 2j + 1]),
// so one madd / dpwssd takes C/2 weights of a row with no shuffles. Each group's int32 sums (a lane holds at
// most gs/8 products below 2^18 each) are converted and folded into fp32 with the group's scale; zero points
// enter through the per-group sums of the activation levels: y = xs * sum_g s_g (sum q xq - z_g sum xq).
// A row's result is the same bits whatever rows share its block. C = 64 (zmm) where the group size allows it
// on AVX-512 builds, else 32 (ymm).
constexpr int kChunk = 64;
// Up to this many activation rows the integer dots beat dequantizing tiles; steps of more rows multiply
// bf16-rounded values (Int4Tile). primitives.INT4_DIRECT_MAX_ROWS is the same number.
constexpr int64_t kInt4DirectMaxRows = 4;

// Whether the int4 kernels can walk a layer: groups are whole 32-weight chunks (size 32 or a multiple of
// kChunk), and two weights share a byte.
inline bool int4_shape_ok(int64_t gs, int64_t K) {
  return gs > 0 && (gs == 32 || gs % kChunk == 0) && K % 2 == 0;
}

// Groups per row of K weights (the last one may be short).
inline int64_t int4_groups(int64_t K, int64_t gs) { return (K + gs - 1) / gs; }

inline int nibble_level(const uint8_t* row, int64_t k) { return (row[k >> 1] >> ((k & 1) * 4)) & 0x0F; }
inline float nibble(const uint8_t* row, int64_t k) { return static_cast<float>(nibble_level(row, k)); }

// Whether the integer dots run 64-weight zmm chunks for group size gs.
inline bool int4_dot_wide(int64_t gs) {
#if defined(__AVX512F__)
  return gs % kChunk == 0;
#else
  (void)gs;
  return false;
#endif
}

struct Int4Ymm {  // 16 packed bytes -> 16 words: 32 weights a step
  using I = __m256i;
  using F = __m256;
  static constexpr int kWeights = 32;
  static I words(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I load(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I low(I w) { return _mm256_and_si256(w, _mm256_set1_epi16(0x0F)); }
  static I high(I w) { return _mm256_srli_epi16(w, 4); }
  static I izero() { return _mm256_setzero_si256(); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fold(F acc, I sums, float s) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(s), acc);
  }
  static float sum(F v) { return hsum(v); }
};

#if defined(__AVX512F__)
struct Int4Zmm {  // 32 packed bytes -> 32 words: 64 weights a step
  using I = __m512i;
  using F = __m512;
  static constexpr int kWeights = 64;
  static I words(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I load(const int16_t* p) { return _mm512_loadu_si512(p); }
  static I low(I w) { return _mm512_and_si512(w, _mm512_set1_epi16(0x0F)); }
  static I high(I w) { return _mm512_srli_epi16(w, 4); }
  static I izero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fold(F acc, I sums, float s) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(s), acc);
  }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
};
#endif

// Weight rows per pass of int4_dot_rows for MB activation rows: an fp32 and an int32 accumulator per pair,
// with room left for the weight words and an activation vector (GCC spills otherwise).
template <int NB, int MB>
constexpr int int4_dot_row_block() {
#if defined(__AVX512F__)
  constexpr int budget = 26;
#else
  constexpr int budget = 11;
#endif
  return NB >= 4 && 2 * 4 * MB <= budget ? 4 : NB >= 2 && 2 * 2 * MB <= budget ? 2 : 1;
}

// The group-folded sums over the whole chunks (before K / L::kWeights * L::kWeights) of RB weight rows (row
// stride ldw, scales row stride G) with MB de-interleaved activation rows (row stride K), into sums[RB][MB].
template <typename L, int RB, int MB>
inline void int4_dot_rows(const int16_t* xp, int64_t K, const uint8_t* w, int64_t ldw, const float* scales,
                          int64_t G, int64_t gs, const char* next, float sums[][MB]) {
  using I = typename L::I;
  using F = typename L::F;
  constexpr int half = L::kWeights / 2;
  F acc[RB][MB];
  for (int r = 0; r < RB; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = L::fzero();
  const int64_t vec_end = K / L::kWeights * L::kWeights;
  for (int64_t g = 0; g < G && g * gs < vec_end; ++g) {
    const int64_t k1 = (g + 1) * gs < vec_end ? (g + 1) * gs : vec_end;
    I part[RB][MB];
    for (int r = 0; r < RB; ++r)
      for (int m = 0; m < MB; ++m) part[r][m] = L::izero();
    for (int64_t k = g * gs; k < k1; k += L::kWeights) {
      #pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        prefetch_line<0>(next + r * ldw + k / 2);
        const I words = L::words(w + r * ldw + k / 2);
        const I even = L::low(words), odd = L::high(words);
        #pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
          dot_pairs(part[r][m], even, L::load(xp + m * K + k));
          dot_pairs(part[r][m], odd, L::load(xp + m * K + k + half));
        }
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = L::fold(acc[r][m], part[r][m], scales[r * G + g]);
  }
  for (int r = 0; r < RB; ++r)
    for (int m = 0; m < MB; ++m) sums[r][m] = L::sum(acc[r][m]);
}

// NB weight rows (from n0) against MB activation rows of an Int4Dot problem, lane form L.
template <typename L, int NB, int MB>
inline void int4_dot_block(const Problem& p, const uint8_t* w, const float* scales, const float* zeros,
                           const int16_t* xp, const float* xs, const float* xsum, int64_t gs, int64_t G,
                           int64_t n0, int64_t m0, float out[NB][MB]) {
  constexpr int RB = int4_dot_row_block<NB, MB>();
  const int64_t K = p.K, ldw = K / 2, vec_end = K / L::kWeights * L::kWeights;
  const int16_t* x = xp + m0 * K;
  const char* next = reinterpret_cast<const char*>(w + (n0 + NB) * ldw);
  for (int r0 = 0; r0 < NB; r0 += RB) {
    float sums[RB][MB];
    int4_dot_rows<L, RB, MB>(x, K, w + (n0 + r0) * ldw, ldw, scales + (n0 + r0) * G, G, gs, next + r0 * ldw, sums);
    for (int r = 0; r < RB; ++r) {
      const uint8_t* row = w + (n0 + r0 + r) * ldw;
      const float* s = scales + (n0 + r0 + r) * G;
      const float* z = zeros + (n0 + r0 + r) * G;
      for (int m = 0; m < MB; ++m) {
        float y = sums[r][m];
        if (vec_end < K) {  // the last group's columns past the last whole chunk (stored in order)
          int64_t tail = 0;
          for (int64_t k = vec_end; k < K; ++k) tail += int64_t{nibble_level(row, k)} * x[m * K + k];
          y += s[vec_end / gs] * static_cast<float>(tail);
        }
        float zero_terms = 0.0f;
        for (int64_t g = 0; g < G; ++g) zero_terms += s[g] * z[g] * xsum[(m0 + m) * G + g];
        out[r0 + r][m] = xs[m0 + m] * (y - zero_terms);
      }
    }
  }
}

// Few activation rows (decode): the integer dots above. `xp`, `xs` and `xsum` come from
// prepare_int4_dot_activations (this thread's copy in the decoder).
struct Int4Dot {
  const uint8_t* w;
  const float* scales;
  const float* zeros;
  const int16_t* xp;  // [M, K] activation levels, de-interleaved per chunk
  const float* xs;    // [M] their scales
  const float* xsum;  // [M, G] per group sums of the levels
  int64_t gs, G;
  template <int NB>
  void prepare(const Problem&, int64_t) const {}
  template <typename V, int NB, int MB>
  void block(const Problem& p, int64_t n0, int64_t m0, float out[NB][MB]) const {
#if defined(__AVX512F__)
    if (int4_dot_wide(gs)) {
      int4_dot_block<Int4Zmm, NB, MB>(p, w, scales, zeros, xp, xs, xsum, gs, G, n0, m0, out);
      return;
    }
#endif
    int4_dot_block<Int4Ymm, NB, MB>(p, w, scales, zeros, xp, xs, xsum, gs, G, n0, m0, out);
  }
  float scale(int64_t) const { return 1.0f; }
};

// Floats of scratch the Int4Dot activations of M rows take (prepare_int4_dot_activations).
inline int64_t int4_dot_activation_floats(int64_t M, int64_t K, int64_t G) { return M + M * G + M * K + 1; }

// p's rows -> their int16 levels de-interleaved per chunk (the columns past the last whole chunk in order),
// their scales and per-group level sums, in `scratch` (int4_dot_activation_floats); returns the Int4Dot.
inline Int4Dot prepare_int4_dot_activations(const Problem& p, const uint8_t* w, const float* scales,
                                            const float* zeros, int64_t gs, int64_t G, float* scratch) {
  const int64_t M = p.M, K = p.K;
  float* xs = scratch;
  float* xsum = xs + M;
  auto* xq = reinterpret_cast<int16_t*>(xsum + M * G);
  int16_t* xp = xq + M * K;
  quantize_rows_int16(p.x, M, K, p.ldx, xq, xs);
  const int64_t C = int4_dot_wide(gs) ? kChunk : 32, vec_end = K / C * C;
  for (int64_t m = 0; m < M; ++m) {
    const int16_t* q = xq + m * K;
    int16_t* o = xp + m * K;
    for (int64_t c = 0; c < vec_end; c += C)
      for (int64_t j = 0; j < C / 2; ++j) {
        o[c + j] = q[c + 2 * j];
        o[c + C / 2 + j] = q[c + 2 * j + 1];
      }
    for (int64_t k = vec_end; k < K; ++k) o[k] = q[k];
    for (int64_t g = 0; g < G; ++g) {
      int64_t sum = 0;
      for (int64_t k = g * gs; k < K && k < (g + 1) * gs; ++k) sum += q[k];
      xsum[m * G + g] = static_cast<float>(sum);
    }
  }
  return Int4Dot{w, scales, zeros, xp, xs, xsum, gs, G};
}

// Multi-row int4 steps multiply bf16-rounded weights and activations (summed in fp32, like a bf16 layer): with
// AVX512_BF16 the weight tiles are bf16 and dpbf16 does twice the multiply-adds per instruction of fp32 FMAs;
// other builds hold the same rounded values in fp32 tiles, so every build computes the same products.
#if defined(__AVX512BF16__)
using Int4TileValue = bf16;
#else
using Int4TileValue = float;
#endif

// Where dequant_int4_row puts its values: out is fp32 (exact, like dequantize_int4 in primitives.py) unless
// kRound, then rounded to bf16 (stored as bf16 or as fp32).
template <bool kRound>
inline void put(float* out, float v) { *out = kRound ? round_bf16(v) : v; }
template <bool kRound>
inline void put(bf16* out, float v) {
  static_assert(kRound, "bf16 values are rounded");
  uint32_t b;
  memcpy(&b, &v, sizeof b);
  out->bits = static_cast<uint16_t>(bf16_round_bits(b) >> 16);
}
#if defined(__AVX512F__)
template <bool kRound>
inline void put16(float* out, __m512 v) { _mm512_storeu_ps(out, kRound ? round_bf16(v) : v); }
#if defined(__AVX512BF16__)
template <bool kRound>
inline void put16(bf16* out, __m512 v) {
  static_assert(kRound, "bf16 values are rounded");
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif
#else
template <bool kRound>
inline void put8(float* out, __m256 v) { _mm256_storeu_ps(out, kRound ? round_bf16(v) : v); }
#endif

#if defined(__AVX512BW__) && defined(__AVX512BF16__)
// 32 packed nibbles (16 bytes, the low nibble first) -> one 16-bit lane each, in K order: byte i's dword
// (b, 0, 0, 0) becomes the words (b & 15, b >> 4).
inline __m512i nibble_lanes(const uint8_t* w) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  constexpr int kAOrBAndC = 0xA8;
  return _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F), kAOrBAndC);
}
#endif

// One packed row -> (q - z) * s in K order, computed in fp32 like dequantize_int4 in primitives.py.
template <bool kRound = false, typename T = float>
inline void dequant_int4_row(const uint8_t* w, const float* scales, const float* zeros, int64_t K, int64_t gs,
                             const void* next, T* out) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  const char* pf = static_cast<const char*>(next);
  for (int64_t g0 = 0; g0 < K; g0 += gs) {
    const int64_t g1 = g0 + gs < K ? g0 + gs : K;
    const float s = scales[g0 / gs], z = zeros[g0 / gs];
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
#else
    const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
#endif
    int64_t k = g0;
#if defined(__AVX512BW__) && defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bf16>) {
      // A group has 16 distinct values: each computed once as below, then looked up per nibble, a third of
      // the instructions per weight (the int4 engine's decoder layers on AMX tiles at 16 rows: 11.6 -> 9.3 ms).
      const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i table =
          _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_sub_ps(levels, zv), sv)));
      for (; k + 32 <= g1; k += 32) {
        prefetch_line<0>(pf + k / 2);
        _mm512_storeu_si512(out + k, _mm512_permutexvar_epi16(nibble_lanes(w + k / 2), table));
      }
    }
#endif
    for (; k + 32 <= g1; k += 32) {
      prefetch_line<0>(pf + k / 2);
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2));
      const __m128i even = _mm_and_si128(b, mask), odd = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
      const __m128i lo = _mm_unpacklo_epi8(even, odd), hi = _mm_unpackhi_epi8(even, odd);
#if defined(__AVX512F__)  // the same values, 16 at a time (multi-row int4 steps spend half their time here)
      const __m128i parts[2] = {lo, hi};
      for (int i = 0; i < 2; ++i) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(parts[i]));
        put16<kRound>(out + k + 16 * i, _mm512_mul_ps(_mm512_sub_ps(q, zv), sv));
      }
#else
      const __m128i parts[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
      for (int i = 0; i < 4; ++i) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        put8<kRound>(out + k + 8 * i, _mm256_mul_ps(_mm256_sub_ps(q, zv), sv));
      }
#endif
    }
    for (; k < g1; ++k) put<kRound>(out + k, (nibble(w, k) - z) * s);
  }
}


// Weight formats. `prepare` runs once per block of NB weight rows, `block` once per block of MB activation
// rows, and `scale` turns a raw dot into an output (per-channel int8 scale, else 1).
// fp32 activations against fp32 weights, or against weights stored in bf16 whose values are fp32 ones exactly
// (a bf16 checkpoint's): each widens to the same float, so both give the same products and sums, bit for bit.
template <typename T>
struct DenseF32 {
  const T* w;
  template <int NB>
  void prepare(const Problem&, int64_t) const {}
  template <typename V, int NB, int MB>
  void block(const Problem& p, int64_t n0, int64_t m0, float out[NB][MB]) const {
    const T* wb = w + n0 * p.K;
    dense_block<V, T, NB, MB>(p.x + m0 * p.ldx, p.ldx, wb, p.K, p.K, wb + NB * p.K, out);
  }
  // The same dots a slice of K at a time (row_tiles, many rows): the k-steps in [k0, k1), then the sums.
  template <typename V, int NB, int MB>
  void steps(const Problem& p, int64_t n0, int64_t m0, int64_t k0, int64_t k1, V acc[NB][MB], int64_t share,
             int64_t shares) const {
    const T* wb = w + n0 * p.K;
    tile_steps<V, NB, MB>(p.x + m0 * p.ldx, p.ldx, wb, p.K, k0, k1, kStep, wb + NB * p.K, acc, share, shares);
  }
  template <typename V, int NB, int MB>
  void sums(const Problem& p, int64_t n0, int64_t m0, const V acc[NB][MB], float out[NB][MB]) const {
    dense_sums<NB, MB>(p.x + m0 * p.ldx, p.ldx, w + n0 * p.K, p.K, p.K, acc, out);
  }
  float scale(int64_t) const { return 1.0f; }
};

// int8 weights; `xq` and `xs` are this thread's copy of the activation rows quantized by quantize_rows_int16.
struct Int8 {
  const int8_t* w;
  const float* scales;
  const int16_t* xq;  // [M, K]
  const float* xs;    // [M]
  template <int NB>
  void prepare(const Problem&, int64_t) const {}
  template <typename V, int NB, int MB>
  void block(const Problem& p, int64_t n0, int64_t m0, float out[NB][MB]) const {
    const int8_t* wb = w + n0 * p.K;
    int64_t dots[NB][MB];
    int8_block<V, NB, MB>(xq + m0 * p.K, wb, p.K, wb + NB * p.K, dots);
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m) out[r][m] = static_cast<float>(dots[r][m]) * xs[m0 + m];
  }
  float scale(int64_t n) const { return scales[n]; }
};

#if defined(__AVX512VNNI__)
// W8A8 layers on AVX512_VNNI: one dpbusd multiplies 64 unsigned activation bytes by 64 signed weight bytes, twice
// what dpwssd does on int16 levels, and reads the weights as stored (no widening). The int8 levels q in
// [-127, 127] go in as q + 128 in [1, 255]; each dot drops 128 x its weight row's sum again (summed once per
// block of weight rows, in prepare): dot(w, q) = dot(w, q + 128) - 128 sum(w). The products of a span of
// kByteSpan k fit int32 lanes (each dpbusd adds at most 4 x 255 x 127 to a lane), the spans sum in int64: the
// integers of the int16 form, so a row's result is the same bits on either path, tiles included.
constexpr int64_t kByteStep = 64;
constexpr int64_t kByteSpan = 1 << 16;
// Fewest rows a W8A8 step takes to the bytes; fewer stay on the int16 form, the same integers. Measured on a
// Sapphire Rapids class Xeon without its tiles (LLMPIPE_KERNEL_ISA=avx512_bf16, scripts/bench_kernels.py ab,
// SmolLM2-135M int8_sq decoder layers, int16 form / bytes time): 1 row 0.89-0.94x (the row sums cost as much
// as the dot), 4 rows 1.01x, 8 rows 1.13x, 16 rows 1.24x. A DecoderPlan sums its layers' rows once
// (LinearRef::byte_bias; a W8A8 linear layer keeps its own for the per-layer kernels), and then the bytes win
// from 1 row: all decoder layers, same machine, before / after,
// 1 row 4.91 / 4.65 ms, 2 rows 6.03 / 4.96, 4 rows 6.70 / 5.42, 8 rows 8.42 / 6.71; with its tiles (from 2 rows
// there), 1 row 4.97 / 4.21.
constexpr int64_t kW8A8ByteMinRows = 8;
constexpr int64_t kW8A8ByteMinRowsPrecomputed = 1;

// Whether a W8A8 product of M rows runs on the bytes (Int8Bytes), given its weights' byte bias or null.
inline bool w8a8_on_bytes(int64_t M, const int64_t* byte_bias) {
  return M >= (byte_bias != nullptr ? kW8A8ByteMinRowsPrecomputed : kW8A8ByteMinRows);
}

struct ByteLanes {
  __m512i v;
};
inline void vload(ByteLanes& a, const uint8_t* p) { a.v = _mm512_loadu_si512(p); }
inline void vload(ByteLanes& a, const int8_t* p) { a.v = _mm512_loadu_si512(p); }
// acc += per int32 lane, 4 products of x's unsigned and w's signed bytes (asm: see dot_pairs).
inline void vdot(const ByteLanes& w, const ByteLanes& x, WideInt& acc) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc.v) : "v"(x.v), "v"(w.v));
}

// 128 x the sum of a weight row of K bytes: what Int8Bytes subtracts from each of its dots.
inline int64_t int8_row_byte_bias(const int8_t* row, int64_t K) {
  const ByteLanes ones{_mm512_set1_epi8(1)};
  WideInt acc{_mm512_setzero_si512()};
  int64_t k = 0;
  for (; k + kByteStep <= K; k += kByteStep) {  // a lane gains at most 4 x 127 a step: no overflow below 2^28 k
    ByteLanes wv;
    vload(wv, row + k);
    vdot(wv, ones, acc);
  }
  int64_t sum = _mm512_reduce_add_epi32(acc.v);
  for (; k < K; ++k) sum += row[k];
  return 128 * sum;
}

// int8 weights with W8A8 activations: `xb` this thread's copy of the levels + 128 ([M, K]), `xs` their scales,
// `bias_sums` this thread's [kMaxBlockRows]: 128 x each weight row's sum for the current block, copied from
// `byte_bias` (int8_byte_bias of every row) when that is given, else summed here.
struct Int8Bytes {
  static constexpr int kMaxBlockRows = 16;
  const int8_t* w;
  const float* scales;
  const uint8_t* xb;
  const float* xs;
  int64_t* bias_sums;
  const int64_t* byte_bias;

  template <int NB>
  void prepare(const Problem& p, int64_t n0) const {
    static_assert(NB <= kMaxBlockRows);
    for (int r = 0; r < NB; ++r)
      bias_sums[r] = byte_bias != nullptr ? byte_bias[n0 + r] : int8_row_byte_bias(w + (n0 + r) * p.K, p.K);
  }
  template <typename V, int NB, int MB>
  void block(const Problem& p, int64_t n0, int64_t m0, float out[NB][MB]) const {
    const int8_t* wb = w + n0 * p.K;
    int64_t dots[NB][MB];
    exact_dots<ByteLanes, WideInt, NB, MB>(xb + m0 * p.K, wb, p.K, kByteStep, kByteSpan, wb + NB * p.K, dots);
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m) out[r][m] = static_cast<float>(dots[r][m] - bias_sums[r]) * xs[m0 + m];
  }
  float scale(int64_t n) const { return scales[n]; }
};

// Floats of scratch prepare_int8_bytes takes for M rows of K: the block's row sums (8-byte aligned), the row
// scales, the int16 levels, their bytes.
inline int64_t int8_bytes_floats(int64_t M, int64_t K) {
  return 1 + 2 * Int8Bytes::kMaxBlockRows + M + (M * K + 1) / 2 + (M * K + 3) / 4;
}

// Rounds the rows x [M, K] (row stride ldx) to W8A8 levels (quantize_rows_int16 at kW8A8QMax) into `scratch`
// and biases them to bytes; `byte_bias` as Int8Bytes's (or null).
inline Int8Bytes prepare_int8_bytes(const int8_t* w, const float* scales, const float* x, int64_t M, int64_t K,
                                    int64_t ldx, float* scratch, const int64_t* byte_bias = nullptr) {
  auto* sums = reinterpret_cast<int64_t*>((reinterpret_cast<uintptr_t>(scratch) + 7) & ~uintptr_t{7});
  float* xs = reinterpret_cast<float*>(sums + Int8Bytes::kMaxBlockRows);
  auto* xq = reinterpret_cast<int16_t*>(xs + M);
  auto* xb = reinterpret_cast<uint8_t*>(xq + M * K);
  quantize_rows_int16(x, M, K, ldx, xq, xs, kW8A8QMax);
  const __m512i bias = _mm512_set1_epi16(128);
  int64_t i = 0;
  for (; i + 32 <= M * K; i += 32)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i),
                        _mm512_cvtepi16_epi8(_mm512_add_epi16(_mm512_loadu_si512(xq + i), bias)));
  for (; i < M * K; ++i) xb[i] = static_cast<uint8_t>(xq[i] + 128);
  return Int8Bytes{w, scales, xb, xs, sums, byte_bias};
}
#endif

// 128 x the sum of each of the N rows of w [N, K]: the byte bias Int8Bytes subtracts from each dot, summed once
// per weight by the callers that keep it (a DecoderPlan, a W8A8 linear layer). Builds without the byte dots
// never read it, and sum plainly.
inline void int8_byte_bias(const int8_t* w, int64_t N, int64_t K, int64_t* out) {
  for (int64_t n = 0; n < N; ++n) {
#if defined(__AVX512VNNI__)
    out[n] = int8_row_byte_bias(w + n * K, K);
#else
    int64_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += w[n * K + k];
    out[n] = 128 * sum;
#endif
  }
}

// bf16 weights; `xr` is this thread's copy of the activation rows rounded by round_rows_bf16 ([M, K]).
struct DenseBF16 {
  const bf16* w;
  const Bf16Activation* xr;
  template <int NB>
  void prepare(const Problem&, int64_t) const {}
  template <typename V, int NB, int MB>
  void block(const Problem& p, int64_t n0, int64_t m0, float out[NB][MB]) const {
    const bf16* wb = w + n0 * p.K;
#if defined(__AVX512BF16__)
    bf16_block<V, NB, MB>(xr + m0 * p.K, wb, p.K, wb + NB * p.K, out);
#else
    dense_block<V, bf16, NB, MB>(xr + m0 * p.K, p.K, wb, p.K, p.K, wb + NB * p.K, out);
#endif
  }
  float scale(int64_t) const { return 1.0f; }
};

// Several activation rows: dequantize NB weight rows once into a per-thread tile, rounded to bf16, and reuse it
// for every block of activation rows, which are `xr`: the rows rounded by round_rows_bf16 ([M, K]).
struct Int4Tile {
  const uint8_t* w;
  const float* scales;
  const float* zeros;
  int64_t gs, G;
  Int4TileValue* tiles;  // [threads, kTileRows, K]: each thread's tile is tiles + thread * tile_stride
  int64_t tile_stride;
  const Bf16Activation* xr;
  static constexpr int kTileRows = 4;
  template <int NB>
  Int4TileValue* tile(const Problem&) const {
    static_assert(NB <= kTileRows, "tile holds at most kTileRows weight rows");
    return tiles + omp_get_thread_num() * tile_stride;
  }
  template <int NB>
  void prepare(const Problem& p, int64_t n0) const {
    const int64_t ldw = p.K / 2;
    for (int r = 0; r < NB; ++r)
      dequant_int4_row<true>(w + (n0 + r) * ldw, scales + (n0 + r) * G, zeros + (n0 + r) * G, p.K, gs,
                             w + (n0 + NB) * ldw + r * ldw, tile<NB>(p) + r * p.K);
  }
  template <typename V, int NB, int MB>
  void block(const Problem& p, int64_t, int64_t m0, float out[NB][MB]) const {
    const Int4TileValue* t = tile<NB>(p);
#if defined(__AVX512BF16__)
    bf16_block<V, NB, MB>(xr + m0 * p.K, t, p.K, t, out);
#else
    dense_block<V, float, NB, MB>(xr + m0 * p.K, p.K, t, p.K, p.K, t, out);
#endif
  }
  float scale(int64_t) const { return 1.0f; }
};

// Floats of scratch for one thread's Int4Tile tile, and for the rows it reads as xr.
inline int64_t int4_tile_floats(int64_t K) {
  return (Int4Tile::kTileRows * K * static_cast<int64_t>(sizeof(Int4TileValue)) + 3) / 4;
}
inline int64_t int4_tile_activation_floats(int64_t M, int64_t K) {
  return (M * K * static_cast<int64_t>(sizeof(Bf16Activation)) + 3) / 4;
}

// A tile's finished dots into y: scaled, biased, added to y where the problem accumulates.
// NOTE: always_inline here and in move_tile: with the sliced tiles (row_tiles) in the library, GCC stopped
// inlining this, tile_steps and the lane sums into the tiles' loops; the accumulators then went through memory
// and 16-row fp32 layers took 1.3x the time.
template <int NB, int MB, typename Fmt>
inline __attribute__((always_inline)) void store_tile(const Fmt& f, const Problem& p, int64_t n0, int64_t m0,
                                                      const float out[NB][MB]) {
  for (int r = 0; r < NB; ++r) {
    const int64_t n = n0 + r;
    const float s = f.scale(n), b = p.bias ? p.bias[n] : 0.0f;
    for (int m = 0; m < MB; ++m) {
      float* y = p.y + (m0 + m) * p.ldy + n;
      *y = p.accumulate ? *y + (out[r][m] * s + b) : out[r][m] * s + b;
    }
  }
}

template <typename V, int NB, int MB, typename Fmt>
inline void emit(const Fmt& f, const Problem& p, int64_t n0, int64_t m0) {
  float out[NB][MB];
  f.template block<V, NB, MB>(p, n0, m0, out);
  store_tile<NB, MB>(f, p, n0, m0, out);
}

// Activation rows per register tile: NB x rows accumulators + the activation vectors + a weight vector fill
// the 16 vector registers of AVX2, or the 32 of AVX-512 (where a Narrow k-step takes two registers).
constexpr int64_t kNarrowTileRows = 3;
#if defined(__AVX512F__)
constexpr int64_t kWideTileRows = 6;
// Steps of this many rows or more run Wide. Measured (scripts/bench_kernels.py ab, SmolLM2-135M, 2 threads) on
// Zen 5, whose 512-bit units are full width: at 16 rows the decoder layers took 0.84x (fp32), 0.82x (bf16) and
// 0.60x (int8) of Narrow's time and the greedy head 0.61x; at 2-3 rows Wide was slower for fp32 (1.1-1.3x the
// time), even for bf16 and faster for int8 (0.8x). Zen 4 splits 512-bit ops: one row ran 20-40% slower there.
constexpr int64_t kWideMinRows = 4;
// Whether one-row steps run Wide too. On that Zen 5 one row took 0.88x (int8 layers), 0.94x (fp32) and 0.7-0.8x
// (the greedy head) of Narrow's time; results are the same bits either way, so the runner times both forms on
// the machine at load and sets this (set_wide_single_row).
inline std::atomic<bool> wide_single_row{false};
#endif

// fn.template operator()<count>() for a tile of `count` activation rows (1..MaxRows).
template <int64_t MaxRows, typename Fn>
inline void with_rows(int64_t count, Fn&& fn) {
  switch (count) {
    case 1: fn.template operator()<1>(); break;
    case 2: fn.template operator()<2>(); break;
    case 3: fn.template operator()<3>(); break;
    case 4: if constexpr (MaxRows >= 4) fn.template operator()<4>(); break;
    case 5: if constexpr (MaxRows >= 5) fn.template operator()<5>(); break;
    case 6: if constexpr (MaxRows >= 6) fn.template operator()<6>(); break;
    default: break;
  }
}

// Formats whose register tiles can stop after a slice of K and go on from their accumulators (steps, sums).
template <typename Fmt>
concept SlicesK = requires { &Fmt::template steps<Narrow, 1, 1>; };

// Steps of many activation rows take the K of a block in slices of kSliceK, every row tile of a group of
// kSliceGroupRows rows taking a slice before the next: one slice of the group's activations and of the block's
// weights stays in L1 across its tiles, where whole rows (K up to 1536 floats, 6 KB a row) pushed the weights
// out between tiles and each tile read both from L2. The accumulators wait in memory between slices. A dot's
// summation order is unchanged: every lane still takes its k in order. fp32 decoder layers on an AMX Xeon (2
// threads, `scripts/bench_kernels.py ab`), whole rows / slices: 16 rows 32.8 / 27.5 ms, 24 rows 40.7 / 38.2; the
// AVX2 build there at 16 rows 43.6 / 37.4. Slices of 128 or 512, or groups of 36 rows, were no faster.
// The tiles of all groups share the block's prefetches (tile_steps). When each tile prefetched every line, the
// lines went out in bursts at the start of each slice, all from the first tile, and the others repeated them:
// the same fp32 layers every tile / shared, 16 rows 30.6 / 28.3 ms, 48 rows 72.0 / 63.8, 128 rows 178 / 164 (later
// runs, the machine's speed changing: 16 rows 0.99-1.04x, 128 rows 1.04x).
constexpr int64_t kSliceK = 256;
constexpr int64_t kSliceGroupRows = 24;
template <int64_t MaxRows>
constexpr int64_t kSliceGroupTiles = kSliceGroupRows / MaxRows;  // row tiles of MaxRows rows in a group

// A tile's accumulators to or from the flat array that keeps them between slices, vector by vector.
template <int NB, int MB, typename V>
inline __attribute__((always_inline)) void move_tile(const V* from, V to[NB][MB]) {
  #pragma GCC unroll 16
  for (int r = 0; r < NB; ++r)
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) to[r][m] = from[r * MB + m];
}
template <int NB, int MB, typename V>
inline __attribute__((always_inline)) void move_tile(const V from[NB][MB], V* to) {
  #pragma GCC unroll 16
  for (int r = 0; r < NB; ++r)
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) to[r * MB + m] = from[r][m];
}

template <typename V, int64_t MaxRows, int NB, typename Fmt>
inline void sliced_group(const Fmt& f, const Problem& p, int64_t n0, const int64_t* first, int64_t tiles,
                         int64_t tiles_before, int64_t all_tiles) {
  // K > kSliceK: every tile takes at least one whole k-step, so `saved` holds every tile's accumulators.
  alignas(64) V saved[kSliceGroupTiles<MaxRows>][NB * MaxRows];
  const int64_t k_end = p.K / kStep * kStep;
  for (int64_t k0 = 0; k0 < k_end; k0 += kSliceK) {
    const int64_t k1 = k0 + kSliceK < k_end ? k0 + kSliceK : k_end;
    for (int64_t t = 0; t < tiles; ++t)
      with_rows<MaxRows>(first[t + 1] - first[t], [&]<int MB>() {
        V acc[NB][MB];
        if (k0 == 0)
          zero_tile<V, NB, MB>(acc);
        else
          move_tile<NB, MB>(saved[t], acc);
        f.template steps<V, NB, MB>(p, n0, first[t], k0, k1, acc, tiles_before + t, all_tiles);
        move_tile<NB, MB>(acc, saved[t]);
      });
  }
  for (int64_t t = 0; t < tiles; ++t)
    with_rows<MaxRows>(first[t + 1] - first[t], [&]<int MB>() {
      V acc[NB][MB];
      move_tile<NB, MB>(saved[t], acc);
      float out[NB][MB];
      f.template sums<V, NB, MB>(p, n0, first[t], acc, out);
      store_tile<NB, MB>(f, p, n0, first[t], out);
    });
}

// Rows in the next of `tiles_left` near-equal tiles of the `rows_left` activation rows left.
inline int64_t next_tile_rows(int64_t rows_left, int64_t tiles_left) {
  return (rows_left + tiles_left - 1) / tiles_left;
}

// row_tiles' tiles, in groups of kSliceGroupRows rows that each take K slice by slice (sliced_group).
template <typename V, int64_t MaxRows, int NB, typename Fmt>
inline void sliced_tiles(const Fmt& f, const Problem& p, int64_t n0, int64_t tiles) {
  for (int64_t t = 0, m = 0; t < tiles;) {
    int64_t first[kSliceGroupTiles<MaxRows> + 1], group = 0;
    for (; group < kSliceGroupTiles<MaxRows> && t < tiles; ++group, ++t) {
      first[group] = m;
      m += next_tile_rows(p.M - m, tiles - t);
    }
    first[group] = m;
    sliced_group<V, MaxRows, NB>(f, p, n0, first, group, t - group, tiles);
  }
}

// All activation rows against NB weight rows starting at n0, in tiles of at most MaxRows rows: the NB weight
// rows stay in L1/L2 across tiles. The rows are split into the fewest tiles, of near-equal size: a lone 1-row
// tile would leave the FMA units waiting on a single accumulator chain per weight row.
template <typename V, int64_t MaxRows, int NB, typename Fmt>
inline void row_tiles(const Fmt& f, const Problem& p, int64_t n0) {
  const int64_t tiles = (p.M + MaxRows - 1) / MaxRows;
  if constexpr (SlicesK<Fmt>) {
    if (tiles > 1 && p.K > kSliceK) return sliced_tiles<V, MaxRows, NB>(f, p, n0, tiles);
  }
  int64_t m = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t count = next_tile_rows(p.M - m, tiles - t);
    with_rows<MaxRows>(count, [&]<int MB>() { emit<V, NB, MB>(f, p, n0, m); });
    m += count;
  }
}

// Formats that compute a whole block of kBlockRows weight rows against every activation row themselves (the
// AMX tiles of amx_tiles.h) instead of through the register tiles above; N is a multiple of kBlockRows.
template <typename Fmt>
concept WholeBlocks = requires { Fmt::kBlockRows; };

// Weight rows per block: the format's own, else `fallback`.
template <typename Fmt, int fallback>
constexpr int rows_per_block() {
  if constexpr (WholeBlocks<Fmt>)
    return Fmt::kBlockRows;
  else
    return fallback;
}

template <int NB, typename Fmt>
inline void rows(const Fmt& f, const Problem& p, int64_t n0) {
  if constexpr (WholeBlocks<Fmt>) {
    static_assert(NB == Fmt::kBlockRows, "whole-block formats take blocks of their own size");
    f.whole_block(p, n0);
  } else {
    f.template prepare<NB>(p, n0);
#if defined(__AVX512F__)
    if (p.M >= kWideMinRows || (p.M == 1 && wide_single_row.load(std::memory_order_relaxed))) {
      row_tiles<Wide, kWideTileRows, NB>(f, p, n0);
      return;
    }
#endif
    row_tiles<Narrow, kNarrowTileRows, NB>(f, p, n0);
  }
}

// Block b of NB weight rows (rows NB b .. NB b + NB - 1), or the rows left over past the last full block.
template <int NB, typename Fmt>
inline void row_block(const Fmt& f, const Problem& p, int64_t b) {
  const int64_t n0 = b * NB;
  if constexpr (WholeBlocks<Fmt>) {
    rows<NB>(f, p, n0);
  } else if (n0 + NB <= p.N) {
    rows<NB>(f, p, n0);
  } else {
    for (int64_t n = n0; n < p.N; ++n) rows<1>(f, p, n);
  }
}

}  // namespace llmp
