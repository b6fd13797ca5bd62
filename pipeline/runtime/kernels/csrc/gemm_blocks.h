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
#endif

// The register tile every format shares: over the k-steps of `step` elements in [k0, k1), MB activation vectors
// (form O, rows of x with stride ldx) and one weight vector at a time (rows of w with stride ldw), multiplied
// into acc[NB][MB] by vdot; the weights after the block (`next`) are streamed into cache one step ahead.
// NOTE: each (row, activation) dot is summed in the same order whatever the form, NB and MB are.
template <typename O, int NB, int MB, typename A, typename TX, typename TW>
inline void tile_steps(const TX* x, int64_t ldx, const TW* w, int64_t ldw, int64_t k0, int64_t k1, int step,
                       const void* next, A acc[NB][MB]) {
  const char* pf = static_cast<const char*>(next);
  for (int64_t k = k0; k + step <= k1; k += step) {
    for (int j = 0; j < NB * step * int(sizeof(TW)); j += 64)
      _mm_prefetch(pf + k * NB * int64_t{sizeof(TW)} + j, _MM_HINT_T0);
    O xv[MB];
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) vload(xv[m], x + m * ldx + k);
    #pragma GCC unroll 16
    for (int r = 0; r < NB; ++r) {
      O wv;
      vload(wv, w + r * ldw + k);
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

// Dot products of NB weight rows (fp32 or bf16, row stride ldw) with MB activation rows (row stride ldx),
// in vector form V (Narrow or Wide, see kStep). `next` is where the following block's weights start.
template <typename V, typename T, int NB, int MB>
inline void dense_block(const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, const void* next,
                        float out[NB][MB]) {
  V acc[NB][MB];
  zero_tile<V, NB, MB>(acc);
  tile_steps<V, NB, MB>(x, ldx, w, ldw, 0, K, kStep, next, acc);
  const int64_t vec_end = K / kStep * kStep;
  #pragma GCC unroll 16
  for (int r = 0; r < NB; ++r)
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      float s = vsum(acc[r][m]);
      for (int64_t t = vec_end; t < K; ++t) s += to_f32(w[r * ldw + t]) * x[m * ldx + t];
      out[r][m] = s;
    }
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

// Dot products of NB bf16 weight rows with MB bf16 activation rows (row stride K for both), as dense_block.
template <typename V, int NB, int MB>
inline void bf16_block(const bf16* x, const bf16* w, int64_t K, const void* next, float out[NB][MB]) {
  constexpr int step = 2 * kStep;
  V acc[NB][MB];
  zero_tile<V, NB, MB>(acc);
  tile_steps<typename Bf16Form<V>::type, NB, MB>(x, K, w, K, 0, K, step, next, acc);
  const int64_t vec_end = K / step * step;
  #pragma GCC unroll 16
  for (int r = 0; r < NB; ++r)
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      float s = vsum(acc[r][m]);
      for (int64_t t = vec_end; t < K; ++t) s += to_f32(w[r * K + t]) * to_f32(x[m * K + t]);
      out[r][m] = s;
    }
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
// NOTE: 15 bits + sign leave each product below 2^21, so an int32 lane holds 2^9 k-steps of its pairs; dots
// longer than that (kActSpan) are summed span by span into int64.
constexpr float kActQMax = 16383.0f;
constexpr int64_t kActSpan = 512 * 2 * kStep;

inline float act_scale(float amax) { return amax > 0.0f ? amax / kActQMax : 1.0f; }

// x [M, K] fp32 (row stride ldx) -> xq [M, K] int16 and their scales [M].
inline void quantize_rows_int16(const float* x, int64_t M, int64_t K, int64_t ldx, int16_t* xq, float* scales) {
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
    const float s = act_scale(amax);
    scales[m] = s;
    const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(kActQMax), lo = _mm256_set1_ps(-kActQMax);
    for (k = 0; k + 8 <= K; k += 8) {
      const __m256 q = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(xm + k), sv), lo), hi);
      const __m256i i = _mm256_cvtps_epi32(q);  // round half to even (MXCSR default)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + k),
                       _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
    }
    for (; k < K; ++k) {
      const float q = nearbyintf(xm[k] / s);
      o[k] = static_cast<int16_t>(q > kActQMax ? kActQMax : q < -kActQMax ? -kActQMax : q);
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
inline void vdot(const NarrowInt& w, const NarrowInt& x, NarrowInt& acc) {
  #pragma GCC unroll 16
  for (int i = 0; i < kStep / 8; ++i) {
#if defined(__AVX512VNNI__)
    // NOTE: written as asm because GCC 12 spilled every accumulator of the intrinsic's form to the stack
    // (1.5-2x slower blocks); the asm's tied operand keeps them in registers.
    asm("vpdpwssd %2, %1, %0" : "+v"(acc.h[i]) : "v"(w.h[i]), "v"(x.h[i]));
#else
    acc.h[i] = _mm256_add_epi32(acc.h[i], _mm256_madd_epi16(w.h[i], x.h[i]));
#endif
  }
}
inline int64_t isum(const NarrowInt& a) {
  __m256i s = _mm256_setzero_si256();
  for (const auto& h : a.h)
    s = _mm256_add_epi64(s, _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(h)),
                                             _mm256_cvtepi32_epi64(_mm256_extracti128_si256(h, 1))));
  const __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  return _mm_cvtsi128_si64(t) + _mm_extract_epi64(t, 1);
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
inline void vdot(const WideInt& w, const WideInt& x, WideInt& acc) {
#if defined(__AVX512VNNI__)
  asm("vpdpwssd %2, %1, %0" : "+v"(acc.v) : "v"(w.v), "v"(x.v));  // asm: see the Narrow form
#else
  acc.v = _mm512_add_epi32(acc.v, _mm512_madd_epi16(w.v, x.v));
#endif
}
inline int64_t isum(const WideInt& a) {
  const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(a.v));
  const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a.v, 1));
  return _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
}
#endif

