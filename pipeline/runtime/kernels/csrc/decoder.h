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
  bool int8_activations = false;  // int8: activation rows rounded to int8 levels (W8A8), else to int16
  const int64_t* byte_bias = nullptr;  // W8A8: 128 x each weight row's sum [N] (Int8Bytes), when precomputed
};

// The MLP's activation: SwiGLU's silu or GeGLU's tanh-approximated gelu (torch's approximate="tanh").
enum class Activation : int { kSilu = 0, kGeluTanh = 1 };

// A sparse MoE block in place of the gated MLP (Mixtral, Qwen3-MoE), in transformers' order: per row, the
// softmax (fp32) of x @ router.T over the experts, its top_k (ties: the lower expert), renormalized to sum 1
// when `normalize`; then m = 0 + w_e * silu_mlp_e(x) + ... over the row's experts in ascending order (the order
// index_add_ sums them in). Every expert has the same shape and weight format.
struct MoEBlock {
  LinearRef router;           // [E, H]
  const LinearRef* gate_up;   // E experts' [2 I, H] (gate rows, then up rows)
  const LinearRef* down;      // E experts' [H, I]
  int64_t num_experts, top_k;
  bool normalize;
};

// hidden [M, H] is the residual stream, updated in place; every norm below may be absent (null). With `attn`
// ([M, dense.K]):
//   a = attn @ dense.T; hidden += attention_output_norm ? rms_norm(a) * attention_output_norm : a
//   x = post_norm ? rms_norm(hidden) * post_norm : hidden
//   m = act(x @ gate.T) * (x @ up.T) @ down.T      (gate_up holds the gate rows, then the up rows: [2 I, H])
//       or, with `moe`, its MoE block of x (gate_up and down absent)
//   hidden += mlp_output_norm ? rms_norm(m) * mlp_output_norm : m
// then, with next_norm or next_qkv: x = next_norm ? rms_norm(hidden) * next_norm : hidden, and
// out = x @ next_qkv.T (the next layer's fused q/k/v), or out = x when next_qkv is absent.
struct DecoderStep {
  float* hidden;
  int64_t M, H;
  const float* attn;  // or null: skip the attention output and MLP (the first layer's entry)
  LinearRef dense, gate_up, down, next_qkv;
  const MoEBlock* moe;  // or null: the gated MLP
  const float* attention_output_norm;
  const float* post_norm;
  const float* mlp_output_norm;
  const float* next_norm;
  Activation activation;
  float eps;
  float* gate_up_out;  // scratch [M, 2 I] (I: an expert's width with `moe`)
  float* act;          // scratch [M, I]
  float* router_out;   // scratch [M, E] with `moe`, else null
  float* expert_out;   // scratch [M top_k, H] with `moe`, else null
  float* delta;        // scratch [M, H] for a sublayer output normed before its residual add, else null
  float* out;          // [M, next_qkv.N], or [M, H] without next_qkv
};

// Whether the kernels can walk the layer (int4: group size 32 or a multiple of 64, even in_features).
bool walkable(const LinearRef& l);

// Whether a W8A8 linear runs faster with its byte bias (LinearRef::byte_bias) at hand: where the byte dots exist.
bool takes_byte_bias(const LinearRef& l);
// Fills out[N] with the byte bias of `l`, a W8A8 linear that takes_byte_bias.
void fill_byte_bias(const LinearRef& l, int64_t* out);

// Runs one step; the caller has checked every linear with walkable().
void decoder_step(const DecoderStep& step, int num_threads);

}  // namespace llmp
