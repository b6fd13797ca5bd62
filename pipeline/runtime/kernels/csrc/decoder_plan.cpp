// The DecoderPlan torch class (torch.classes.llmpipe_quant.DecoderPlan) over decoder.cpp's fused decoder step.
// It registers into the llmpipe_quant library that torch_ops.cpp defines, as a fragment: the two files'
// registrations may run in either order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "decoder.h"
#include "paged_attention_op.h"
#include "torch_checks.h"

namespace {

using namespace llmp::torch_checks;

// A linear layer given as [weight, scales, zeros, bias] (absent entries None); the format follows the weight's
// dtype: float32 or bfloat16 dense, int8 per-channel, uint8 packed int4 (group_size from the caller).
llmp::LinearRef linear_ref(const c10::List<std::optional<at::Tensor>>& parts, int64_t first, int64_t group_size,
                           const char* name) {
  llmp::LinearRef l;
  const std::optional<at::Tensor> w = parts.get(first), scales = parts.get(first + 1),
                                  zeros = parts.get(first + 2);
  if (!w) return l;
  TORCH_CHECK(w->dim() == 2, name, ": weight must be 2-D, got ", w->sizes());
  l.N = w->size(0);
  switch (w->scalar_type()) {
    case at::kFloat:
      l.kind = llmp::WeightKind::kF32;
      l.K = w->size(1);
      expect(*w, at::kFloat, {l.N, l.K}, name);
      break;
    case at::kBFloat16:
      l.kind = llmp::WeightKind::kBF16;
      l.K = w->size(1);
      expect(*w, at::kBFloat16, {l.N, l.K}, name);
      break;
    case at::kChar:
      l.kind = llmp::WeightKind::kInt8;
      l.K = w->size(1);
      expect(*w, at::kChar, {l.N, l.K}, name);
      TORCH_CHECK(scales.has_value(), name, ": int8 needs scales");
      expect(*scales, at::kFloat, {l.N}, "scales");
      l.scales = scales->const_data_ptr<float>();
      break;
    case at::kByte: {
      l.kind = llmp::WeightKind::kInt4;
      l.K = w->size(1) * 2;
      l.group_size = group_size;
      const int64_t G = num_groups(l.K, group_size);
      expect(*w, at::kByte, {l.N, l.K / 2}, name);
      TORCH_CHECK(scales.has_value() && zeros.has_value(), name, ": int4 needs scales and zeros");
      expect(*scales, at::kFloat, {l.N, G}, "scales");
      expect(*zeros, at::kFloat, {l.N, G}, "zeros");
      l.scales = scales->const_data_ptr<float>();
      l.zeros = zeros->const_data_ptr<float>();
      break;
    }
    default:
      TORCH_CHECK(false, name, ": unsupported weight dtype ", w->scalar_type());
  }
  l.w = w->const_data_ptr();
  l.bias = bias_ptr(parts.get(first + 3), l.N);
  return l;
}

const float* vector_ptr(const std::optional<at::Tensor>& t, int64_t H, const char* name) {
  if (!t) return nullptr;
  expect(*t, at::kFloat, {H}, name);
  return t->const_data_ptr<float>();
}

// Validated per-layer templates of llmp::DecoderStep, built once per model: each decode step then passes only
// the residual stream and the attention output (a call with lists of ~20 tensors costs ~10 us more).
// Entry i is built from linears[16 i .. 16 i + 15] = 4 x [weight, scales, zeros, bias] for dense, gate_up,
// down and next_qkv, norms[4 i .. 4 i + 3] = attention_output_norm, post_norm, mlp_output_norm, next_norm and
// group_sizes[4 i .. 4 i + 3]; `activation` is the MLP's, "silu" or "gelu_pytorch_tanh"; `int8_activations`:
// the int8 layers are W8A8 (their activation rows rounded to int8 levels, not int16).
// A sparse entry (moe_shapes[3 i .. 3 i + 2] = num_experts E > 0, top_k, normalize; E = 0: none) has no
// gate_up or down but a MoE block (llmp::MoEBlock, experts SwiGLU), whose linears are the entry's next
// 4 (2 E + 1) moe_linears (the router, then each expert's gate_up and down, as 4 tensors each) with the next
// 2 E + 1 moe_group_sizes, entries in order.
struct DecoderPlan : torch::CustomClassHolder {
  DecoderPlan(const c10::List<std::optional<at::Tensor>>& linears, const c10::List<std::optional<at::Tensor>>& norms,
              const std::vector<int64_t>& group_sizes, double eps, const std::string& activation,
              bool int8_activations, const c10::List<std::optional<at::Tensor>>& moe_linears,
              const std::vector<int64_t>& moe_group_sizes, const std::vector<int64_t>& moe_shapes) {
    const size_t count = norms.size() / 4;
    TORCH_CHECK(count > 0 && norms.size() == 4 * count && linears.size() == 16 * count &&
                    group_sizes.size() == 4 * count && moe_shapes.size() == 3 * count,
                "DecoderPlan: expected 16 linear tensors, 4 norms, 4 group sizes and 3 MoE sizes per entry");
    TORCH_CHECK(activation == "silu" || activation == "gelu_pytorch_tanh", "DecoderPlan: activation must be silu or ",
                "gelu_pytorch_tanh, got ", activation);
    const auto act = activation == "silu" ? llmp::Activation::kSilu : llmp::Activation::kGeluTanh;
    for (const auto& list : {linears, norms, moe_linears})
      for (size_t i = 0; i < list.size(); ++i)
        if (const std::optional<at::Tensor> t = list.get(i)) keep_.push_back(*t);
    size_t moe_next = 0;  // the next sparse entry's first linear (of 4) in moe_linears
    for (size_t i = 0; i < count; ++i) {
      steps_.push_back(make_step(linears, norms, group_sizes, i, eps, act));
      const int64_t E = moe_shapes[3 * i], top_k = moe_shapes[3 * i + 1];
      TORCH_CHECK(E >= 0, "DecoderPlan: entry ", i, " has ", E, " experts");
      if (E > 0) {
        TORCH_CHECK(moe_linears.size() >= 4 * (moe_next + 2 * E + 1) && moe_group_sizes.size() >= moe_next + 2 * E + 1,
                    "DecoderPlan: entry ", i, " needs ", 2 * E + 1, " more MoE linears");
        steps_.back().moe = make_moe(steps_.back(), moe_linears, moe_group_sizes, moe_next, E, top_k,
                                     moe_shapes[3 * i + 2] != 0, i);
        moe_next += 2 * E + 1;
      }
      const llmp::DecoderStep& s = steps_.back();
      TORCH_CHECK(s.dense.kind == llmp::WeightKind::kAbsent ||
                      ((s.gate_up.kind != llmp::WeightKind::kAbsent && s.down.kind != llmp::WeightKind::kAbsent) !=
                       (s.moe != nullptr)),
                  "DecoderPlan: dense needs gate_up and down, or else a MoE block");
    }
    TORCH_CHECK(4 * moe_next == moe_linears.size() && moe_next == moe_group_sizes.size(),
                "DecoderPlan: ", moe_linears.size(), " MoE linear tensors and ", moe_group_sizes.size(),
                " group sizes, the entries take ", 4 * moe_next, " and ", moe_next);
    if (int8_activations) {
      // The byte dots' row sums are summed once here, not in every step.
      const auto mark = [this](llmp::LinearRef& l) {
        l.int8_activations = l.kind == llmp::WeightKind::kInt8;
        if (!llmp::takes_byte_bias(l)) return;
        at::Tensor bias = at::empty({l.N}, at::kLong);
        llmp::fill_byte_bias(l, bias.data_ptr<int64_t>());
        keep_.push_back(bias);
        l.byte_bias = bias.data_ptr<int64_t>();
      };
      for (llmp::DecoderStep& s : steps_)
        for (llmp::LinearRef* l : {&s.dense, &s.gate_up, &s.down, &s.next_qkv}) mark(*l);
      for (const auto& store : moes_) {
        for (llmp::LinearRef& l : store->gate_up) mark(l);
        for (llmp::LinearRef& l : store->down) mark(l);
      }
    }
  }