// Exact integer dots of NB int8 weight rows (row stride K) with MB int16 activation rows (row stride K).
template <typename V, int NB, int MB>
inline void int8_block(const int16_t* x, const int8_t* w, int64_t K, const void* next, int64_t out[NB][MB]) {
  using I = typename IntForm<V>::type;
  constexpr int step = 2 * kStep;
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) out[r][m] = 0;
  const int64_t vec_end = K / step * step;
  for (int64_t k0 = 0; k0 < vec_end; k0 += kActSpan) {
    I acc[NB][MB];
    zero_tile<I, NB, MB>(acc);
    tile_steps<I, NB, MB>(x, K, w, K, k0, k0 + kActSpan < vec_end ? k0 + kActSpan : vec_end, step, next, acc);
    #pragma GCC unroll 16
    for (int r = 0; r < NB; ++r)
      #pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) out[r][m] += isum(acc[r][m]);
  }
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m)
      for (int64_t t = vec_end; t < K; ++t) out[r][m] += int64_t{w[r * K + t]} * x[m * K + t];
}

// int4 in 64-weight chunks: 32 bytes = eight 32-bit lanes; lane i holds q[8i .. 8i+7], nibble j at bits 4j.
// Masking nibble j in place leaves q * 2^(4j) in each lane, which converts to fp32 exactly; the activations
// are pre-permuted to match (xp[8j + i] = x[8i + j] * 2^(-4j)), so no unpacking or shuffling is needed and
// the power-of-two rescale is exact. Nibble 7 is shifted down instead: masking it would set the sign bit.
constexpr int kChunk = 64;
// Up to this many activation rows, dotting the nibbles directly beats dequantizing tiles (measured: 3072x576,
// one thread, 4 rows 0.35 vs 0.38 ms; 6 rows 0.50 vs 0.45 ms).
// Steps of more rows multiply bf16-rounded values (Int4Tile), as primitives.INT4_EXACT_MAX_ROWS says.
constexpr int64_t kInt4DirectMaxRows = 4;

// Whether the int4 kernels can walk a layer: the chunked loop folds group size 32 or a multiple of kChunk, and
// two weights share a byte.
inline bool int4_shape_ok(int64_t gs, int64_t K) {
  return gs > 0 && (gs == 32 || gs % kChunk == 0) && K % 2 == 0;
}

// Groups per row of K weights (the last one may be short).
inline int64_t int4_groups(int64_t K, int64_t gs) { return (K + gs - 1) / gs; }

inline int nibble_shift(int j) { return j == 7 ? 0 : 4 * j; }

