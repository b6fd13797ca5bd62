// Argument checks shared by the torch op wrappers (torch_ops.cpp, decoder_plan.cpp): each raises a Python-visible
// error on a wrong dtype, device or shape, so no kernel reads out of bounds.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "gemm_blocks.h"

namespace llmp::torch_checks {

inline void expect(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.sizes() == shape && t.is_contiguous(), name,
              ": expected a contiguous CPU ", dtype, " tensor of shape ", shape, ", got ", t.scalar_type(), " ",
              t.sizes(), " on ", t.device(), t.is_contiguous() ? "" : " (non-contiguous)");
}

inline const float* bias_ptr(const std::optional<at::Tensor>& bias, int64_t N) {
  if (!bias) return nullptr;
  expect(*bias, at::kFloat, {N}, "bias");
  return bias->const_data_ptr<float>();
}

inline int64_t num_groups(int64_t K, int64_t group_size) {
  TORCH_CHECK(group_size > 0 && K % 2 == 0, "int4: need an even in_features and group_size > 0");
  return llmp::int4_groups(K, group_size);
}

}  // namespace llmp::torch_checks
