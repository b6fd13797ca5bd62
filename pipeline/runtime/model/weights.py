"""The loaded weights of a decoder-only transformer, as the forward and the fused decoder read them.

One layer shape covers every supported architecture: norms that a family lacks are None (Llama has no
output norms, OLMo 2 no input norms, Gemma all four), and a sparse MoE layer holds `moe` instead of
`gate_up`/`proj`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.runtime.model.layers import Linear


@dataclass
class MoEWeights:
    """A sparse MoE block: a softmax router over experts, the top `num_experts_per_tok` of which run on a
    token, their outputs weighted by the router's probabilities (renormalized over the chosen ones when
    `normalize_top_k`)."""

    router: torch.Tensor  # [num_experts, hidden]
    gate_up: list[Linear]  # per expert: hidden -> 2 * moe_intermediate (gate rows, then up rows)
    proj: list[Linear]  # per expert: moe_intermediate -> hidden
    num_experts_per_tok: int
    normalize_top_k: bool


@dataclass
class LayerWeights:
    input_norm: torch.Tensor | None  # [hidden]: RMSNorm before attention; None = attention reads the residual
    qkv: Linear  # hidden -> (H + 2 KV) * D
    dense: Linear  # H * D -> hidden
    post_norm: torch.Tensor | None  # [hidden]: RMSNorm before the MLP; None = the MLP reads the residual
    gate_up: Linear | None  # hidden -> 2 * intermediate (gate rows, then up rows); None in a sparse layer
    proj: Linear | None  # intermediate -> hidden; None in a sparse layer
    attention_output_norm: torch.Tensor | None = (
        None  # [hidden]: RMSNorm of the attention output (Gemma, OLMo 2)
    )
    mlp_output_norm: torch.Tensor | None = None  # [hidden]: RMSNorm of the MLP output (Gemma, OLMo 2)
    q_norm: torch.Tensor | None = None  # [D] per head (Qwen3, Gemma 3) or [H * D] (OLMo 2), before RoPE
    k_norm: torch.Tensor | None = None  # [D] per head or [KV * D]
    moe: MoEWeights | None = None  # a sparse layer's experts


@dataclass
class ModelWeights:
    embedding: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: Linear  # hidden -> vocab
