// Residual add + RMSNorm for the CPU runtime (rms_norm.cpp).
#pragma once

#include <stdint.h>

namespace llmp {

// hidden [T, H] += delta [T, H] (skipped when delta is null), then
// out [T, H] = (hidden * 1 / sqrt(mean(hidden^2) + eps)) * weight, in HF's order of operations.
// Contiguous fp32 rows.
void add_rms_norm(float* hidden, const float* delta, const float* weight, float* out, int64_t T, int64_t H,
                  float eps);

}  // namespace llmp