// AVX-512 builds take chunks in pairs: one zmm holds two chunks' 64 bytes (lanes 0-7 the first chunk's, 8-15
// the second's), the activations permuted to match (xp[c + 16j + l] pairs chunk c's lane l with chunk c + 64's
// lane l - 8), so a pair costs the instructions one chunk costs in a ymm: one-row int4 decode is bound by them,
// not by memory. An odd last chunk keeps the ymm layout. The pairs fold their group sums with group size 32 or
// 64 (four or two groups to a pair) or a multiple of a pair; other group sizes keep the ymm loop.
constexpr int kPair = 2 * kChunk;
inline bool int4_pairs(int64_t gs) {
#if defined(__AVX512F__)
  return gs == 32 || gs == kChunk || gs % kPair == 0;
#else
  (void)gs;
  return false;
#endif
}

inline void permute_x(const float* x, int64_t K, float* xp, bool pairs) {
  const int64_t pair_end = pairs ? K / kPair * kPair : 0;
  for (int64_t c = 0; c < pair_end; c += kPair)
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 16; ++l)
        xp[c + 16 * j + l] = ldexpf(x[c + (l / 8) * kChunk + 8 * (l % 8) + j], -nibble_shift(j));
  for (int64_t c = pair_end; c + kChunk <= K; c += kChunk)
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 8; ++i) xp[c + 8 * j + i] = ldexpf(x[c + 8 * i + j], -nibble_shift(j));
}

inline float nibble(const uint8_t* row, int64_t k) {
  return static_cast<float>((row[k >> 1] >> ((k & 1) * 4)) & 0x0F);
}

