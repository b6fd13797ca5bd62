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
#include <type_traits>

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
inline void vfma(const Narrow& w, const Narrow& x, Narrow& acc) {
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
inline void vfma(const Wide& w, const Wide& x, Wide& acc) { acc.v = _mm512_fmadd_ps(w.v, x.v, acc.v); }
inline float vsum(const Wide& a) {
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1)));
}
#endif

// Dot products of NB weight rows (fp32 or bf16, row stride ldw) with MB activation rows (row stride ldx),
// in vector form V (Narrow or Wide, see kStep). `next` is where the following block's weights start: they are
// streamed into cache ahead of use.
// NOTE: each (row, activation) dot is summed in the same order whatever V, NB and MB are.
template <typename V, typename T, int NB, int MB>
inline void dense_block(const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, const void* next,
                        float out[NB][MB]) {
  V acc[NB][MB];
  #pragma GCC unroll 16
  for (int r = 0; r < NB; ++r)
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) vzero(acc[r][m]);
  const char* pf = static_cast<const char*>(next);
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    for (int j = 0; j < NB * kStep * int(sizeof(T)); j += 64)
      _mm_prefetch(pf + k * NB * sizeof(T) + j, _MM_HINT_T0);
    V xv[MB];
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) vload(xv[m], x + m * ldx + k);
    #pragma GCC unroll 16
    for (int r = 0; r < NB; ++r) {
      V wv;
      vload(wv, w + r * ldw + k);
      #pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) vfma(wv, xv[m], acc[r][m]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < NB; ++r)
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      float s = vsum(acc[r][m]);
      for (int64_t t = k; t < K; ++t) s += to_f32(w[r * ldw + t]) * x[m * ldx + t];
      out[r][m] = s;
    }
}

// bf16 weights take bf16 activations: each call rounds its activation rows once (to nearest even, like
// torch's .bfloat16()) and the products accumulate in fp32. With AVX512_BF16 a dpbf16 instruction does 16
// multiply-adds where an fp32 FMA does 8; elsewhere the rounded activations stay fp32 and the weights are
// widened exactly, so both builds compute the same products (summed in another order).
inline uint32_t bf16_round_bits(uint32_t b) { return b + 0x7FFFu + ((b >> 16) & 1u); }

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
  using B = typename Bf16Form<V>::type;
  constexpr int step = 2 * kStep;
  V acc[NB][MB];
  #pragma GCC unroll 16
  for (int r = 0; r < NB; ++r)
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) vzero(acc[r][m]);
  const char* pf = static_cast<const char*>(next);
  int64_t k = 0;
  for (; k + step <= K; k += step) {
    for (int j = 0; j < NB * step * 2; j += 64) _mm_prefetch(pf + k * NB * 2 + j, _MM_HINT_T0);
    B xv[MB];
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) vload(xv[m], x + m * K + k);
    #pragma GCC unroll 16
    for (int r = 0; r < NB; ++r) {
      B wv;
      vload(wv, w + r * K + k);
      #pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) vdot(wv, xv[m], acc[r][m]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < NB; ++r)
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      float s = vsum(acc[r][m]);
      for (int64_t t = k; t < K; ++t) s += to_f32(w[r * K + t]) * to_f32(x[m * K + t]);
      out[r][m] = s;
    }
}
#else
using Bf16Activation = float;

// x [M, K] fp32 (row stride ldx) -> xr [M, K] fp32 holding the bf16-rounded values.
inline void round_rows_bf16(const float* x, int64_t M, int64_t K, int64_t ldx, float* xr) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF),
                high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * ldx;
    float* o = xr + m * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256i b = _mm256_castps_si256(_mm256_loadu_ps(xm + k));
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
      const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(b, bias), odd), high);
      _mm256_storeu_ps(o + k, _mm256_castsi256_ps(r));
    }
    for (; k < K; ++k) {
      uint32_t b;
      memcpy(&b, xm + k, sizeof b);
      b = bf16_round_bits(b) & 0xFFFF0000u;
      memcpy(o + k, &b, sizeof b);
    }
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

