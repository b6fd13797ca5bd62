// The paged_attention op's tensor form (torch_ops.cpp), which DecoderPlan's whole-step forward also calls.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace llmp {

// One layer's RoPE, K/V cache write and paged attention over tensors, checked (layouts: paged_attention.cpp).
at::Tensor paged_attention_op(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales,
                              const at::Tensor& cos_sin, const at::Tensor& positions, const at::Tensor& slots,
                              const at::Tensor& block_tables, const at::Tensor& token_seq, int64_t H,
                              int64_t block_size, int64_t window, int64_t max_context, double scale, double softcap);

}  // namespace llmp
