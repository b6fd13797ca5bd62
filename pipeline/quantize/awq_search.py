"""Activation-aware weight quantization (AWQ, Lin et al. 2023): the search math, on plain tensors.

A linear layer y = x @ W.T computes the same y with W * s (each input column c multiplied by s[c]) and
x / s, and the division can be folded into whatever produced x (a norm weight, the rows of an earlier
linear layer). Rounding W * s instead of W protects the columns whose inputs are large: a column scaled
up by s gets a relatively finer grid, and its rounding error is divided by s again on the way out. The
scales are s = mean|x|^alpha (normalised), alpha searched on a grid; then each group's clipping range is
searched. Both searches minimise the layer's output error on calibration inputs, computed from the inputs'
second moment M = E[x x^T]: E||x @ (W' - W).T||^2 = sum((D @ M) * D) with D = W' - W, so no activation
has to be kept once M is accumulated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.runtime.quant import primitives

# alpha in {0, 1/20, ..., 1}; alpha = 0 is plain round-to-nearest, so the search never does worse than it
# on the calibration data.
SCALE_GRID = 20
# Clipping keeps max|w| * r for r in {1, 1 - 1/20, ..., 0.5} of each group (r = 1: no clipping).
CLIP_GRID = 20
CLIP_MIN_RATIO = 0.5
# Channels that never fire would get scale 0 ** alpha; the floor keeps them finite.
MIN_ACTIVATION = 1e-5


@dataclass(frozen=True)
class WeightFormat:
    """The quantizer searched against: int8 per output channel, or int4 groups of `group_size` columns."""

    scheme: str  # "int8" or "int4", as QuantLinear names them
    group_size: int | None = None

    def round_trip(self, weight: torch.Tensor) -> torch.Tensor:
        """What the engine computes with after quantizing `weight`: dequantize(quantize(weight))."""
        if self.scheme == "int8":
            return primitives.dequantize_int8(*primitives.quantize_int8_per_channel(weight))
        assert self.group_size is not None
        packed, scales, zeros = primitives.quantize_int4_groupwise(weight, self.group_size)
        return primitives.dequantize_int4(packed, scales, zeros, self.group_size)

    def column_groups(self, in_features: int) -> list[slice]:
        """The column ranges that share a quantization scale (the whole row for int8)."""
        step = in_features if self.scheme == "int8" else self.group_size
        assert step is not None
        return [slice(start, min(start + step, in_features)) for start in range(0, in_features, step)]


class InputStats:
    """Running statistics of a linear layer's inputs over calibration tokens: E[|x|], max |x| and E[x x^T]."""

    def __init__(self, in_features: int) -> None:
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.abs_max = torch.zeros(in_features)
        self.gram = torch.zeros(in_features, in_features)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.gram.shape[0]).to(torch.float32)
        self.abs_sum += x.abs().sum(0, dtype=torch.float64)
        torch.maximum(self.abs_max, x.abs().amax(0), out=self.abs_max)
        self.gram.addmm_(x.T, x)
        self.tokens += x.shape[0]

    @property
    def mean_abs(self) -> torch.Tensor:
        """[in] E|x_c|."""
        return (self.abs_sum / max(self.tokens, 1)).to(torch.float32)

    @property
    def second_moment(self) -> torch.Tensor:
        """[in, in] E[x x^T]."""
        return self.gram / max(self.tokens, 1)


def output_error(delta: torch.Tensor, second_moment: torch.Tensor) -> float:
    """Mean over tokens of ||x @ delta.T||^2 for inputs x with E[x x^T] = second_moment."""
    return float(((delta @ second_moment) * delta).sum())


@dataclass(frozen=True)
class ScaleSearch:
    scales: torch.Tensor  # [in]: quantize W * scales; the layer's inputs must be divided by them
    alpha: float
    error: float  # output error of the chosen scales
    plain_error: float  # output error of round-to-nearest without scales (alpha = 0)


def search_scales(
    weight: torch.Tensor,
    stats: InputStats,
    fmt: WeightFormat,
    *,
    tie: Callable[[torch.Tensor], torch.Tensor] | None = None,
    grid: int = SCALE_GRID,
) -> ScaleSearch:
    """The per-input-channel scales s = mean|x|^alpha (normalised to geometric mid-range 1) whose rounded
    W * s, divided back by s, has the least output error on the calibration inputs.

    `tie` maps the per-channel activation means to ones shared by channels that must get the same scale
    (the columns an earlier layer's single row feeds); it must keep the shape.
    """
    weight = weight.detach().to(torch.float32)
    moment = stats.second_moment
    activation = stats.mean_abs.clamp(min=MIN_ACTIVATION)
    if tie is not None:
        activation = tie(activation)
    best: ScaleSearch | None = None
    plain_error = 0.0
    for step in range(grid + 1):
        alpha = step / grid
        scales = activation.pow(alpha)
        scales = scales / (scales.max() * scales.min()).sqrt()
        error = output_error(fmt.round_trip(weight * scales) / scales - weight, moment)
        if step == 0:
            plain_error = error
        if best is None or error < best.error:
            best = ScaleSearch(scales, alpha, error, plain_error)
    assert best is not None
    return best


def search_clip(
    weight: torch.Tensor,
    second_moment: torch.Tensor,
    fmt: WeightFormat,
    *,
    grid: int = CLIP_GRID,
    min_ratio: float = CLIP_MIN_RATIO,
) -> torch.Tensor:
    """`weight` with each (row, group) clamped to +-max|w| * r, r chosen per (row, group) to minimise that
    group's share of the output error, sum over its columns of x_c * (w' - w)_c, on the calibration inputs
    (the cross-group terms are ignored, as in AWQ). Quantizing the result rounds within the clipped range."""
    weight = weight.detach().to(torch.float32)
    groups = fmt.column_groups(weight.shape[1])
    amax = torch.stack([weight[:, cols].abs().amax(1) for cols in groups], dim=1)  # [out, G]
    best_error = torch.full_like(amax, float("inf"))
    best_limit = amax.clone()
    for step in range(grid + 1):
        ratio = 1.0 - (1.0 - min_ratio) * step / grid
        limit = amax * ratio
        clipped = _clamp_groups(weight, limit, groups)
        delta = fmt.round_trip(clipped) - weight
        errors = torch.stack(
            [((delta[:, cols] @ second_moment[cols, cols]) * delta[:, cols]).sum(1) for cols in groups], dim=1
        )
        better = errors < best_error
        best_error = torch.where(better, errors, best_error)
        best_limit = torch.where(better, limit, best_limit)
    return _clamp_groups(weight, best_limit, groups)


def _clamp_groups(weight: torch.Tensor, limit: torch.Tensor, groups: list[slice]) -> torch.Tensor:
    # limit [out, G]: each group's columns clamped to [-limit, limit] of their row.
    bound = torch.cat(
        [limit[:, g : g + 1].expand(-1, cols.stop - cols.start) for g, cols in enumerate(groups)], dim=1
    )
    return torch.maximum(torch.minimum(weight, bound), -bound)
