// Exact greedy argmax of x @ W.T for the lm_head, reading mostly an int8 copy of W (see
// pipeline/runtime/model/greedy_head.py for the error bound): approximate logits from the int8 rows for the whole
// vocabulary, then exact fp32 logits only for the tokens whose approximation lies within the bound of the best.
// One call instead of ~12 torch ops, and no [rows, vocab] tensors beyond the approximate logits.
#include "greedy_head.h"

#include <math.h>

#include <memory>

#include "gemm_blocks.h"

extern "C" int llmp_gemm_int8(const float* x, int64_t M, int64_t K, int64_t ldx, const int8_t* w,
                              const float* scales, const int64_t* byte_bias, const float* bias, float* y, int64_t N,
                              bool int8_activations, int num_threads);

namespace llmp {
namespace {

// The largest of v's lanes (none is NaN: max_ps never keeps a NaN it is given first).
float hmax(__m256 v) {
  const __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 n = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(n, _mm_shuffle_ps(n, n, 1)));
}

}  // namespace

int greedy_argmax_int8(const float* x, int64_t R, int64_t K, const int8_t* qweight, const float* scales,
                       const void* weight, bool widened_bf16, int64_t V, const float* error_per_l1,
                       const float* error_per_level, int num_threads, int64_t* out) {
  const std::unique_ptr<float[]> approx(new float[R * V]);
  if (llmp_gemm_int8(x, R, K, K, qweight, scales, nullptr, nullptr, approx.get(), V, false, num_threads) != 0)
    return -1;

  // Rows are independent: with several (batched decode) their scans and exact logits split across the team
  // instead of running on one thread while the others wait (16 rows of SmolLM2: ~1 ms a step on one thread).
#pragma omp parallel for num_threads(num_threads) schedule(static) if (R > 1 && num_threads > 1)
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * K;
    const float* a = approx.get() + r * V;
    float l1 = 0.0f, amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      l1 += fabsf(xr[k]);
      amax = fmaxf(amax, fabsf(xr[k]));
    }
    const float step = act_scale(amax, kActQMax);  // the screen's activation levels (quantize_rows_int16)
    const auto error = [&](int64_t v) { return l1 * error_per_l1[v] + step * error_per_level[v]; };
    // Both scans go eight tokens at a time, the last few one by one, and a token gets the same bound in both.
    // One token at a time, they took 0.66 of the 1.58 ms that SmolLM2's head took for 16 rows
    // (scripts/bench_kernels.py ab).
    const __m256 l1s = _mm256_set1_ps(l1), steps = _mm256_set1_ps(step);
    const auto error8 = [&](int64_t v) {
      return _mm256_fmadd_ps(l1s, _mm256_loadu_ps(error_per_l1 + v),
                             _mm256_mul_ps(steps, _mm256_loadu_ps(error_per_level + v)));
    };
    const int64_t V8 = V / 8 * 8;
    // Token v's exact logit lies within a[v] -+ error(v); it can be the argmax only if its upper bound reaches
    // the best lower bound. A NaN bound is never the best one (max_ps returns its second operand then).
    __m256 lowers = _mm256_set1_ps(-INFINITY);
    for (int64_t v = 0; v < V8; v += 8)
      lowers = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(a + v), error8(v)), lowers);
    float best_lower = hmax(lowers);
    for (int64_t v = V8; v < V; ++v) {
      const float lower = a[v] - error(v);
      best_lower = lower > best_lower ? lower : best_lower;
    }
    int64_t best = -1;
    float best_logit = 0.0f;
    const auto consider = [&](int64_t v) {
      // NOTE: dense_block's per-row summation order depends neither on its block shape nor on its vector form,
      // so this equals the logit gemm_f32 computes for the same row (the sampling path's logits) bit for bit,
      // except for a widened bf16 head on AMX tiles (TilesWidened), which sums the same products in another
      // order: there a near tie (~1e-7 relative) may go the other way than in the logits.
      float logit[1][1];
      if (widened_bf16) {
        const bf16* w = static_cast<const bf16*>(weight) + v * K;
        dense_block<Narrow, bf16, 1, 1>(xr, K, w, K, K, w, logit);
      } else {
        const float* w = static_cast<const float*>(weight) + v * K;
        dense_block<Narrow, float, 1, 1>(xr, K, w, K, K, w, logit);
      }
      if (best < 0 || logit[0][0] > best_logit) best = v, best_logit = logit[0][0];  // first maximum on ties
    };
    const __m256 reach = _mm256_set1_ps(best_lower);
    for (int64_t v = 0; v < V8; v += 8) {  // candidates ascending, so ties keep the first maximum
      const __m256 upper = _mm256_add_ps(_mm256_loadu_ps(a + v), error8(v));
      for (unsigned m = _mm256_movemask_ps(_mm256_cmp_ps(upper, reach, _CMP_NLT_UQ)); m != 0; m &= m - 1)
        consider(v + __builtin_ctz(m));
    }
    for (int64_t v = V8; v < V; ++v)
      if (!(a[v] + error(v) < best_lower)) consider(v);
    out[r] = best;
  }
  return 0;
}

}  // namespace llmp
