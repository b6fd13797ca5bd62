// Paged attention for the CPU runtime: RoPE, KV-cache writes and causal attention over the paged cache for
// a flattened batch of tokens (prefill chunks and decode tokens mixed), in one call per layer.
//
// Called by the llmpipe_quant.paged_attention op (torch_ops.cpp), which checks the tensors' dtypes, shapes and
// contiguity. All tensors are row-major and fp32 unless said otherwise:
//   qkv       [T, qkv_stride]: per token H query heads, then KV key heads, then KV value heads, each D wide;
//             the query and key heads are rotated in place.
//   cos_sin   [max_positions, D]: cos(pos * inv_freq) in the first D/2 columns, sin in the last D/2.
//   positions [T] int64, slots [T] int64 (cache row of each token: block * block_size + offset).
//   k_cache, v_cache [num_blocks * block_size, KV, D]: fp32, int8 or bf16 (`kind`; bf16 as uint16 bit
//             patterns, written rounded to nearest even like torch's .bfloat16()).
//   k_scales, v_scales [num_blocks * block_size, KV] fp32 for an int8 cache, else null: its per-token, per-head
//             scales (symmetric: value = q * scale, scale = max|x| / 127 over the head's D values, never
//             below FLT_MIN; q = round-half-even(x / scale)). runtime/kv_quant.py is the same format in torch.
//   block_tables [num_seqs, bt_stride] int32, token_seq [T] int32 (which block table a token uses).
//   out       [T, H * D].
// Token t attends to positions max(0, pos - window + 1) .. pos of its sequence (window 0 = no window);
// query head h reads key/value head h / (H / KV), as in HF's repeat_kv. With softcap > 0 each score s becomes
// softcap * tanh(s / softcap) before the softmax, as in HF's Gemma 2 eager attention.
//
// NOTE: written with GCC vector extensions (8 floats; the products of head dimensions 64 and 128 in 16 where
// the build has AVX-512, see Lanes16), AVX2 intrinsics only where GCC's vectors fall short (see widen8); D must
// be a multiple of 8 (the Python side checks and otherwise uses the torch path). Block
// tables, slots and positions are not bounds-checked here: the runner checks them once per step, not once per
// layer. int8 cache values are widened to floats on read;
// their scales are applied once per key (to its score) and once per value (to its softmax weight), never
// per element. bf16 cache values widen to floats exactly.
// Threads: OpenMP over (token, kv head). libgomp has the soname torch already loaded, so these parallel
// regions reuse torch's thread team rather than adding a second set of spinning threads.
#include "paged_attention.h"

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <initializer_list>

#include "prefetch.h"
#include "vec8.h"

namespace llmp {
namespace {

using namespace vec8;

constexpr float kNegBig = -3.0e38f;
constexpr int kMaxGroupHeads = 4;  // query heads per attend_heads call; larger groups go in near-equal parts

// 8 int8 values as floats. NOTE: GCC 12 lowers __builtin_convertvector from 8 x int8 to 8 scalar
// conversions, so this spells out the two-instruction widening.
inline v8f widen8(const int8_t* p) {
  return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
// 8 bf16 values as floats: the bits go to the top half of each float.
inline v8f widen8_bf16(const uint16_t* p) {
  return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
}
// 8 cache values from element index i of a cache of `kind`, as floats (int8: not yet scaled).
inline v8f load_cache8(const void* cache, int64_t i, const CacheKind kind) {
  if (kind == kCacheInt8) return widen8((const int8_t*)cache + i);
  if (kind == kCacheBF16) return widen8_bf16((const uint16_t*)cache + i);
  return load8((const float*)cache + i);
}

// The vectors attend_heads multiplies queries with keys and weights with values in: 8 floats, or 16 where the
// build has AVX-512 (half the instructions per head dimension; a 16-sequence decode step's attention over 128
// positions with its bf16 cache in L3 1.25x, a 2048-token prefill chunk 1.17x; fp32 caches, bound by their
// reads, unchanged). `fold` halves a vector to 8 lanes (lane i + lane i + 8) for the 8-lane key sums, so each
// score is summed in one fixed order for a given build.
struct Lanes8 {
  static constexpr int kWidth = 8;
  typedef v8f V;
  static V load(const float* p) { return load8(p); }
  static void store(float* p, V v) { store8(p, v); }
  static V splat(float x) { return splat8(x); }
  static V cache(const void* c, int64_t i, CacheKind kind) { return load_cache8(c, i, kind); }
  static v8f fold(V v) { return v; }
};
#if defined(__AVX512F__)
struct Lanes16 {
  static constexpr int kWidth = 16;
  typedef float V __attribute__((vector_size(64)));
  static V load(const float* p) { return (V)_mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, (__m512)v); }
  static V splat(float x) { return (V)_mm512_set1_ps(x); }
  static V cache(const void* c, int64_t i, CacheKind kind) {
    if (kind == kCacheInt8)
      return (V)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)c + i))));
    if (kind == kCacheBF16)
      return (V)_mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)c + i))), 16));
    return load((const float*)c + i);
  }
  static v8f fold(V v) {
    const __m512 x = (__m512)v;
    return (v8f)_mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
  }
};
using WideLanes = Lanes16;
#else
using WideLanes = Lanes8;
#endif