inline void izero(NarrowInt& a) {
  #pragma GCC unroll 16
  for (auto& h : a.h) h = _mm256_setzero_si256();
}
inline void iload(NarrowInt& a, const int16_t* p) {
  #pragma GCC unroll 16
  for (int i = 0; i < kStep / 8; ++i) a.h[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * i));
}
inline void iload(NarrowInt& a, const int8_t* p) {
  #pragma GCC unroll 16
  for (int i = 0; i < kStep / 8; ++i)
    a.h[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i)));
}
inline void idot(const NarrowInt& w, const NarrowInt& x, NarrowInt& acc) {
  #pragma GCC unroll 16
  for (int i = 0; i < kStep / 8; ++i) {
#if defined(__AVX512VNNI__)
    // NOTE: written as asm because GCC 12 spilled every accumulator of the intrinsic's form to the stack
    // (1.5-2x slower blocks); the asm's tied operand keeps them in registers, and the activations may stay in
    // L1 for the instruction to read (int4 tiles rely on that to hold more accumulators).
    asm("vpdpwssd %2, %1, %0" : "+v"(acc.h[i]) : "v"(w.h[i]), "vm"(x.h[i]));
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
inline void izero(WideInt& a) { a.v = _mm512_setzero_si512(); }
inline void iload(WideInt& a, const int16_t* p) { a.v = _mm512_loadu_si512(p); }
inline void iload(WideInt& a, const int8_t* p) {
  a.v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void idot(const WideInt& w, const WideInt& x, WideInt& acc) {
#if defined(__AVX512VNNI__)
  asm("vpdpwssd %2, %1, %0" : "+v"(acc.v) : "v"(w.v), "vm"(x.v));  // asm: see the Narrow form
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
  const char* pf = static_cast<const char*>(next);
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) out[r][m] = 0;
  const int64_t vec_end = K / step * step;
  for (int64_t k0 = 0; k0 < vec_end; k0 += kActSpan) {
    const int64_t k1 = k0 + kActSpan < vec_end ? k0 + kActSpan : vec_end;
    I acc[NB][MB];
    #pragma GCC unroll 16
    for (int r = 0; r < NB; ++r)
      #pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) izero(acc[r][m]);
    for (int64_t k = k0; k < k1; k += step) {
      for (int j = 0; j < NB * step; j += 64) _mm_prefetch(pf + k * NB + j, _MM_HINT_T0);
      I xv[MB];
      #pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) iload(xv[m], x + m * K + k);
      #pragma GCC unroll 16
      for (int r = 0; r < NB; ++r) {
        I wv;
        iload(wv, w + r * K + k);
        #pragma GCC unroll 16
        for (int m = 0; m < MB; ++m) idot(wv, xv[m], acc[r][m]);
      }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < NB; ++r)
      #pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) out[r][m] += isum(acc[r][m]);
  }
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m)
      for (int64_t t = vec_end; t < K; ++t) out[r][m] += int64_t{w[r * K + t]} * x[m * K + t];
}

// Whether the int4 kernels can walk a layer: a k-step's halves of 32 levels each lie in one group (group size 32
// or a multiple of 64), and two levels share a byte.
inline bool int4_shape_ok(int64_t gs, int64_t K) { return gs > 0 && (gs == 32 || gs % 64 == 0) && K % 2 == 0; }

// Groups per row of K weights (the last one may be short).
inline int64_t int4_groups(int64_t K, int64_t gs) { return (K + gs - 1) / gs; }

// int4 weights take the int16 activations too, as integer dots group by group. A k-step of kInt4Step levels
// is kStep / 8 halves of 32 levels (16 packed bytes): zero-extended to int16 words, a byte's low nibble is its
// even level and its high nibble (the word shifted right by 4) its odd one, so the activations are permuted to
// match (permute_int4_activations) and no shuffling is needed. Per group g the int32 lanes sum q * xq exactly;
// when a group ends they are added to fp32 lanes times the group's scale (both halves' scales: with group size
// 32 a step holds two groups), and the zero points come in through per-group activation sums:
//   y = xs * (sum_g s_g sum(q * xq) - sum_g s_g z_g sum(xq)).
constexpr int kInt4Halves = kStep / 8;
constexpr int64_t kInt4Step = 32 * kInt4Halves;
// Folds also every 512 steps: each int32 lane takes 4 products below 2^18 a step.
constexpr int64_t kInt4Span = 512 * kInt4Step;

// xq [K] (natural order) -> xp [K]: per k-step at k, half i's even levels xq[k + 32 i + 2 j] at xp[k + 16 i + j]
// and its odd ones at xp[k + 16 kInt4Halves + 16 i + j] (j < 16); levels past the last whole step stay out.
inline void permute_int4_activations(const int16_t* xq, int64_t K, int16_t* xp) {
  for (int64_t k = 0; k + kInt4Step <= K; k += kInt4Step)
    for (int i = 0; i < kInt4Halves; ++i) {
      // A word pair (even, odd) per 32-bit lane: the even words sign-extended from the low halves, the odd
      // ones from the high; packing interleaves 128-bit lanes, which the 64-bit permute puts back in order.
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k + 32 * i));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k + 32 * i + 16));
      const __m256i even = _mm256_packs_epi32(_mm256_srai_epi32(_mm256_slli_epi32(a, 16), 16),
                                              _mm256_srai_epi32(_mm256_slli_epi32(b, 16), 16));
      const __m256i odd = _mm256_packs_epi32(_mm256_srai_epi32(a, 16), _mm256_srai_epi32(b, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xp + k + 16 * i), _mm256_permute4x64_epi64(even, 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xp + k + 16 * kInt4Halves + 16 * i),
                          _mm256_permute4x64_epi64(odd, 0xD8));
    }
}

