// The dense part of a decoder layer in one call (decoder.cpp); torch_ops.cpp validates the tensors and fills
// these structs.
#pragma once

#include <stdint.h>

namespace llmp {

enum class WeightKind : int { kAbsent = -1, kF32 = 0, kInt8 = 1, kInt4 = 2, kBF16 = 3 };

// One linear layer y = x @ W.T + bias in any stored format (layouts: qgemv.cpp).
struct LinearRef {
  WeightKind kind = WeightKind::kAbsent;
  const void* w = nullptr;  // f32 [N, K], int8 [N, K], packed uint8 [N, K / 2] or bf16 [N, K]
  const float* scales = nullptr;  // int8 [N], int4 [N, G]
  const float* zeros = nullptr;   // int4 [N, G]
  const float* bias = nullptr;    // [N] or null
  int64_t N = 0, K = 0, group_size = 0;
};

// hidden [M, H] is the residual stream, updated in place. With `attn` ([M, dense.K]):
//   hidden += attn @ dense.T; x = rms_norm(hidden) * post_norm; a = silu(x @ gate.T) * (x @ up.T)
//   hidden += a @ down.T            (gate_up holds the gate rows, then the up rows: [2 I, H])
// then with next_norm: x = rms_norm(hidden) * next_norm, and out = x @ next_qkv.T (the next layer's fused
// q/k/v), or out = x when next_qkv is absent.
struct DecoderStep {
  float* hidden;
  int64_t M, H;
  const float* attn;  // or null: skip the attention output and MLP (the first layer's entry)
  LinearRef dense, gate_up, down, next_qkv;
  const float* post_norm;
  const float* next_norm;  // or null: no output
  float eps;
  float* gate_up_out;  // scratch [M, 2 I]
  float* act;          // scratch [M, I]
  float* out;          // [M, next_qkv.N], or [M, H] without next_qkv
};

// Whether the kernels can walk the layer (int4: group size 32 or a multiple of 64, even in_features).
bool walkable(const LinearRef& l);

// Runs one step; the caller has checked every linear with walkable().
void decoder_step(const DecoderStep& step, int num_threads);

}  // namespace llmp