// One head's D values into the bf16 cache, rounded to nearest even (finite values; RoPE'd K and V are).
void store_head_bf16(const float* x, int64_t D, uint16_t* out) {
  for (int64_t i = 0; i < D; ++i) {
    uint32_t b;
    memcpy(&b, x + i, sizeof b);
    out[i] = (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  }
}

// e^x for x <= 0 (softmax after subtracting the max): Cody-Waite range reduction x = n ln2 + r, a degree-6
// polynomial for e^r (Cephes expf coefficients, ~1 ulp), then 2^n through the exponent bits.
// Inputs below -87 give 0 (e^-87 is below float's normal range).
inline v8f exp8_nonpositive(v8f x) {
  const v8i keep = x > splat8(-87.0f);
  x = (v8f)((v8i)x & keep);  // clamp the dropped lanes to 0 so the arithmetic below stays finite
  // convertvector truncates toward zero, so for y = x log2(e) <= 0, trunc(y - 0.5) = ceil(y - 0.5): the
  // integer nearest to y, leaving |r| <= ln2 / 2.
  const v8f n = __builtin_convertvector(__builtin_convertvector(x * splat8(1.44269504088896341f) - splat8(0.5f), v8i), v8f);
  v8f r = x - n * splat8(0.693359375f);
  r = r - n * splat8(-2.12194440e-4f);
  v8f p = splat8(1.9875691500e-4f);
  p = p * r + splat8(1.3981999507e-3f);
  p = p * r + splat8(8.3334519073e-3f);
  p = p * r + splat8(4.1665795894e-2f);
  p = p * r + splat8(1.6666665459e-1f);
  p = p * r + splat8(5.0000001201e-1f);
  const v8f y = p * r * r + r + splat8(1.0f);
  const v8i scale = (__builtin_convertvector(n, v8i) + 127) << 23;
  return (v8f)((v8i)(y * (v8f)scale) & keep);
}

// tanh(x) to ~2 ulp (Cephes tanhf): an odd polynomial below |x| = 0.625, else (1 - e) / (1 + e) with
// e = e^(-2 |x|) <= 0.29, which has no cancellation; the sign is put back last.
inline v8f tanh8(v8f x) {
  const v8i sign = (v8i)x & splat8i(INT32_MIN);
  const v8f a = (v8f)((v8i)x ^ sign);
  const v8f z = a * a;
  v8f p = splat8(-5.70498872745e-3f);
  p = p * z + splat8(2.06390887954e-2f);
  p = p * z + splat8(-5.37397155531e-2f);
  p = p * z + splat8(1.33314422036e-1f);
  p = p * z + splat8(-3.33332819422e-1f);
  const v8f small = p * z * a + a;
  const v8f e = exp8_nonpositive(splat8(-2.0f) * a);
  const v8f large = (splat8(1.0f) - e) / (splat8(1.0f) + e);
  const v8i use_small = a < splat8(0.625f);
  return (v8f)(((v8i)small & use_small) | ((v8i)large & ~use_small) | sign);
}

// scores[0 .. n - 1] = softcap * tanh(scores / softcap), in HF's order; returns their maximum.
float softcap_scores(float* scores, int64_t n, float softcap) {
  const v8f cap = splat8(softcap);
  v8f vmax = splat8(kNegBig);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8f s = tanh8(load8(scores + j) / cap) * cap;
    store8(scores + j, s);
    vmax = vmax > s ? vmax : s;
  }
  float row_max = kNegBig;
  for (int64_t i = 0; i < 8; ++i) row_max = vmax[i] > row_max ? vmax[i] : row_max;
  for (; j < n; ++j) {
    scores[j] = tanhf(scores[j] / softcap) * softcap;
    row_max = scores[j] > row_max ? scores[j] : row_max;
  }
  return row_max;
}