// The sum of n int16 levels.
inline int32_t sum_levels(const int16_t* x, int64_t n) {
  __m256i acc = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16)
    acc = _mm256_add_epi32(
        acc, _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k)), _mm256_set1_epi16(1)));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  int32_t total = _mm_cvtsi128_si32(s);
  for (; k < n; ++k) total += x[k];
  return total;
}

// Activation rows for the int4 kernels (prepare_int4_activations), each [M, ...].
struct Int4Activations {
  const float* xs;      // [M] scales
  int32_t* xsum;        // [M, G] sums of each group's levels
  int16_t* xq;          // [M, K] levels
  int16_t* xp;          // [M, K] levels permuted for the k-steps
};

// A k-step's packed weights (kInt4Halves x 16 bytes at p) -> its even and odd levels as int16 words.
inline void iload_nibbles(NarrowInt& even, NarrowInt& odd, const uint8_t* p) {
  const __m256i low = _mm256_set1_epi16(0x0F);
  #pragma GCC unroll 16
  for (int i = 0; i < kInt4Halves; ++i) {
    const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i)));
    even.h[i] = _mm256_and_si256(words, low);
    odd.h[i] = _mm256_srli_epi16(words, 4);
  }
}

// acc += lanes * the scale of their half (s[i] for half i).
inline void ifold(const NarrowInt& lanes, const float* s, Narrow& acc) {
  #pragma GCC unroll 16
  for (int i = 0; i < kInt4Halves; ++i)
    acc.h[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes.h[i]), _mm256_set1_ps(s[i]), acc.h[i]);
}

#if defined(__AVX512F__)
inline void iload_nibbles(WideInt& even, WideInt& odd, const uint8_t* p) {
  const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  even.v = _mm512_and_si512(words, _mm512_set1_epi16(0x0F));
  odd.v = _mm512_srli_epi16(words, 4);
}
inline void ifold(const WideInt& lanes, const float* s, Wide& acc) {  // lanes 0-7: half 0, 8-15: half 1
  const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(s[0]), _mm256_set1_ps(s[1]), 1);
  acc.v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes.v), sv, acc.v);
}
#endif

