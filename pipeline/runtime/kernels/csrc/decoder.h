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

// The MLP's activation: SwiGLU's silu or GeGLU's tanh-approximated gelu (torch's approximate="tanh").
enum class Activation : int { kSilu = 0, kGeluTanh = 1 };

// hidden [M, H] is the residual stream, updated in place; every norm below may be absent (null). With `attn`
// ([M, dense.K]):
//   a = attn @ dense.T; hidden += attention_output_norm ? rms_norm(a) * attention_output_norm : a
//   x = post_norm ? rms_norm(hidden) * post_norm : hidden
//   m = act(x @ gate.T) * (x @ up.T) @ down.T      (gate_up holds the gate rows, then the up rows: [2 I, H])
//   hidden += mlp_output_norm ? rms_norm(m) * mlp_output_norm : m
// then, with next_norm or next_qkv: x = next_norm ? rms_norm(hidden) * next_norm : hidden, and
// out = x @ next_qkv.T (the next layer's fused q/k/v), or out = x when next_qkv is absent.
struct DecoderStep {
  float* hidden;
  int64_t M, H;
  const float* attn;  // or null: skip the attention output and MLP (the first layer's entry)
  LinearRef dense, gate_up, down, next_qkv;
  const float* attention_output_norm;
  const float* post_norm;
  const float* mlp_output_norm;
  const float* next_norm;
  Activation activation;
  float eps;
  float* gate_up_out;  // scratch [M, 2 I]
  float* act;          // scratch [M, I]
  float* delta;        // scratch [M, H] for a sublayer output normed before its residual add, else null
  float* out;          // [M, next_qkv.N], or [M, H] without next_qkv
};

// Whether the kernels can walk the layer (int4: group size 32 or a multiple of 64, even in_features).
bool walkable(const LinearRef& l);

// Runs one step; the caller has checked every linear with walkable().
void decoder_step(const DecoderStep& step, int num_threads);

}  // namespace llmp
