// Exact greedy argmax of the lm_head screened through an int8 copy of its weight (greedy_head.cpp).
#pragma once

#include <stdint.h>

namespace llmp {

// out[r] = argmax_v x[r] . weight[v] (the first maximum on ties), for x [R, K], weight [V, K] fp32 (or bf16 with
// `bf16_weight`, widened exactly: the same logits) and its int8
// copy qweight [V, K] with per-row scales [V]; error_per_l1[v] * ||x[r]||_1 + error_per_level[v] * (the row's
// int16 activation step) bounds the error of token v's approximate logit (and of the fp32 one).
void greedy_argmax_int8(const float* x, int64_t R, int64_t K, const int8_t* qweight, const float* scales,
                        const void* weight, bool bf16_weight, int64_t V, const float* error_per_l1, const float* error_per_level,
                        int num_threads, int64_t* out);

}  // namespace llmp