// One head's D values into int8 q and its scale (the format described at the top).
void quantize_head(const float* x, int64_t D, int8_t* q, float* scale) {
  float amax = 0.0f;
  for (int64_t i = 0; i < D; ++i) {
    const float a = x[i] < 0 ? -x[i] : x[i];
    amax = a > amax ? a : amax;
  }
  const float s = amax / 127.0f > FLT_MIN ? amax / 127.0f : FLT_MIN;
  for (int64_t i = 0; i < D; ++i) {
    const float r = __builtin_rintf(x[i] / s);
    q[i] = (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
  }
  *scale = s;
}

void rope_row(float* x, const float* cos_sin, int64_t half) {
  const float* c = cos_sin;
  const float* s = cos_sin + half;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * c[i] - b * s[i];
    x[i + half] = b * c[i] + a * s[i];
  }
}

// Lane i of the result = the sum of a[i]'s lanes, each as ((0+1)+(2+3)) + ((4+5)+(6+7)), for KB = 1, 2, 4 or 8
// vectors at once (fewer shuffles per sum the more there are); every key's score is summed in that one order.
template <int KB>
inline void sum_lanes(const v8f a[KB], float* out) {
  if constexpr (KB == 8) {
    const __m256 s01 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), s23 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    const __m256 s45 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), s67 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    // lanes 0-3: a[0..3]'s lanes 0-3 summed, lanes 4-7: their lanes 4-7 (likewise a[4..7])
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                        _mm256_permute2f128_ps(s0123, s4567, 0x31)));
  } else {
    const __m256 s01 = _mm256_hadd_ps((__m256)a[0], (__m256)a[KB > 1 ? 1 : 0]);
    const __m256 s23 = KB == 4 ? _mm256_hadd_ps((__m256)a[KB > 2 ? 2 : 0], (__m256)a[KB > 3 ? 3 : 0]) : s01;
    const __m256 s = _mm256_hadd_ps(s01, s23);  // half h, lane i < KB: a[i]'s lanes 4h .. 4h + 3 summed
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    float sums[4];
    _mm_storeu_ps(sums, t);
    for (int i = 0; i < KB; ++i) out[i] = sums[i];
  }
}

// Measured with 16 sequences of 540 tokens over 30 layers (bf16 cache, beyond L3): 2.2x the speed without.
constexpr int64_t kPrefetchBlocks = 2;

// Keys per block of the score loop, and value columns (in vectors of W floats) per pass of the value loop, for
// NH query heads: their accumulators, the heads' query (or softmax weight) vectors and one cache vector fill the
// 16 vector registers of AVX2, or the 32 of AVX-512.
#if defined(__AVX512F__)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif
template <int NH>
constexpr int keys_per_block() {
  for (int keys = 8; keys > 1; keys /= 2)
    if (NH * keys + NH + 2 <= kVectorRegisters || (NH == 1 && keys == 8)) return keys;
  return 1;
}
constexpr int64_t kMaxValueChunks = 16;  // the size of attend_heads' accumulator rows: D <= 128 in one pass
template <int NH, int W>
constexpr int value_chunks_per_pass(int64_t D) {
  const int64_t registers = (kVectorRegisters - NH - 2) / NH, chunks = D / W;
  const int64_t fit = registers < kMaxValueChunks ? registers : kMaxValueChunks;
  if (fit >= chunks) return int(chunks);
  for (int c = 8; c > 1; c /= 2)
    if (c <= fit && chunks % c == 0) return c;
  return 1;
}

