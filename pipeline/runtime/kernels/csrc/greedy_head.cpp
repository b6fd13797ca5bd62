// Exact greedy argmax of x @ W.T for the lm_head, reading mostly an int8 copy of W (see
// pipeline/runtime/model/greedy_head.py for the error bound): approximate logits from the int8 rows for the whole
// vocabulary, then exact fp32 logits only for the tokens whose approximation lies within the bound of the best.
// One call instead of ~12 torch ops, and no [rows, vocab] tensors beyond the approximate logits.
#include "greedy_head.h"

#include <memory>

#include "gemm_blocks.h"

extern "C" int llmp_gemm_int8(const float* x, int64_t M, int64_t K, int64_t ldx, const int8_t* w,
                              const float* scales, const float* bias, float* y, int64_t N, bool int8_activations,
                              int num_threads);

namespace llmp {

int greedy_argmax_int8(const float* x, int64_t R, int64_t K, const int8_t* qweight, const float* scales,
                       const void* weight, bool widened_bf16, int64_t V, const float* error_per_l1,
                       const float* error_per_level, int num_threads, int64_t* out) {
  const std::unique_ptr<float[]> approx(new float[R * V]);
  if (llmp_gemm_int8(x, R, K, K, qweight, scales, nullptr, approx.get(), V, false, num_threads) != 0) return -1;

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
    // Token v's exact logit lies within a[v] -+ error(v); it can be the argmax only if its upper bound reaches
    // the best lower bound.
    float best_lower = a[0] - error(0);
    for (int64_t v = 1; v < V; ++v) {
      const float lower = a[v] - error(v);
      best_lower = lower > best_lower ? lower : best_lower;
    }
    int64_t best = -1;
    float best_logit = 0.0f;
    for (int64_t v = 0; v < V; ++v) {
      if (a[v] + error(v) < best_lower) continue;
      // NOTE: dense_block's per-row summation order depends neither on its block shape nor on its vector form,
      // so this equals the logit gemm_f32 computes for the same row (the sampling path's logits) bit for bit.
      float logit[1][1];
      if (widened_bf16) {
        const bf16* w = static_cast<const bf16*>(weight) + v * K;
        dense_block<Narrow, bf16, 1, 1>(xr, K, w, K, K, w, logit);
      } else {
        const float* w = static_cast<const float*>(weight) + v * K;
        dense_block<Narrow, float, 1, 1>(xr, K, w, K, K, w, logit);
      }
      if (best < 0 || logit[0][0] > best_logit) best = v, best_logit = logit[0][0];  // first maximum on ties
    }
    out[r] = best;
  }
  return 0;
}

}  // namespace llmp
