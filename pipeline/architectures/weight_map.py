"""Where each Hugging Face tensor goes in the runtime checkpoint (`rank0.safetensors`), per architecture.

The runtime layout is one per model, whatever the family: fused q/k/v and gate/up projections, optional
norms under their own names, a sparse layer's experts stacked into one tensor per projection. Some of a
family's arithmetic is folded into the weights here so the runtime has one code path for it: Gemma's
(1 + w) norm scales, Granite's residual multiplier, and Phi's partial rotary (q/k channels reordered so the
rotated ones pair as the runtime's full-width RoPE pairs them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Runtime name -> the HF tensors (Llama layout) it is made of, concatenated along dim 0 in this order.
GLOBAL_WEIGHTS: dict[str, tuple[str, ...]] = {
    "transformer.vocab_embedding.weight": ("model.embed_tokens.weight",),
    "transformer.ln_f.weight": ("model.norm.weight",),
    "lm_head.weight": ("lm_head.weight",),  # falls back to model.embed_tokens.weight when tied
}
LAYER_WEIGHTS: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "attention.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attention.dense.weight": ("self_attn.o_proj.weight",),
    "post_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.proj.weight": ("mlp.down_proj.weight",),
}
QKV_BIAS_WEIGHTS: dict[str, tuple[str, ...]] = {
    "attention.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
}
DENSE_BIAS_WEIGHTS: dict[str, tuple[str, ...]] = {"attention.dense.bias": ("self_attn.o_proj.bias",)}
QK_NORM_WEIGHTS: dict[str, tuple[str, ...]] = {
    "attention.q_norm.weight": ("self_attn.q_norm.weight",),
    "attention.k_norm.weight": ("self_attn.k_norm.weight",),
}
# Gemma: norms before and after both attention and MLP. HF's post_attention_layernorm normalizes the attention
# output there, not the MLP input as in Llama.
SANDWICH_NORM_WEIGHTS: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "attention.output_norm.weight": ("post_attention_layernorm.weight",),
    "post_layernorm.weight": ("pre_feedforward_layernorm.weight",),
    "mlp.output_norm.weight": ("post_feedforward_layernorm.weight",),
}
POST_NORM_WEIGHTS: dict[str, tuple[str, ...]] = {  # OLMo 2
    "attention.output_norm.weight": ("post_attention_layernorm.weight",),
    "mlp.output_norm.weight": ("post_feedforward_layernorm.weight",),
}
PHI3_WEIGHTS: dict[str, tuple[str, ...]] = {
    "attention.qkv.weight": ("self_attn.qkv_proj.weight",),
    "mlp.gate_up.weight": ("mlp.gate_up_proj.weight",),
}
# A sparse layer: the router and, per expert, (gate, up, down) in the HF names of each family.
MOE_ROUTER = {"MixtralForCausalLM": "block_sparse_moe.gate.weight", "Qwen3MoeForCausalLM": "mlp.gate.weight"}
MOE_EXPERT = {
    "MixtralForCausalLM": ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
                           "block_sparse_moe.experts.{e}.w2.weight"),
    "Qwen3MoeForCausalLM": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                            "mlp.experts.{e}.down_proj.weight"),
}  # fmt: skip

Fold = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TensorPlan:
    """One runtime tensor: each group of HF tensors is concatenated along dim 0; several groups (experts) are
    stacked along a new dim 0; `fold` (in fp32) rewrites the result before it is cast to the checkpoint dtype."""

    groups: tuple[tuple[str, ...], ...]
    fold: Fold | None = None


def layer_table(pretrained: dict[str, Any], layer: int) -> dict[str, tuple[str, ...]]:
    """Runtime name (within the layer) -> HF names (within the layer) of the dense part of `layer`."""
    architecture, layout = pretrained["architecture"], pretrained.get("norm_layout", "pre")
    table = {k: v for k, v in LAYER_WEIGHTS.items() if "layernorm" not in k}
    table.update({"pre": _pre_norms(), "sandwich": SANDWICH_NORM_WEIGHTS, "post": POST_NORM_WEIGHTS}[layout])
    if architecture == "Phi3ForCausalLM":
        table.update(PHI3_WEIGHTS)
    elif pretrained["qkv_bias"]:
        table.update(QKV_BIAS_WEIGHTS)
    if pretrained.get("dense_bias"):
        table.update(DENSE_BIAS_WEIGHTS)
    if pretrained.get("qk_norm"):
        table.update(QK_NORM_WEIGHTS)
    if _is_sparse(pretrained, layer):
        del table["mlp.gate_up.weight"], table["mlp.proj.weight"]
    return table


def _pre_norms() -> dict[str, tuple[str, ...]]:
    return {k: v for k, v in LAYER_WEIGHTS.items() if "layernorm" in k}


def _is_sparse(pretrained: dict[str, Any], layer: int) -> bool:
    return pretrained.get("num_experts", 0) > 0 and layer not in (pretrained.get("dense_layers") or [])


def checkpoint_plan(pretrained: dict[str, Any], hf: dict[str, Any]) -> dict[str, TensorPlan]:
    """Every runtime tensor of the model (pretrained_config `pretrained`) and how it is made from the HF
    checkpoint (config.json `hf`)."""
    plan = {name: TensorPlan((sources,)) for name, sources in GLOBAL_WEIGHTS.items()}
    if pretrained["tie_word_embeddings"]:
        # HF ties by reusing the embedding even when a stale lm_head.weight was saved too.
        plan["lm_head.weight"] = TensorPlan((GLOBAL_WEIGHTS["transformer.vocab_embedding.weight"],))
    folds = _folds(pretrained, hf)
    for i in range(pretrained["num_hidden_layers"]):
        for runtime, sources in layer_table(pretrained, i).items():
            plan[f"transformer.layers.{i}.{runtime}"] = TensorPlan(
                (tuple(f"model.layers.{i}.{s}" for s in sources),), folds.get(runtime)
            )
        if _is_sparse(pretrained, i):
            plan.update(_expert_plans(pretrained, i, folds))
    if pretrained.get("norm_layout") == "sandwich":
        plan["transformer.ln_f.weight"] = TensorPlan(plan["transformer.ln_f.weight"].groups, _one_plus)
    return plan


def _expert_plans(pretrained: dict[str, Any], layer: int, folds: dict[str, Fold]) -> dict[str, TensorPlan]:
    architecture, prefix = pretrained["architecture"], f"model.layers.{layer}."
    gate, up, down = MOE_EXPERT[architecture]
    experts = range(pretrained["num_experts"])
    out = f"transformer.layers.{layer}."
    return {
        out + "mlp.router.weight": TensorPlan(((prefix + MOE_ROUTER[architecture],),)),
        out + "mlp.experts.gate_up.weight": TensorPlan(
            tuple((prefix + gate.format(e=e), prefix + up.format(e=e)) for e in experts)
        ),
        out + "mlp.experts.proj.weight": TensorPlan(
            tuple((prefix + down.format(e=e),) for e in experts), folds.get("mlp.proj.weight")
        ),
    }


def _one_plus(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm multiplies by (1 + w), computed in fp32 (HF: `output * (1.0 + self.weight.float())`)."""
    return 1.0 + weight


