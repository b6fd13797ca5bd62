// Exact greedy argmax of the lm_head screened through an int8 copy of its weight (greedy_head.cpp).
#pragma once

#include <stdint.h>

namespace llmp {

// out[r] = argmax_v x[r] . weight[v] (the first maximum on ties), for x [R, K] and weight [V, K] fp32 (bf16
// with `widened_bf16`, read widened exactly: the same logits), screened through its int8 copy qweight [V, K]
// with per-row scales [V]; error_per_l1[v] * ||x[r]||_1 + error_per_level[v] * (the row's int16 activation
// step) bounds the error of token v's approximate logit (and of the fp32 one). Returns 0, or -1 when scratch
// memory cannot be had (out untouched).
int greedy_argmax_int8(const float* x, int64_t R, int64_t K, const int8_t* qweight, const float* scales,
                       const void* weight, bool widened_bf16, int64_t V, const float* error_per_l1,
                       const float* error_per_level, int num_threads, int64_t* out);

}  // namespace llmp
