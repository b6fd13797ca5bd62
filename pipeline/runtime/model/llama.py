"""Llama-family transformer (Llama, Mistral, Qwen2, SmolLM2) over a flattened batch of tokens: no
padding, prefill chunks and decode tokens of different sequences side by side, K/V in the paged cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.runtime.engine_config import ModelConfig
from pipeline.runtime.model.fused_decoder import FusedDecoder
from pipeline.runtime.model.greedy_head import GreedyLMHead
from pipeline.runtime.model.layers import Attention, ResidualRMSNorm
from pipeline.runtime.model.weights import LlamaWeights
from pipeline.runtime.worker.attn_metadata import AttentionMetadata


class LlamaModel:
    """Plain objects rather than nn.Modules: the forward is a loop over weight tuples, which keeps the
    per-layer Python overhead (the bottleneck of small-batch decode on CPU) to the ops themselves."""

    def __init__(
        self,
        config: ModelConfig,
        weights: LlamaWeights,
        attention: Attention,
        norm: ResidualRMSNorm,
        greedy_head: GreedyLMHead | None = None,
    ) -> None:
        self.config = config
        self.weights = weights
        self.attention = attention
        self.norm = norm
        self.greedy_head = greedy_head
        # Steps of few tokens (decode) run each layer's dense part as one kernel call; None without kernels.
        self.fused = FusedDecoder.build(config, weights)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden] (before the last norm)."""
        inter, norm = self.config.intermediate_size, self.norm
        self.attention.begin_step(meta)
        hidden = F.embedding(input_ids, self.weights.embedding)  # [T, hidden], the residual stream
        if self.fused is not None and input_ids.shape[0] <= self.fused.max_rows:
            return self.fused.forward(hidden, self.attention, meta)
        mlp_out = None  # each layer's MLP output joins the residual in the next layer's first norm
        for i, layer in enumerate(self.weights.layers):
            x = norm(hidden, mlp_out, layer.input_norm)
            qkv = layer.qkv(x)  # [T, (H + 2 KV) * D]
            x = norm(hidden, layer.dense(self.attention(i, qkv, meta)), layer.post_norm)
            gate_up = layer.gate_up(x)  # [T, 2 * inter]
            gate = F.silu(gate_up[:, :inter], inplace=True)
            mlp_out = layer.proj(gate.mul_(gate_up[:, inter:]))  # [T, hidden]
        if mlp_out is not None:
            hidden.add_(mlp_out)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] (only the rows to sample) -> logits [R, vocab] in fp32."""
        return self.weights.lm_head(self.norm(hidden, None, self.weights.final_norm)).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """argmax of the logits of hidden [R, hidden] without materializing them, when the screening
        head applies (CPU fp32, few rows); None otherwise."""
        head = self.greedy_head
        if head is None or hidden.shape[0] > head.max_rows:
            return None
        return head(self.norm(hidden, None, self.weights.final_norm))
