"""The loaded weights of a Llama-family model, as the forward and the fused decoder read them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.runtime.model.layers import Linear


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (H + 2 KV) * D
    dense: Linear  # H * D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate (gate rows, then up rows)
    proj: Linear  # intermediate -> hidden


@dataclass
class LlamaWeights:
    embedding: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: Linear  # hidden -> vocab