// Vector registers the int4 register tiles may fill.
#if defined(__AVX512F__)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif
// Weight rows an int4 register tile takes with MB activation rows: its integer and fp32 accumulators and the
// weights' even, odd and loaded words, in 3/4 of the registers (V's width each, a Narrow one counting its
// halves; the activations are read from L1 by the dot instructions). Filling all of them made GCC spill
// accumulators: 6-row blocks ran 1.5x slower (3072x576 and 576x1536, one thread, Zen 5).
template <typename V, int NB, int MB>
constexpr int int4_tile_rows() {
  constexpr int width = std::is_same_v<V, Narrow> ? kStep / 8 : 1;
  int rb = NB;
  while (rb > 1 && ((2 * rb * MB + 3) * width > kVectorRegisters * 3 / 4 || NB % rb != 0)) --rb;
  return rb;
}

// sum_g s_g sum(q * xq) over the whole k-steps of RB weight rows (packed, row stride K / 2) and MB activation
// rows (xp: permuted, row stride K), into sums[RB][MB].
template <typename V, int RB, int MB>
inline void int4_step_sums(const int16_t* xp, const uint8_t* w, const float* scales, int64_t G, int64_t K,
                           int64_t gs, const char* next, float sums[][MB]) {
  using I = typename IntForm<V>::type;
  const int64_t ldw = K / 2, vec_end = K / kInt4Step * kInt4Step;
  V acc[RB][MB];
  I lanes[RB][MB];
  for (int r = 0; r < RB; ++r)
    for (int m = 0; m < MB; ++m) {
      vzero(acc[r][m]);
      izero(lanes[r][m]);
    }
  // Where the lanes next go into acc: the end of the group that starts the coming step, of a span, or of the
  // steps (a step's halves both lie in that group or, with group size 32, each ends its own).
  auto fold_after = [&](int64_t k) {
    const int64_t group_end = (k / gs + 1) * gs, span_end = k + kInt4Span;
    const int64_t end = group_end < span_end ? group_end : span_end;
    return end < vec_end ? end : vec_end;
  };
  int64_t fold_at = fold_after(0);
  for (int64_t k = 0; k < vec_end; k += kInt4Step) {
    for (int j = 0; j < RB * kInt4Step / 2; j += 64) _mm_prefetch(next + k / 2 * RB + j, _MM_HINT_T0);
    I xe[MB], xo[MB];
    #pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      iload(xe[m], xp + m * K + k);
      iload(xo[m], xp + m * K + k + 16 * kInt4Halves);
    }
    #pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      I we, wo;
      iload_nibbles(we, wo, w + r * ldw + k / 2);
      #pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        idot(we, xe[m], lanes[r][m]);
        idot(wo, xo[m], lanes[r][m]);
      }
    }
    if (k + kInt4Step < fold_at) continue;
    fold_at = fold_after(k + kInt4Step);
    for (int r = 0; r < RB; ++r) {
      float s[kInt4Halves];
      for (int i = 0; i < kInt4Halves; ++i) s[i] = scales[r * G + (k + 32 * i) / gs];
      for (int m = 0; m < MB; ++m) {
        ifold(lanes[r][m], s, acc[r][m]);
        izero(lanes[r][m]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int m = 0; m < MB; ++m) sums[r][m] = vsum(acc[r][m]);
}

// One packed row's level at k.
inline int nibble(const uint8_t* row, int64_t k) { return (row[k >> 1] >> ((k & 1) * 4)) & 0x0F; }

// NB packed weight rows against MB activation rows, all of K: the step sums plus the levels past the last
// whole step, minus the zero points' terms, in units of the rows' activation scales.
template <typename V, int NB, int MB>
inline void int4_block(const int16_t* xq, const int16_t* xp, const int32_t* xsum, int64_t G, const uint8_t* w,
                       const float* scales, const float* zeros, int64_t K, int64_t gs, float out[NB][MB]) {
  constexpr int RB = int4_tile_rows<V, NB, MB>();
  const int64_t ldw = K / 2, vec_end = K / kInt4Step * kInt4Step;
  const char* next = reinterpret_cast<const char*>(w + NB * ldw);
  for (int r0 = 0; r0 < NB; r0 += RB)
    int4_step_sums<V, RB, MB>(xp, w + r0 * ldw, scales + r0 * G, G, K, gs, next + r0 * ldw, out + r0);
  for (int r = 0; r < NB; ++r)
    for (int m = 0; m < MB; ++m) {
      float sum = out[r][m];
      for (int64_t k = vec_end; k < K; ++k)
        sum += scales[r * G + k / gs] * static_cast<float>(nibble(w + r * ldw, k) * xq[m * K + k]);
      for (int64_t g = 0; g < G; ++g)
        sum -= scales[r * G + g] * zeros[r * G + g] * static_cast<float>(xsum[m * G + g]);
      out[r][m] = sum;
    }
}

// One packed row -> fp32 in K order, computed as (q - z) * s like dequantize_int4 in primitives.py.
inline void dequant_int4_row(const uint8_t* w, const float* scales, const float* zeros, int64_t K, int64_t gs,
                             const void* next, float* out) {
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
        _mm512_storeu_ps(out + k + 16 * i, _mm512_mul_ps(_mm512_sub_ps(q, zv), sv));
      }
#else
      const __m128i parts[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
      for (int i = 0; i < 4; ++i) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        _mm256_storeu_ps(out + k + 8 * i, _mm256_mul_ps(_mm256_sub_ps(q, zv), sv));
      }
#endif
    }
    for (; k < g1; ++k) out[k] = (nibble(w, k) - z) * s;
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

