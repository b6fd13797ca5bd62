"""Activation-aware scaling of a runtime-layout checkpoint before weight-only quantization (int4_awq,
int8_wo with quantization.activation_aware, and int4_gptq before its rounding, quantize/gptq.py).

Per transformer block, each linear layer's input scales s are searched (awq_search) and folded so
that the engine computes the same function with unchanged kernels (quant_algo W4A16_AWQ or W8A16, no
pre_quant_scale): the layer's weight columns are multiplied by s and whatever produces its input is
divided by s:
    attention.qkv    <- input_layernorm.weight
    attention.dense  <- the v rows of attention.qkv (with GQA, one v row feeds the same column of every
                        head in its group, so those columns share a scale)
    mlp.gate_up      <- post_layernorm.weight
    mlp.proj         <- the up rows of mlp.gate_up (silu(gate) * up is linear in up)
Each layer's clipping ranges are then searched on its scaled weight. Dividing a weight's rows (the folds
into qkv's v rows and gate_up's up rows) commutes with per-row quantization and clipping, so every search
can run on the unfolded block and the folds follow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.quantize.awq_search import InputStats, WeightFormat, output_error, search_clip, search_scales
from pipeline.quantize.blocks import BlockFacts, Shape, progress_bar
from pipeline.runtime.model.weight_names import LAYER_LINEARS


def fold_into_producers(
    tensors: dict[str, torch.Tensor], block: int, scales: dict[str, torch.Tensor], shape: Shape
) -> None:
    """Divide whatever produces each linear layer's input by its scales, in place: the other half of a fold
    whose first half multiplied the layer's weight columns by them."""
    p = f"transformer.layers.{block}."
    s = scales["attention.qkv"]
    _update(tensors, p + "input_layernorm.weight", lambda w: w / s)

    grouped = shape.per_kv_column(scales["attention.dense"])
    if not torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
        raise ValueError(f"layer {block}: attention.dense scales differ within a KV head group")
    s_v = grouped[:, 0].reshape(-1)
    v = shape.v_rows
    _update(tensors, p + "attention.qkv.weight", lambda w: torch.cat((w[: v.start], w[v] / s_v[:, None])))
    if p + "attention.qkv.bias" in tensors:
        _update(tensors, p + "attention.qkv.bias", lambda b: torch.cat((b[: v.start], b[v] / s_v)))

    s = scales["mlp.gate_up"]
    _update(tensors, p + "post_layernorm.weight", lambda w: w / s)

    s = scales["mlp.proj"]
    inter = shape.intermediate
    _update(tensors, p + "mlp.gate_up.weight", lambda w: torch.cat((w[:inter], w[inter:] / s[:, None])))


def _update(tensors: dict[str, torch.Tensor], name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    tensors[name] = fn(tensors[name].to(torch.float32)).to(tensors[name].dtype)


@dataclass(frozen=True)
class BlockScales:
    """What scale_block chose for one block, per linear layer name."""

    scales: dict[str, torch.Tensor]  # the layer's inputs are divided by these, its weight columns multiplied
    alpha: dict[str, float]
    error_vs_round_to_nearest: dict[str, float]  # output error of rounding the result / of plain rounding


def scale_block(
    tensors: dict[str, torch.Tensor],
    block: int,
    stats: dict[str, InputStats],
    fmt: WeightFormat,
    shape: Shape,
    *,
    clip: bool = True,
) -> BlockScales:
    """Search, clip (unless told not to) and fold the linear layers of one block of `tensors` (runtime
    layout, in place)."""
    p = f"transformer.layers.{block}."
    scales, alphas, ratios = {}, {}, {}
    for name in LAYER_LINEARS:
        key = f"{p}{name}.weight"
        original = tensors[key].to(torch.float32)
        found = search_scales(
            original, stats[name], fmt, tie=shape.tie_heads if name == "attention.dense" else None
        )
        s = scales[name] = found.scales
        scaled = original * s
        if clip:
            scaled = search_clip(scaled, scaled_moment(stats[name], s), fmt)
        tensors[key] = scaled.to(tensors[key].dtype)
        error = output_error(fmt.round_trip(scaled) / s - original, stats[name].second_moment)
        alphas[name] = found.alpha
        ratios[name] = max(error, 1e-30) / max(found.plain_error, 1e-30)
    fold_into_producers(tensors, block, scales, shape)
    return BlockScales(scales, alphas, ratios)


def scaled_moment(stats: InputStats, scales: torch.Tensor) -> torch.Tensor:
    """E[(x/s)(x/s)^T] = M / (s s^T): the second moment of the inputs a scaled layer sees."""
    return stats.second_moment / torch.outer(scales, scales)


def apply_activation_aware_scales(
    tensors: dict[str, torch.Tensor],
    pretrained: dict[str, Any],
    block_stats: Iterable[tuple[int, dict[str, InputStats]]],
    fmt: WeightFormat,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Search, clip and fold every block of `tensors` (runtime layout, in place) against its calibration
    statistics. Returns facts: per linear layer, the alpha chosen in each block, and the output error of
    the result relative to round-to-nearest (geometric mean over blocks)."""
    shape = Shape.of(pretrained)
    facts = BlockFacts()
    bar = progress_bar(block_stats, pretrained, f"AWQ search ({fmt.scheme})", progress)
    for block, stats in bar:
        found = scale_block(tensors, block, stats, fmt, shape)
        facts.add(bar, found.error_vs_round_to_nearest, alpha=found.alpha)
    bar.close()
    return facts.summary()
