"""Decode-sized steps through the fused decoder-layer kernel (`torch.classes.llmpipe_quant.DecoderPlan`).

A step of few tokens then costs two calls per layer, attention and everything else, instead of about ten
torch ops: for a 30-layer 135M model, per-op overhead is otherwise as large as the GEMVs themselves. Steps
with more token rows (prefill chunks) keep the op-by-op path, whose GEMMs are faster there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeline.runtime.engine_config import ModelConfig
from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.model.attention import Attention
from pipeline.runtime.model.layers import DenseLinear, Linear
from pipeline.runtime.model.weights import ModelWeights
from pipeline.runtime.quant.linear import MAX_KERNEL_ROWS, QuantLinear
from pipeline.runtime.worker.attn_metadata import AttentionMetadata

# The MLP activations the kernel computes (config.hidden_act values).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# The plan's per-entry lists: 16 linear tensors, 4 norms, 4 group sizes.
KernelArgs = tuple[list[torch.Tensor | None], list[torch.Tensor | None], list[int]]


def _runs_on_kernel(linear: Linear) -> bool:
    if isinstance(linear, DenseLinear):
        w, b = linear.weight, linear.bias
        dense_ok = w.dtype in (torch.float32, torch.bfloat16) and w.is_cpu and w.is_contiguous()
        return dense_ok and (b is None or b.dtype == torch.float32)
    return isinstance(linear, QuantLinear) and linear.qweight.is_cpu


def _max_rows(linear: Linear) -> int:
    if isinstance(linear, QuantLinear):
        return linear.max_kernel_rows
    assert isinstance(linear, DenseLinear)
    return MAX_KERNEL_ROWS["bf16" if linear.weight.dtype == torch.bfloat16 else "fp32"]


class FusedDecoder:
    """Runs all layers of a step of at most `max_rows` tokens: per layer, the attention, then one kernel call
    for the output projection, MLP and residual adds, and the next layer's norm and q/k/v projection."""

    def __init__(
        self, entries: list[KernelArgs], eps: float, max_rows: int, activation: str = "silu"
    ) -> None:
        # entries[0]: the first layer's norm and q/k/v; entries[i + 1]: layer i from its attention output on
        self._plan = self.plan(entries, eps, activation)
        self._num_layers = len(entries) - 1
        self.max_rows = max_rows

    @classmethod
    def build(cls, config: ModelConfig, weights: ModelWeights) -> FusedDecoder | None:
        """None unless the kernels are available and run every layer's linears, norms (CPU, fp32) and MLP
        activation; sparse (MoE) layers run op by op."""
        layers = weights.layers
        if (
            not layers
            or config.hidden_act not in ACTIVATIONS
            or any(layer.moe is not None for layer in layers)
        ):
            return None
        linears = [lin for layer in layers for lin in (layer.qkv, layer.dense, layer.gate_up, layer.proj)]
        norms = [
            n
            for layer in layers
            for n in (layer.input_norm, layer.attention_output_norm, layer.post_norm, layer.mlp_output_norm)
            if n is not None
        ]
        if not all(lin is not None and _runs_on_kernel(lin) for lin in linears):
            return None
        # Checked last: the first check builds the kernels, which a CUDA model never needs.
        if not all(n.is_cpu and n.dtype == torch.float32 for n in norms) or not kernels.kernels_available():
            return None
        entries = [
            cls.layer_args([None, None, None, layers[0].qkv], [None, None, None, layers[0].input_norm])
        ]
        for i, layer in enumerate(layers):
            following = layers[i + 1] if i + 1 < len(layers) else None
            entries.append(
                cls.layer_args(
                    [layer.dense, layer.gate_up, layer.proj, following.qkv if following else None],
                    [
                        layer.attention_output_norm,
                        layer.post_norm,
                        layer.mlp_output_norm,
                        following.input_norm if following else None,
                    ],
                )
            )
        max_rows = min(_max_rows(lin) for lin in linears if lin is not None)
        return cls(entries, config.norm_epsilon, max_rows, config.hidden_act)

    @staticmethod
    def plan(entries: Sequence[KernelArgs], eps: float, activation: str = "silu") -> Any:
        """kernels.decoder_plan over `entries` (from layer_args)."""
        linears = [t for entry in entries for t in entry[0]]
        norms = [t for entry in entries for t in entry[1]]
        group_sizes = [g for entry in entries for g in entry[2]]
        return kernels.decoder_plan(linears, norms, group_sizes, eps, activation)

    @staticmethod
    def layer_args(linears: Sequence[Linear | None], norms: Sequence[torch.Tensor | None]) -> KernelArgs:
        """One plan entry from [dense, gate_up, down, next_qkv] and [attention_output_norm, post_norm,
        mlp_output_norm, next_norm] (None where absent; see kernels.decoder_plan)."""
        flat: list[torch.Tensor | None] = []
        group_sizes: list[int] = []
        for linear in linears:
            if linear is None:
                flat += [None] * 4
                group_sizes.append(0)
            elif isinstance(linear, QuantLinear):
                flat += [linear.qweight, linear.scales, linear.zeros, linear.bias]
                group_sizes.append(linear.group_size or 0)
            else:
                assert isinstance(linear, DenseLinear)
                flat += [linear.weight, None, None, linear.bias]
                group_sizes.append(0)
        return flat, list(norms), group_sizes

    def forward(self, hidden: torch.Tensor, attention: Attention, meta: AttentionMetadata) -> torch.Tensor:
        """hidden [T, H] embeddings (updated in place) -> the last layer's output (before the final norm)."""
        run = self._plan.run
        qkv = run(0, hidden, None)
        for i in range(self._num_layers):
            qkv = run(i + 1, hidden, attention(i, qkv, meta))
        return hidden
