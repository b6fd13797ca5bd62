"""The decoder-only transformer of every supported architecture over a flattened batch of tokens: no padding,
prefill chunks and decode tokens of different sequences side by side, K/V in the paged cache. What differs
between families is data: which norms a layer has (weights.LayerWeights), the MLP's activation, a sparse
MoE block, the attention's per-layer settings (attention.LayerAttention) and the embedding/logit scales."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.runtime.model.attention import Attention
from pipeline.runtime.model.fused_decoder import FusedDecoder
from pipeline.runtime.model.greedy_head import GreedyLMHead
from pipeline.runtime.model.layers import ResidualRMSNorm, activation
from pipeline.runtime.model.moe import moe_forward
from pipeline.runtime.model.weights import LayerWeights, ModelWeights
from pipeline.runtime.model_config import ModelConfig
from pipeline.runtime.worker.attn_metadata import AttentionMetadata


class DecoderModel:
    """Plain objects rather than nn.Modules: the forward is a loop over weight tuples, which keeps the
    per-layer Python overhead (the bottleneck of small-batch decode on CPU) to the ops themselves."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
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
        self.attention.begin_step(meta)
        # [T, hidden], the residual stream, in the compute dtype (a widened bf16 lm_head is the tied embedding)
        hidden = F.embedding(input_ids, self.weights.embedding).to(self.weights.final_norm.dtype)
        if self.config.embedding_multiplier is not None:
            hidden.mul_(self.config.embedding_multiplier)
        if self.fused is not None and input_ids.shape[0] <= self.fused.max_rows:
            return self.fused.forward(hidden, self.attention, meta)
        mlp_out = None  # each layer's MLP output joins the residual in the next layer's first norm
        for i, layer in enumerate(self.weights.layers):
            x = self._normed(hidden, mlp_out, layer.input_norm)
            attn = layer.dense(self.attention(i, layer.qkv(x), meta))  # qkv: [T, (H + 2 KV) * D]
            if layer.attention_output_norm is not None:
                attn = self.norm(attn, None, layer.attention_output_norm)
            x = self._normed(hidden, attn, layer.post_norm)
            mlp_out = self._mlp(layer, x)  # [T, hidden]
            if layer.mlp_output_norm is not None:
                mlp_out = self.norm(mlp_out, None, layer.mlp_output_norm)
        if mlp_out is not None:
            hidden.add_(mlp_out)
        return hidden

    def _normed(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None
    ) -> torch.Tensor:
        """hidden += delta, then the norm's output; without a norm (OLMo 2), the residual stream itself."""
        if weight is not None:
            return self.norm(hidden, delta, weight)
        if delta is not None:
            hidden.add_(delta)
        return hidden

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        if layer.moe is not None:
            return moe_forward(x, layer.moe)
        assert layer.gate_up is not None and layer.proj is not None
        inter = self.config.intermediate_size
        gate_up = layer.gate_up(x)  # [T, 2 * inter]
        gate = activation(self.config.hidden_act, gate_up[:, :inter])
        return layer.proj(gate.mul_(gate_up[:, inter:]))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] (only the rows to sample) -> logits [R, vocab] in fp32."""
        logits = self.weights.lm_head(self.norm(hidden, None, self.weights.final_norm)).float()
        c = self.config
        if c.logits_scaling is not None:
            logits = logits / c.logits_scaling
        if c.final_logit_softcapping is not None:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """argmax of the logits of hidden [R, hidden] without materializing them, when the screening
        head applies (CPU fp32, few rows); None otherwise. Logit scaling and soft-capping are monotonic, so
        they never change the argmax."""
        head = self.greedy_head
        if head is None or hidden.shape[0] > head.max_rows:
            return None
        return head(self.norm(hidden, None, self.weights.final_norm))