  at::Tensor run(int64_t index, const at::Tensor& hidden, const std::optional<at::Tensor>& attn) const {
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(steps_.size()), "DecoderPlan: no entry ", index);
    llmp::DecoderStep s = steps_[index];
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == s.H, "hidden: expected [M, ", s.H, "]");
    const int64_t M = hidden.size(0);
    expect(hidden, at::kFloat, {M, s.H}, "hidden");
    s.hidden = hidden.data_ptr<float>();
    s.M = M;
    at::Tensor attn_rows, mlp_scratch, out;
    if (attn) {
      TORCH_CHECK(s.dense.kind != llmp::WeightKind::kAbsent, "DecoderPlan: entry ", index, " takes no attn");
      attn_rows = attn->contiguous();
      expect(attn_rows, at::kFloat, {M, s.dense.K}, "attn");
      s.attn = attn_rows.const_data_ptr<float>();
      // gate_up_out [M, 2 I], act [M, I], delta [M, H] when an output is normed and, with a MoE block,
      // router_out [M, E] and expert_out [M top_k, H], carved from one allocation.
      const bool normed_output = s.attention_output_norm != nullptr || s.mlp_output_norm != nullptr;
      const int64_t gate_up_n = s.moe != nullptr ? s.moe->gate_up[0].N : s.gate_up.N;
      const int64_t moe_floats = s.moe != nullptr ? s.moe->num_experts + s.moe->top_k * s.H : 0;
      mlp_scratch = at::empty({M * (gate_up_n + gate_up_n / 2 + (normed_output ? s.H : 0) + moe_floats)},
                              hidden.options());
      s.gate_up_out = mlp_scratch.mutable_data_ptr<float>();
      s.act = s.gate_up_out + M * gate_up_n;
      float* rest = s.act + M * (gate_up_n / 2);
      if (normed_output) {
        s.delta = rest;
        rest += M * s.H;
      }
      if (s.moe != nullptr) {
        s.router_out = rest;
        s.expert_out = rest + M * s.moe->num_experts;
      }
    }
    if (s.next_qkv.kind != llmp::WeightKind::kAbsent) {
      out = at::empty({M, s.next_qkv.N}, hidden.options());
    } else {
      out = at::empty({s.next_norm != nullptr ? M : 0, s.H}, hidden.options());
    }
    s.out = out.mutable_data_ptr<float>();
    llmp::decoder_step(s, at::get_num_threads());
    return out;
  }

  // Each layer's paged attention (KernelAttention's): its K and V caches, their scales (an int8 cache), RoPE
  // table and window, and what all layers share. Bound once per cache; forward() then runs whole steps.
  void bind_attention(const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                      const c10::List<std::optional<at::Tensor>>& k_scales,
                      const c10::List<std::optional<at::Tensor>>& v_scales, const std::vector<at::Tensor>& cos_sins,
                      const std::vector<int64_t>& windows, int64_t num_heads, int64_t block_size, double scale,
                      double softcap) {
    const size_t layers = steps_.size() - 1;
    TORCH_CHECK(k_caches.size() == layers && v_caches.size() == layers && k_scales.size() == layers &&
                    v_scales.size() == layers && cos_sins.size() == layers && windows.size() == layers,
                "DecoderPlan.bind_attention: expected ", layers, " layers of caches, scales, RoPE tables and windows");
    attention_ = {k_caches, v_caches, k_scales.vec(), v_scales.vec(), cos_sins, windows, num_heads, block_size,
                  scale, softcap};
  }

  // A whole step: the first entry, then every layer's attention and the entry after it, with no return to
  // Python between them (each return cost a call's overhead, and the OpenMP workers' sleep and wake-up across
  // it). hidden [M, H] is updated in place and returned; the step arguments are an AttentionMetadata's.
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& slots,
                     const at::Tensor& block_tables, const at::Tensor& token_seq, int64_t max_context) const {
    TORCH_CHECK(attention_.has_value(), "DecoderPlan.forward: bind_attention first");
    const Attention& a = *attention_;
    at::Tensor qkv = run(0, hidden, std::nullopt);
    for (size_t i = 0; i + 1 < steps_.size(); ++i) {
      const at::Tensor attn = llmp::paged_attention_op(
          qkv, a.k_caches[i], a.v_caches[i], a.k_scales[i], a.v_scales[i], a.cos_sins[i], positions, slots,
          block_tables, token_seq, a.num_heads, a.block_size, a.windows[i], max_context, a.scale, a.softcap);
      qkv = run(static_cast<int64_t>(i) + 1, hidden, attn);
    }
    return hidden;
  }

 private:
  static llmp::DecoderStep make_step(const c10::List<std::optional<at::Tensor>>& linears,
                                     const c10::List<std::optional<at::Tensor>>& norms,
                                     const std::vector<int64_t>& group_sizes, size_t i, double eps,
                                     llmp::Activation act) {
    llmp::DecoderStep s{};
    s.eps = static_cast<float>(eps);
    s.activation = act;
    s.dense = linear_ref(linears, 16 * i, group_sizes[4 * i], "dense");
    s.gate_up = linear_ref(linears, 16 * i + 4, group_sizes[4 * i + 1], "gate_up");
    s.down = linear_ref(linears, 16 * i + 8, group_sizes[4 * i + 2], "down");
    s.next_qkv = linear_ref(linears, 16 * i + 12, group_sizes[4 * i + 3], "next_qkv");
    using K = llmp::WeightKind;
    // The hidden size: any norm's, else the output projection's outputs or the next q/k/v's inputs.
    s.H = s.dense.kind != K::kAbsent ? s.dense.N : s.next_qkv.K;
    for (size_t j = 0; j < 4; ++j)
      if (const std::optional<at::Tensor> norm = norms.get(4 * i + j); norm && norm->dim() == 1) s.H = norm->size(0);
    TORCH_CHECK(s.H > 0, "DecoderPlan: entry ", i, " has neither a norm nor a linear layer");
    s.attention_output_norm = vector_ptr(norms.get(4 * i), s.H, "attention_output_norm");
    s.post_norm = vector_ptr(norms.get(4 * i + 1), s.H, "post_norm");
    s.mlp_output_norm = vector_ptr(norms.get(4 * i + 2), s.H, "mlp_output_norm");
    s.next_norm = vector_ptr(norms.get(4 * i + 3), s.H, "next_norm");
    const bool mlp = s.dense.kind != K::kAbsent && s.gate_up.kind != K::kAbsent;  // else a MoE block (checked later)
    TORCH_CHECK(s.dense.kind != K::kAbsent ||
                    (s.attention_output_norm == nullptr && s.post_norm == nullptr && s.mlp_output_norm == nullptr),
                "DecoderPlan: entry ", i, " has layer norms but no dense");
    TORCH_CHECK(s.dense.kind != K::kAbsent || (s.gate_up.kind == K::kAbsent && s.down.kind == K::kAbsent),
                "DecoderPlan: entry ", i, " has an MLP but no dense");
    const int64_t H = s.H, I = s.gate_up.N / 2;
    TORCH_CHECK(s.dense.kind == K::kAbsent || s.dense.N == H, "DecoderPlan: linear shapes do not chain: dense ",
                s.dense.N, "x", s.dense.K, ", hidden ", H);
    TORCH_CHECK(!mlp || (s.gate_up.K == H && s.gate_up.N == 2 * I && s.down.K == I && s.down.N == H),
                "DecoderPlan: linear shapes do not chain: dense ", s.dense.N, "x", s.dense.K, ", gate_up ",
                s.gate_up.N, "x", s.gate_up.K, ", down ", s.down.N, "x", s.down.K, ", hidden ", H);
    TORCH_CHECK(s.next_qkv.kind == K::kAbsent || s.next_qkv.K == H, "DecoderPlan: next_qkv needs ", H, " inputs");
    for (const llmp::LinearRef* l : {&s.dense, &s.gate_up, &s.down, &s.next_qkv})
      TORCH_CHECK(llmp::walkable(*l), "DecoderPlan: an int4 layer has group size ", l->group_size,
                  " (the kernels need 32 or a multiple of 64) or odd in_features ", l->K);
    return s;
  }

  // Entry i's MoE block from moe_linears / moe_group_sizes starting at linear `first` (router, then the experts'
  // gate_up and down), checked against the entry's hidden size.
  const llmp::MoEBlock* make_moe(const llmp::DecoderStep& s, const c10::List<std::optional<at::Tensor>>& linears,
                                 const std::vector<int64_t>& group_sizes, size_t first, int64_t E, int64_t top_k,
                                 bool normalize, size_t i) {
    using K = llmp::WeightKind;
    TORCH_CHECK(s.dense.kind != K::kAbsent && s.gate_up.kind == K::kAbsent && s.down.kind == K::kAbsent,
                "DecoderPlan: entry ", i, " has a MoE block, so needs dense and no gate_up or down");
    TORCH_CHECK(top_k >= 1 && top_k <= E, "DecoderPlan: entry ", i, " picks ", top_k, " of ", E, " experts");
    auto store = std::make_unique<MoEStore>();
    store->block.router = linear_ref(linears, 4 * first, group_sizes[first], "router");
    const llmp::LinearRef& router = store->block.router;
    TORCH_CHECK(router.kind == K::kF32 && router.bias == nullptr && router.N == E && router.K == s.H,
                "DecoderPlan: entry ", i, ": the router must be a float32 [", E, ", ", s.H, "] weight without bias");
    for (int64_t e = 0; e < E; ++e) {
      const size_t at = first + 1 + 2 * e;
      store->gate_up.push_back(linear_ref(linears, 4 * at, group_sizes[at], "expert gate_up"));
      store->down.push_back(linear_ref(linears, 4 * (at + 1), group_sizes[at + 1], "expert down"));
    }
    const llmp::LinearRef &g0 = store->gate_up[0], &d0 = store->down[0];
    const int64_t I = g0.N / 2;
    for (int64_t e = 0; e < E; ++e) {
      const llmp::LinearRef &g = store->gate_up[e], &d = store->down[e];
      TORCH_CHECK(g.kind != K::kAbsent && g.kind == g0.kind && d.kind == d0.kind && g.group_size == g0.group_size &&
                      d.group_size == d0.group_size && g.K == s.H && g.N == 2 * I && I > 0 && d.K == I && d.N == s.H,
                  "DecoderPlan: entry ", i, ": expert ", e, " (gate_up ", g.N, "x", g.K, ", down ", d.N, "x", d.K,
                  ") does not chain with hidden ", s.H, " or differs from expert 0 in shape or format");
      for (const llmp::LinearRef* l : {&g, &d})
        TORCH_CHECK(llmp::walkable(*l), "DecoderPlan: an expert's int4 layer has group size ", l->group_size,
                    " (the kernels need 32 or a multiple of 64) or odd in_features ", l->K);
    }
    store->block.gate_up = store->gate_up.data();
    store->block.down = store->down.data();
    store->block.num_experts = E;
    store->block.top_k = top_k;
    store->block.normalize = normalize;
    moes_.push_back(std::move(store));
    return &moes_.back()->block;
  }

  struct MoEStore {
    llmp::MoEBlock block;
    std::vector<llmp::LinearRef> gate_up, down;  // what block points into
  };

  struct Attention {
    std::vector<at::Tensor> k_caches, v_caches;
    std::vector<std::optional<at::Tensor>> k_scales, v_scales;
    std::vector<at::Tensor> cos_sins;
    std::vector<int64_t> windows;
    int64_t num_heads, block_size;
    double scale, softcap;
  };

  std::optional<Attention> attention_;
  std::vector<at::Tensor> keep_;  // the weights the templates point into
  std::vector<llmp::DecoderStep> steps_;
  std::vector<std::unique_ptr<MoEStore>> moes_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmpipe_quant, m) {
  m.class_<DecoderPlan>("DecoderPlan")
      .def(torch::init<c10::List<std::optional<at::Tensor>>, c10::List<std::optional<at::Tensor>>,
                       std::vector<int64_t>, double, std::string, bool, c10::List<std::optional<at::Tensor>>,
                       std::vector<int64_t>, std::vector<int64_t>>())
      .def("run", &DecoderPlan::run)
      .def("bind_attention", &DecoderPlan::bind_attention)
      .def("forward", &DecoderPlan::forward);
}