def _folds(pretrained: dict[str, Any], hf: dict[str, Any]) -> dict[str, Fold]:
    folds: dict[str, Fold] = {}
    if pretrained.get("norm_layout") == "sandwich":
        norms = (*SANDWICH_NORM_WEIGHTS, *QK_NORM_WEIGHTS)
        folds.update(dict.fromkeys(norms, _one_plus))
    # Granite: residual + multiplier * branch, the branch being the attention or MLP output projection
    multiplier = float(hf.get("residual_multiplier") or 1.0)
    if multiplier != 1.0:
        folds["attention.dense.weight"] = folds["mlp.proj.weight"] = lambda w: w * multiplier
        if pretrained.get("dense_bias"):
            folds["attention.dense.bias"] = folds["attention.dense.weight"]
    if pretrained.get("rotary_dim"):
        folds.update(_partial_rotary_folds(pretrained))
    return folds


def rotary_channel_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's channels that makes HF's partial rotary (pairs (i, i + R/2) among the first R
    channels, the rest passed through) a full-width rotation of pairs (j, j + D/2) whose last D/2 - R/2
    frequencies are zero: the rotated halves go first in each half, the passed channels after them."""
    rot_half = rotary_dim // 2
    passed = head_dim - rotary_dim
    return torch.cat(
        [
            torch.arange(0, rot_half),
            torch.arange(rotary_dim, rotary_dim + passed // 2),
            torch.arange(rot_half, rotary_dim),
            torch.arange(rotary_dim + passed // 2, head_dim),
        ]
    )


def _partial_rotary_folds(pretrained: dict[str, Any]) -> dict[str, Fold]:
    heads, kv_heads, d = (pretrained[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    order = rotary_channel_order(d, pretrained["rotary_dim"])
    # Reorders the q and k rows of qkv head by head; v rows keep their order.
    rows = torch.cat(
        [h * d + order for h in range(heads + kv_heads)]
        + [torch.arange((heads + kv_heads) * d, (heads + 2 * kv_heads) * d)]
    )

    def reorder_qkv(w: torch.Tensor) -> torch.Tensor:
        return w.index_select(0, rows)

    def reorder_head_norm(w: torch.Tensor) -> torch.Tensor:
        return w.index_select(0, order) if w.shape[0] == d else w

    folds: dict[str, Fold] = {"attention.qkv.weight": reorder_qkv, "attention.qkv.bias": reorder_qkv}
    if pretrained.get("qk_norm") == "per_head":
        folds["attention.q_norm.weight"] = folds["attention.k_norm.weight"] = reorder_head_norm
    return folds
