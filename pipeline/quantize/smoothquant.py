"""SmoothQuant (Xiao et al. 2023) for the torch backend's int8_sq (W8A8): per-input-channel smoothing scales
measured on the calibration set and folded into the preceding weights, before every linear layer's weight is
rounded to int8 per output channel; the engine rounds the activations to int8 per token at run time
(`primitives.round_activations_int8`).

A few input channels of a transformer's linear layers carry activations tens of times larger than the rest,
and one int8 step per token is then set by them. Dividing channel c's inputs by
    s_c = max|x_c|^alpha / max|W[:, c]|^(1 - alpha)
and multiplying its weight column by s_c computes the same function with flatter activations and a weight
that absorbs part of their range (alpha = quantization.smoothquant_alpha; 0.5 balances the two). The
division is folded as quantize/awq.py folds AWQ's scales (norm weights, the v rows of qkv, the up rows of
gate_up); a fused layer (qkv, gate_up) takes each column's maximum over all its rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pipeline.quantize.awq import fold_into_producers
from pipeline.quantize.awq_search import MIN_ACTIVATION, InputStats
from pipeline.quantize.blocks import Shape, progress_bar
from pipeline.runtime.model.weight_names import LAYER_LINEARS


def smoothing_scales(weight: torch.Tensor, stats: InputStats, alpha: float) -> torch.Tensor:
    """[in] s_c for a layer's [out, in] weight and its inputs' statistics."""
    activation = stats.abs_max.clamp(min=MIN_ACTIVATION)
    column = weight.detach().to(torch.float32).abs().amax(0).clamp(min=MIN_ACTIVATION)
    return activation.pow(alpha) / column.pow(1.0 - alpha)


def peak_to_mean(channel_max: torch.Tensor) -> float:
    """How much the largest channel's range exceeds the average one: the int8 step an outlier costs a token."""
    return float(channel_max.max() / channel_max.mean().clamp(min=MIN_ACTIVATION))


def apply_smoothquant(
    tensors: dict[str, torch.Tensor],
    pretrained: dict[str, Any],
    block_stats: Iterable[tuple[int, dict[str, InputStats]]],
    alpha: float,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Smooth every block of `tensors` (runtime layout, in place) with its calibration statistics. Returns
    facts: alpha, and per linear layer the inputs' largest channel range over the mean one before and after
    smoothing (mean over blocks)."""
    shape = Shape.of(pretrained)
    before: dict[str, list[float]] = {name: [] for name in LAYER_LINEARS}
    after: dict[str, list[float]] = {name: [] for name in LAYER_LINEARS}
    bar = progress_bar(block_stats, pretrained, "SmoothQuant", progress)
    for block, stats in bar:
        p = f"transformer.layers.{block}."
        scales = {}
        for name in LAYER_LINEARS:
            key = f"{p}{name}.weight"
            weight = tensors[key].to(torch.float32)
            s = smoothing_scales(weight, stats[name], alpha)
            if name == "attention.dense":  # the columns one v row feeds share its fold
                s = shape.tie_heads(s)
            scales[name] = s
            tensors[key] = (weight * s).to(tensors[key].dtype)
            before[name].append(peak_to_mean(stats[name].abs_max))
            after[name].append(peak_to_mean(stats[name].abs_max / s))
        fold_into_producers(tensors, block, scales, shape)
    bar.close()

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 2) if values else None

    return {
        "alpha": alpha,
        "activation_peak_to_mean_before": {name: mean(v) for name, v in before.items()},
        "activation_peak_to_mean_after": {name: mean(v) for name, v in after.items()},
    }