// int4 weights against activation rows prepared by prepare_int4_activations (this thread's copy).
struct Int4 {
  const uint8_t* w;
  const float* scales;
  const float* zeros;
  const Int4Activations* x;
  int64_t gs, G;
  template <int NB>
  void prepare(const Problem&, int64_t) const {}
  template <typename V, int NB, int MB>
  void block(const Problem& p, int64_t n0, int64_t m0, float out[NB][MB]) const {
    int4_block<V, NB, MB>(x->xq + m0 * p.K, x->xp + m0 * p.K, x->xsum + m0 * G, G, w + n0 * (p.K / 2),
                          scales + n0 * G, zeros + n0 * G, p.K, gs, out);
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m) out[r][m] *= x->xs[m0 + m];
  }
  float scale(int64_t) const { return 1.0f; }
};

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

// Floats of scratch prepare_int4_activations needs for M rows.
inline int64_t int4_activation_floats(int64_t M, int64_t K, int64_t G) { return M + M * G + M * K; }

// The activation rows as the int4 kernels read them, laid out in `scratch` (int4_activation_floats): int16
// levels and scales (quantize_rows_int16), the levels permuted for the k-steps and their per-group sums.
inline Int4Activations prepare_int4_activations(const Problem& p, int64_t gs, int64_t G, float* scratch) {
  const int64_t M = p.M, K = p.K;
  Int4Activations a{scratch, reinterpret_cast<int32_t*>(scratch + M),
                    reinterpret_cast<int16_t*>(scratch + M + M * G), nullptr};
  a.xp = a.xq + M * K;
  quantize_rows_int16(p.x, M, K, p.ldx, a.xq, scratch);
  for (int64_t m = 0; m < M; ++m) {
    const int16_t* xq = a.xq + m * K;
    permute_int4_activations(xq, K, a.xp + m * K);
    for (int64_t g = 0; g < G; ++g) a.xsum[m * G + g] = sum_levels(xq + g * gs, (g + 1) * gs < K ? gs : K - g * gs);
  }
  return a;
}

}  // namespace llmp