// Attention of NH query heads (q: NH rows of D, back to back) that share kv head g of KV, over positions
// lo .. lo + n - 1 of a sequence whose cache rows come from `table`. scores: scratch of NH rows of n_stride
// floats (n rounded up to 8). kind: the cache's element type (kCacheInt8: with k_scales/v_scales).
// Each key and value vector is read and widened once for all NH heads (with the cache in L3, 16 sequences of
// 540 tokens: 1.3x the speed of one head at a time).
// NOTE: always_inline + the literal D, kind and NH of the callers below let GCC keep the accumulators in
// registers and drop the branches of the other cache types.
template <int NH, typename L>
inline __attribute__((always_inline)) void attend_heads(
    const float* q, const int64_t D, const void* k_cache, const void* v_cache, const float* k_scales,
    const float* v_scales, const CacheKind kind, int64_t KV, int64_t g, const int32_t* table, int64_t block_size,
    int64_t lo, int64_t n, float scale, float softcap, float* scores, int64_t n_stride, float* out) {
  constexpr int KB = keys_per_block<NH>(), W = L::kWidth;
  const int64_t row_stride = KV * D;
  const bool quant = kind == kCacheInt8;
  // Blocks of the sequence lie anywhere in the cache, so the hardware prefetchers cannot run ahead across them:
  // kv head g's K and V rows of block bn go to L2 while block bn - kPrefetchBlocks is read.
  const int64_t row_bytes = D * (kind == kCacheInt8 ? 1 : kind == kCacheBF16 ? 2 : 4);
  const auto prefetch_block = [&](int64_t bn) {
    const int64_t first = bn * block_size > lo ? bn * block_size : lo, end = lo + n;
    if (first >= end) return;
    const int64_t rows = (bn + 1) * block_size < end ? (bn + 1) * block_size - first : end - first;
    const int64_t offset = ((int64_t)table[bn] * block_size + first % block_size) * KV + g;
    for (const void* cache : {k_cache, v_cache}) {
      const char* row = (const char*)cache + offset * row_bytes;
      for (int64_t i = 0; i < rows; ++i, row += KV * row_bytes)
        for (int64_t b = 0; b < row_bytes; b += 64) prefetch_line<1>(row + b);
    }
  };
  for (int64_t bn = lo / block_size; bn < lo / block_size + kPrefetchBlocks; ++bn) prefetch_block(bn);
  for (int64_t j = 0; j < n;) {
    const int64_t pos = lo + j;
    const int64_t offset = pos % block_size;
    const int64_t run = (block_size - offset < n - j) ? block_size - offset : n - j;
    const int64_t head = ((int64_t)table[pos / block_size] * block_size + offset) * KV + g;  // (row, g)
    prefetch_block(pos / block_size + kPrefetchBlocks);
    int64_t k = head * D;  // element index of the key row in the cache
    int64_t r = 0;
    for (; r + KB <= run; r += KB, k += KB * row_stride) {
      typename L::V a[NH][KB];
      for (int h = 0; h < NH; ++h)
        for (int i = 0; i < KB; ++i) a[h][i] = L::splat(0.0f);
      for (int64_t d = 0; d < D / W; ++d) {
        typename L::V qd[NH];
        for (int h = 0; h < NH; ++h) qd[h] = L::load(q + h * D + W * d);
        for (int i = 0; i < KB; ++i) {
          const typename L::V kv = L::cache(k_cache, k + i * row_stride + W * d, kind);
          for (int h = 0; h < NH; ++h) a[h][i] += qd[h] * kv;
        }
      }
      for (int h = 0; h < NH; ++h) {
        v8f folded[KB];
        for (int i = 0; i < KB; ++i) folded[i] = L::fold(a[h][i]);
        sum_lanes<KB>(folded, scores + h * n_stride + j + r);
      }
    }
    for (; r < run; ++r, k += row_stride) {
      typename L::V a[NH];
      for (int h = 0; h < NH; ++h) a[h] = L::splat(0.0f);
      for (int64_t d = 0; d < D / W; ++d) {
        const typename L::V kv = L::cache(k_cache, k + W * d, kind);
        for (int h = 0; h < NH; ++h) a[h] += L::load(q + h * D + W * d) * kv;
      }
      for (int h = 0; h < NH; ++h) {
        const v8f folded[1] = {L::fold(a[h])};
        sum_lanes<1>(folded, scores + h * n_stride + j + r);
      }
    }
    for (int64_t i = 0; i < run; ++i)
      for (int h = 0; h < NH; ++h) {
        float& score = scores[h * n_stride + j + i];
        score *= scale;
        if (quant) score *= k_scales[head + i * KV];
      }
    j += run;
  }
  // Each head's softmax weights, unnormalized, in place; inv[h] = 1 / their sum.
  const int64_t n_pad = (n + 7) & ~(int64_t)7;
  float inv[NH];
  for (int h = 0; h < NH; ++h) {
    float* s = scores + h * n_stride;
    float row_max = kNegBig;
    if (softcap > 0) {
      row_max = softcap_scores(s, n, softcap);
    } else {
      for (int64_t j = 0; j < n; ++j) row_max = s[j] > row_max ? s[j] : row_max;
    }
    for (int64_t j = n; j < n_pad; ++j) s[j] = kNegBig;
    v8f sum = splat8(0.0f);
    const v8f m = splat8(row_max);
    for (int64_t j = 0; j < n_pad; j += 8) {
      const v8f e = exp8_nonpositive(load8(s + j) - m);
      store8(s + j, e);
      sum += e;
    }
    inv[h] = 1.0f / hsum8(sum);
  }
  const int DT = value_chunks_per_pass<NH, W>(D);
  for (int64_t d0 = 0; d0 < D / W; d0 += DT) {
    typename L::V acc[NH][kMaxValueChunks];
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < DT; ++c) acc[h][c] = L::splat(0.0f);
    for (int64_t j = 0; j < n;) {
      const int64_t pos = lo + j;
      const int64_t offset = pos % block_size;
      const int64_t run = (block_size - offset < n - j) ? block_size - offset : n - j;
      const int64_t head = ((int64_t)table[pos / block_size] * block_size + offset) * KV + g;
      int64_t v = head * D + W * d0;
      for (int64_t r = 0; r < run; ++r, v += row_stride) {
        const float vs = quant ? v_scales[head + r * KV] : 1.0f;
        typename L::V p[NH];
        for (int h = 0; h < NH; ++h) p[h] = L::splat(scores[h * n_stride + j + r] * vs);
        for (int c = 0; c < DT; ++c) {
          const typename L::V vv = L::cache(v_cache, v + W * c, kind);
          for (int h = 0; h < NH; ++h) acc[h][c] += p[h] * vv;
        }
      }
      j += run;
    }
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < DT; ++c) L::store(out + h * D + W * (d0 + c), acc[h][c] * L::splat(inv[h]));
  }
}