#if defined(__AVX512F__)
// The zmm pairs of int4_block for RB weight rows (row stride ldw) and MB activation rows: the q * x sums of
// rows' pairs before pair_end, folded per group, into sums[RB][MB].
template <int RB, int MB>
inline void int4_pair_sums(const float* xp, int64_t G, const uint8_t* w, int64_t ldw, const float* scales,
                           int64_t K, int64_t gs, int64_t pair_end, const char* next, float sums[][MB]) {
  __m512 acc[RB][MB], gacc[RB][MB];
  for (int r = 0; r < RB; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = gacc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pair_end; k += kPair) {
    for (int j = 0; j < RB * kPair / 2; j += 64) _mm_prefetch(next + k / 2 * RB + j, _MM_HINT_T0);
    for (int r = 0; r < RB; ++r) {
      const __m512i v = _mm512_loadu_si512(w + r * ldw + k / 2);
      for (int j = 0; j < 8; ++j) {
        const __m512i q =
            j == 7 ? _mm512_srli_epi32(v, 28) : _mm512_and_si512(v, _mm512_set1_epi32(0xF << (4 * j)));
        const __m512 qf = _mm512_cvtepi32_ps(q);
        for (int m = 0; m < MB; ++m)
          gacc[r][m] = _mm512_fmadd_ps(qf, _mm512_loadu_ps(xp + m * K + k + 16 * j), gacc[r][m]);
      }
    }
    if (gs > kChunk && (k + kPair) % gs != 0 && k + kPair < pair_end) continue;
    for (int r = 0; r < RB; ++r) {
      const float* s = scales + r * G + k / gs;
      const __m512 sv = gs == 32 ? _mm512_setr_ps(s[0], s[0], s[0], s[0], s[1], s[1], s[1], s[1], s[2], s[2],
                                                  s[2], s[2], s[3], s[3], s[3], s[3])
                        : gs == kChunk ? _mm512_insertf32x8(_mm512_set1_ps(s[0]), _mm256_set1_ps(s[1]), 1)
                                       : _mm512_set1_ps(s[0]);
      for (int m = 0; m < MB; ++m) {
        acc[r][m] = _mm512_fmadd_ps(gacc[r][m], sv, acc[r][m]);
        gacc[r][m] = _mm512_setzero_ps();
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int m = 0; m < MB; ++m) sums[r][m] = _mm512_reduce_add_ps(acc[r][m]);
}
#endif

// Per group g: sum((q - z) * s * x) = s * sum(q * x) - s * z * xsum[g]. The q * x sums run in vector
// accumulators (gacc) folded into acc with the group scale when a group ends; with group size 32 a chunk
// holds two groups, one per 128-bit half, folded with a two-valued scale vector. `pairs` (int4_pairs) runs
// the chunks before the last odd one in zmm pairs, the xp layout of permute_x with the same flag.
template <int NB, int MB>
inline void int4_block(const float* x, int64_t ldx, const float* xp, const float* xsum, int64_t G,
                       const uint8_t* w, const float* scales, const float* zeros, int64_t K, int64_t gs,
                       bool pairs, float out[NB][MB]) {
  const int64_t ldw = K / 2, vec_end = K / kChunk * kChunk;
  const int64_t pair_end = pairs ? K / kPair * kPair : 0;
  const char* next = reinterpret_cast<const char*>(w + NB * ldw);
  float pair_sums[NB][MB] = {};
#if defined(__AVX512F__)
  if (pair_end > 0) {
    // Weight rows in groups small enough that their accumulator pairs stay in the 32 registers (four rows
    // of four activation rows spilled: 0.9x the 8-lane loop's speed); a row's sums are the same either way.
    constexpr int RB = NB * MB <= 8 ? NB : 8 / MB;
    static_assert(NB % RB == 0, "row groups tile the block");
    for (int r0 = 0; r0 < NB; r0 += RB)
      int4_pair_sums<RB, MB>(xp, G, w + r0 * ldw, ldw, scales + r0 * G, K, gs, pair_end, next + r0 * ldw,
                             pair_sums + r0);
  }
#endif
  __m256 acc[NB][MB], gacc[NB][MB];
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = gacc[r][m] = _mm256_setzero_ps();
  for (int64_t k = pair_end; k < vec_end; k += kChunk) {
    for (int j = 0; j < NB * kChunk / 2; j += 64) _mm_prefetch(next + k / 2 * NB + j, _MM_HINT_T0);
    for (int r = 0; r < NB; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * ldw + k / 2));
      for (int j = 0; j < 8; ++j) {
        const __m256i q =
            j == 7 ? _mm256_srli_epi32(v, 28) : _mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * j)));
        const __m256 qf = _mm256_cvtepi32_ps(q);
        for (int m = 0; m < MB; ++m)
          gacc[r][m] = _mm256_fmadd_ps(qf, _mm256_loadu_ps(xp + m * K + k + 8 * j), gacc[r][m]);
      }
    }
    const bool group_end = (k + kChunk) % gs == 0 || k + 2 * kChunk > K;
    if (gs != 32 && !group_end) continue;
    for (int r = 0; r < NB; ++r) {
      const float* s = scales + r * G + k / gs;
      const __m256 sv =
          gs == 32 ? _mm256_set_m128(_mm_set1_ps(s[1]), _mm_set1_ps(s[0])) : _mm256_set1_ps(s[0]);
      for (int m = 0; m < MB; ++m) {
        acc[r][m] = _mm256_fmadd_ps(gacc[r][m], sv, acc[r][m]);
        gacc[r][m] = _mm256_setzero_ps();
      }
    }
  }
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) {
      float sum = pair_sums[r][m] + hsum(acc[r][m]);
      for (int64_t k = vec_end; k < K; ++k)
        sum += scales[r * G + k / gs] * nibble(w + r * ldw, k) * x[m * ldx + k];
      for (int64_t g = 0; g < G; ++g) sum -= scales[r * G + g] * zeros[r * G + g] * xsum[m * G + g];
      out[r][m] = sum;
    }
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
    for (; k + 32 <= g1; k += 32) {
      _mm_prefetch(pf + k / 2, _MM_HINT_T0);
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

struct Problem {
  const float* x;
  int64_t M, K, ldx, N;
  const float* bias;  // [N] or null
  float* y;           // [M, N] with row stride ldy
  int64_t ldy;
  bool accumulate;  // y += result (a residual add) instead of y = result
};

// Weight formats. `prepare` runs once per block of NB weight rows, `block` once per block of MB activation
// rows, and `scale` turns a raw dot into an output (per-channel int8 scale, else 1).
struct DenseF32 {
  const float* w;
  template <int NB>
  void prepare(const Problem&, int64_t) const {}
  template <typename V, int NB, int MB>
  void block(const Problem& p, int64_t n0, int64_t m0, float out[NB][MB]) const {
    const float* wb = w + n0 * p.K;
    dense_block<V, float, NB, MB>(p.x + m0 * p.ldx, p.ldx, wb, p.K, p.K, wb + NB * p.K, out);
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

// Few activation rows (decode): dot the packed nibbles directly (zmm pairs of chunks where int4_pairs says,
// else 8-float vectors, whatever V is: a row's result never depends on the rows beside it).
struct Int4Direct {
  const uint8_t* w;
  const float* scales;
  const float* zeros;
  const float* xp;    // [M, K] permuted activations (see permute_x, with int4_pairs(gs))
  const float* xsum;  // [M, G] activation sums per group
  int64_t gs, G;
  template <int NB>
  void prepare(const Problem&, int64_t) const {}
  template <typename V, int NB, int MB>
  void block(const Problem& p, int64_t n0, int64_t m0, float out[NB][MB]) const {
    int4_block<NB, MB>(p.x + m0 * p.ldx, p.ldx, xp + m0 * p.K, xsum + m0 * G, G, w + n0 * (p.K / 2),
                       scales + n0 * G, zeros + n0 * G, p.K, gs, int4_pairs(gs), out);
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

template <typename V, int NB, int MB, typename Fmt>
inline void emit(const Fmt& f, const Problem& p, int64_t n0, int64_t m0) {
  float out[NB][MB];
  f.template block<V, NB, MB>(p, n0, m0, out);
  for (int r = 0; r < NB; ++r) {
    const int64_t n = n0 + r;
    const float s = f.scale(n), b = p.bias ? p.bias[n] : 0.0f;
    for (int m = 0; m < MB; ++m) {
      float* y = p.y + (m0 + m) * p.ldy + n;
      *y = p.accumulate ? *y + (out[r][m] * s + b) : out[r][m] * s + b;
    }
  }
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

template <typename V, int64_t MaxRows, int NB, typename Fmt>
inline void emit_rows(const Fmt& f, const Problem& p, int64_t n0, int64_t m0, int64_t count) {
  switch (count) {
    case 1: emit<V, NB, 1>(f, p, n0, m0); break;
    case 2: emit<V, NB, 2>(f, p, n0, m0); break;
    case 3: emit<V, NB, 3>(f, p, n0, m0); break;
    case 4: if constexpr (MaxRows >= 4) emit<V, NB, 4>(f, p, n0, m0); break;
    case 5: if constexpr (MaxRows >= 5) emit<V, NB, 5>(f, p, n0, m0); break;
    case 6: if constexpr (MaxRows >= 6) emit<V, NB, 6>(f, p, n0, m0); break;
    default: break;
  }
}

// All activation rows against NB weight rows starting at n0, in tiles of at most MaxRows rows: the NB weight
// rows stay in L1/L2 across tiles. The rows are split into the fewest tiles, of near-equal size: a lone 1-row
// tile would leave the FMA units waiting on a single accumulator chain per weight row.
template <typename V, int64_t MaxRows, int NB, typename Fmt>
inline void row_tiles(const Fmt& f, const Problem& p, int64_t n0) {
  const int64_t tiles = (p.M + MaxRows - 1) / MaxRows;
  int64_t m = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t count = (p.M - m) / (tiles - t) + ((p.M - m) % (tiles - t) != 0);
    emit_rows<V, MaxRows, NB>(f, p, n0, m, count);
    m += count;
  }
}

template <int NB, typename Fmt>
inline void rows(const Fmt& f, const Problem& p, int64_t n0) {
  f.template prepare<NB>(p, n0);
#if defined(__AVX512F__)
  if (p.M >= kWideMinRows || (p.M == 1 && wide_single_row.load(std::memory_order_relaxed))) {
    row_tiles<Wide, kWideTileRows, NB>(f, p, n0);
    return;
  }
#endif
  row_tiles<Narrow, kNarrowTileRows, NB>(f, p, n0);
}

// Block b of NB weight rows (rows NB b .. NB b + NB - 1), or the rows left over past the last full block.
template <int NB, typename Fmt>
inline void row_block(const Fmt& f, const Problem& p, int64_t b) {
  const int64_t n0 = b * NB;
  if (n0 + NB <= p.N) {
    rows<NB>(f, p, n0);
  } else {
    for (int64_t n = n0; n < p.N; ++n) rows<1>(f, p, n);
  }
}

// Activations for Int4Direct: permuted copies and per-group sums, both [M, ...].
inline void prepare_int4_activations(const Problem& p, int64_t gs, int64_t G, float* xp, float* xsum) {
  for (int64_t m = 0; m < p.M; ++m) {
    const float* xm = p.x + m * p.ldx;
    permute_x(xm, p.K, xp + m * p.K, int4_pairs(gs));
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int64_t k = g * gs; k < p.K && k < (g + 1) * gs; ++k) s += xm[k];
      xsum[m * G + g] = s;
    }
  }
}

}  // namespace llmp
