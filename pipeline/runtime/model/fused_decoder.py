"""Decode-sized steps through the fused decoder-layer kernel (`torch.classes.llmpipe_quant.DecoderPlan`).

A step of few tokens then costs two calls per layer, attention and everything else, instead of about ten
torch ops (a sparse MoE layer: some 30): for a 30-layer 135M model, per-op overhead is otherwise as large as
the GEMVs themselves. Steps with more token rows (prefill chunks) keep the op-by-op path, whose GEMMs are
faster there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.model.attention import Attention, KernelAttention
from pipeline.runtime.model.layers import DenseLinear, Linear
from pipeline.runtime.model.weights import LayerWeights, ModelWeights, MoEWeights
from pipeline.runtime.model_config import ModelConfig
from pipeline.runtime.quant.linear import QuantLinear, max_kernel_rows
from pipeline.runtime.worker.attn_metadata import AttentionMetadata

# The MLP activations the kernel computes (config.hidden_act values).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class MoEArgs(NamedTuple):
    """A sparse entry's MoE block for the plan: 4 (2 E + 1) linear tensors (router, then each expert's gate_up
    and down), 2 E + 1 group sizes, [E, top_k, normalize]."""

    linears: list[torch.Tensor | None]
    group_sizes: list[int]
    shape: list[int]


class KernelArgs(NamedTuple):
    """The plan's per-entry lists: 16 linear tensors, 4 norms, 4 group sizes; a sparse entry's MoE block;
    whether its int8 layers are W8A8 (the `w8a8` scheme)."""

    linears: list[torch.Tensor | None]
    norms: list[torch.Tensor | None]
    group_sizes: list[int]
    moe: MoEArgs | None = None
    int8_activations: bool = False


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
    return max_kernel_rows("bf16" if linear.weight.dtype == torch.bfloat16 else "fp32")


def _layer_linears(layer: LayerWeights) -> list[Linear | None]:
    if layer.moe is None:
        return [layer.qkv, layer.dense, layer.gate_up, layer.proj]
    return [layer.qkv, layer.dense, *layer.moe.gate_up, *layer.moe.proj]


def _flatten(linears: Sequence[Linear | None]) -> tuple[list[torch.Tensor | None], list[int]]:
    """[weight, scales, zeros, bias] per linear (None where absent) and its int4 group size (else 0)."""
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
    return flat, group_sizes


class FusedDecoder:
    """Runs all layers of a step of at most `max_rows` tokens: per layer, the attention, then one kernel call
    for the output projection, MLP and residual adds, and the next layer's norm and q/k/v projection."""

    def __init__(
        self, entries: list[KernelArgs], eps: float, max_rows: int, activation: str = "silu"
    ) -> None:
        # entries[0]: the first layer's norm and q/k/v; entries[i + 1]: layer i from its attention output on
        self._plan = self.plan(entries, eps, activation)
        self._bound: KernelAttention | None = None  # the attention whose caches the plan holds
        self._num_layers = len(entries) - 1
        self.max_rows = max_rows

    @classmethod
    def build(cls, config: ModelConfig, weights: ModelWeights) -> FusedDecoder | None:
        """None unless the kernels are available and run every layer's linears, norms (CPU, fp32) and MLP
        activation; a sparse (MoE) layer's experts (SwiGLU, as moe_forward computes them) and fp32 router
        too."""
        layers = weights.layers
        sparse = any(layer.moe is not None for layer in layers)
        if not layers or config.hidden_act not in ACTIVATIONS or (sparse and config.hidden_act != "silu"):
            return None
        linears = [lin for layer in layers for lin in _layer_linears(layer)]
        norms = [
            n
            for layer in layers
            for n in (layer.input_norm, layer.attention_output_norm, layer.post_norm, layer.mlp_output_norm)
            if n is not None
        ]
        moes = [layer.moe for layer in layers if layer.moe is not None]
        # The plan rounds the activations of all its int8 layers one way (int16 levels, or int8 for w8a8).
        schemes = {lin.scheme for lin in linears if isinstance(lin, QuantLinear)}
        if {"int8", "w8a8"} <= schemes:
            return None
        if not all(lin is not None and _runs_on_kernel(lin) for lin in linears) or not all(
            0 < len(moe.gate_up) == len(moe.proj) == moe.router.shape[0] and moe.router.is_contiguous()
            for moe in moes
        ):
            return None
        routers = [moe.router for moe in moes]
        tensors_ok = all(t.is_cpu and t.dtype == torch.float32 for t in norms + routers)
        # Checked last: the first check builds the kernels, which a CUDA model never needs.
        if not tensors_ok or not kernels.kernels_available():
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
                    layer.moe,
                )
            )
        max_rows = min(_max_rows(lin) for lin in linears if lin is not None)
        return cls(entries, config.norm_epsilon, max_rows, config.hidden_act)

    @staticmethod
    def plan(entries: Sequence[KernelArgs], eps: float, activation: str = "silu") -> Any:
        """kernels.decoder_plan over `entries` (from layer_args)."""
        linears = [t for entry in entries for t in entry.linears]
        norms = [t for entry in entries for t in entry.norms]
        group_sizes = [g for entry in entries for g in entry.group_sizes]
        moes = [entry.moe for entry in entries]
        return kernels.decoder_plan(
            linears,
            norms,
            group_sizes,
            eps,
            activation,
            [t for moe in moes if moe is not None for t in moe.linears],
            [g for moe in moes if moe is not None for g in moe.group_sizes],
            [n for moe in moes for n in (moe.shape if moe is not None else [0, 0, 0])],
            int8_activations=any(entry.int8_activations for entry in entries),
        )

    @staticmethod
    def layer_args(
        linears: Sequence[Linear | None],
        norms: Sequence[torch.Tensor | None],
        moe: MoEWeights | None = None,
    ) -> KernelArgs:
        """One plan entry from [dense, gate_up, down, next_qkv] and [attention_output_norm, post_norm,
        mlp_output_norm, next_norm] (None where absent; see kernels.decoder_plan); a sparse layer has `moe`
        and no gate_up or down."""
        flat, group_sizes = _flatten(linears)
        moe_args = None
        experts: list[Linear] = []
        if moe is not None:
            experts = [lin for pair in zip(moe.gate_up, moe.proj, strict=True) for lin in pair]
            moe_flat, moe_groups = _flatten(experts)
            moe_args = MoEArgs(
                [moe.router, None, None, None, *moe_flat],
                [0, *moe_groups],
                [len(moe.gate_up), moe.num_experts_per_tok, int(moe.normalize_top_k)],
            )
        w8a8 = any(isinstance(lin, QuantLinear) and lin.int8_activations for lin in [*linears, *experts])
        return KernelArgs(flat, list(norms), group_sizes, moe_args, w8a8)

    def forward(self, hidden: torch.Tensor, attention: Attention, meta: AttentionMetadata) -> torch.Tensor:
        """hidden [T, H] embeddings (updated in place) -> the last layer's output (before the final norm). With
        the attention kernel the whole step is one call: a call per layer cost its overhead and, in the Python
        between two calls, the OpenMP workers fell asleep and had to be woken (16 streams, SmolLM2-135M int8:
        ~2 ms of a 15 ms step)."""
        if self._bound is not attention and isinstance(attention, KernelAttention):
            binding = attention.plan_binding()
            if binding is not None:
                self._plan.bind_attention(*binding)
                self._bound = attention
        if self._bound is attention:
            return self._plan.forward(
                hidden,
                meta.positions,
                meta.slot_mapping,
                meta.block_tables,
                meta.token_seq,
                meta.max_context_len,
            )
        run = self._plan.run
        qkv = run(0, hidden, None)
        for i in range(self._num_layers):
            qkv = run(i + 1, hidden, attention(i, qkv, meta))
        return hidden

    def forward_without_attention(self, hidden: torch.Tensor, attention_out: torch.Tensor) -> torch.Tensor:
        """`forward` with every layer's attention output replaced by `attention_out` [T, heads * head_dim]:
        the kernel work of a step alone, for timing it."""
        run = self._plan.run
        run(0, hidden, None)
        for i in range(self._num_layers):
            run(i + 1, hidden, attention_out)
        return hidden