void attend_heads_any(int NH, const float* q, int64_t D, const void* k_cache, const void* v_cache,
                      const float* k_scales, const float* v_scales, CacheKind kind, int64_t KV, int64_t g,
                      const int32_t* table, int64_t block_size, int64_t lo, int64_t n, float scale, float softcap,
                      float* scores, int64_t n_stride, float* out) {
#define ATTEND(HEADS, LANES, DIM, KIND)                                                                       \
  attend_heads<HEADS, LANES>(q, DIM, k_cache, v_cache, k_scales, v_scales, KIND, KV, g, table, block_size, lo, n, \
                             scale, softcap, scores, n_stride, out)
#define ATTEND_KINDS(HEADS, LANES, DIM)                            \
  switch (kind) {                                                  \
    case kCacheInt8: ATTEND(HEADS, LANES, DIM, kCacheInt8); break; \
    case kCacheBF16: ATTEND(HEADS, LANES, DIM, kCacheBF16); break; \
    default: ATTEND(HEADS, LANES, DIM, kCacheF32);                 \
  }
#define ATTEND_DIMS(HEADS)                              \
  switch (D) {                                          \
    case 64: ATTEND_KINDS(HEADS, WideLanes, 64); break;   \
    case 128: ATTEND_KINDS(HEADS, WideLanes, 128); break; \
    default: ATTEND_KINDS(HEADS, Lanes8, D);              \
  }
  switch (NH) {
    case 1: ATTEND_DIMS(1); break;
    case 2: ATTEND_DIMS(2); break;
    case 3: ATTEND_DIMS(3); break;
    default: ATTEND_DIMS(kMaxGroupHeads); break;
  }
#undef ATTEND_DIMS
#undef ATTEND_KINDS
#undef ATTEND
}

}  // namespace

int paged_attention(float* qkv, int64_t qkv_stride, void* k_cache, void* v_cache, float* k_scales, float* v_scales,
                    CacheKind kind, float* out, const float* cos_sin, const int64_t* positions, const int64_t* slots,
                    const int32_t* block_tables, int64_t bt_stride, const int32_t* token_seq, int64_t T, int64_t H,
                    int64_t KV, int64_t D, int64_t block_size, int64_t window, int64_t max_context, float scale,
                    float softcap) {
  const int64_t G = H / KV;
  // RoPE on query and key heads, then the new keys and values into their cache rows.
#pragma omp parallel for if (T >= 32)
  for (int64_t t = 0; t < T; ++t) {
    float* row = qkv + t * qkv_stride;
    const float* cs = cos_sin + positions[t] * D;
    for (int64_t h = 0; h < H + KV; ++h) rope_row(row + h * D, cs, D / 2);
    const int64_t slot = slots[t];
    if (kind == kCacheInt8) {
      for (int64_t g = 0; g < KV; ++g) {
        quantize_head(row + (H + g) * D, D, (int8_t*)k_cache + (slot * KV + g) * D, k_scales + slot * KV + g);
        quantize_head(row + (H + KV + g) * D, D, (int8_t*)v_cache + (slot * KV + g) * D, v_scales + slot * KV + g);
      }
    } else if (kind == kCacheBF16) {
      store_head_bf16(row + H * D, KV * D, (uint16_t*)k_cache + slot * KV * D);
      store_head_bf16(row + (H + KV) * D, KV * D, (uint16_t*)v_cache + slot * KV * D);
    } else {
      memcpy((float*)k_cache + slot * KV * D, row + H * D, sizeof(float) * KV * D);
      memcpy((float*)v_cache + slot * KV * D, row + (H + KV) * D, sizeof(float) * KV * D);
    }
  }
  const int64_t n_pad_max = (max_context + 7) & ~(int64_t)7;
  int failed = 0;
#pragma omp parallel
  {
    float* scores = (float*)malloc(sizeof(float) * kMaxGroupHeads * n_pad_max);
    if (scores == nullptr) {
#pragma omp atomic write
      failed = 2;
    }
    // One item per (token, kv head): its G query heads read that head's K/V together.
    // With many tokens a thread takes all kv heads of a token at once: the heads' rows interleave in the
    // cache, so the lines one head's reads pull in (and prefetch) serve the next (measured 16 sequences x
    // 150 tokens, caches cold: -6 % per step); with few tokens, one item at a time keeps both threads busy.
#pragma omp for schedule(dynamic, T >= 8 ? KV : 1)
    for (int64_t item = 0; item < T * KV; ++item) {
      if (scores == nullptr) continue;
      const int64_t t = item / KV, g = item % KV;
      const int64_t pos = positions[t];
      const int64_t lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
      const int32_t* table = block_tables + (int64_t)token_seq[t] * bt_stride;
      const int64_t parts = (G + kMaxGroupHeads - 1) / kMaxGroupHeads;
      for (int64_t part = 0, h = g * G; part < parts; ++part) {
        const int64_t heads = (g + 1) * G - h;
        const int count = int(heads / (parts - part) + (heads % (parts - part) != 0));
        attend_heads_any(count, qkv + t * qkv_stride + h * D, D, k_cache, v_cache, k_scales, v_scales, kind, KV, g,
                         table, block_size, lo, pos + 1 - lo, scale, softcap, scores, n_pad_max,
                         out + t * H * D + h * D);
        h += count;
      }
    }
    free(scores);
  }
  return failed;
}

}  // namespace llmp
