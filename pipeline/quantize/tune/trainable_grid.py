"""Trainable stand-ins for the engine's int4 linear layers, shared by the block-wise (block_tune.py) and the
end-to-end (grid_tune.py) tuning of quantization.tune: they compute exactly what the packed format computes,
with each group's scale and zero point (and, while a block is tuned, each weight's level) as parameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.runtime.quant import primitives

# Zero points move in levels. A relative scale change c moves a group's outer levels by ~7.5c levels (half of
# 15), so the zero points take steps of this many times the scales' for a comparable effect.
ZERO_STEP = 5.0


class TunedGrid(torch.nn.Module):
    """One runtime int4 linear layer: per-group scales and zero points to train; levels fixed, or free to
    move by whole levels between `free_levels` and `fix_levels`."""

    levels: torch.Tensor
    base_scales: torch.Tensor
    base_zeros: torch.Tensor
    level_change: torch.nn.Parameter | None

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
        super().__init__()
        levels = primitives.unpack_int4(qweight).to(torch.float32)
        out_features, self.in_features = levels.shape
        groups = scales.shape[1]
        padded = F.pad(levels, (0, groups * group_size - self.in_features))
        self.register_buffer("levels", padded.view(out_features, groups, group_size))
        self.register_buffer("base_scales", scales.to(torch.float32))
        self.register_buffer("base_zeros", zeros.to(torch.float32))
        # A relative change keeps one learning rate right for groups whose scales differ by orders of magnitude.
        self.scale_change = torch.nn.Parameter(torch.zeros_like(self.base_scales))
        self.zero_change = torch.nn.Parameter(torch.zeros_like(self.base_zeros))
        self.register_parameter("level_change", None)

    def free_levels(self) -> torch.nn.Parameter:
        """Give every weight a continuous offset to its level, rounded in the forward pass (straight-through);
        returns the offsets."""
        self.level_change = torch.nn.Parameter(torch.zeros_like(self.levels))
        return self.level_change

    def fix_levels(self, keep: bool) -> None:
        """End `free_levels`: the rounded offsets become the levels if `keep`, else they are dropped."""
        if keep:
            with torch.no_grad():
                self.levels = self.current_levels().detach()
        self.level_change = None

    def current_levels(self, rows: slice = slice(None)) -> torch.Tensor:
        if self.level_change is None:
            return self.levels[rows]
        moved = self.levels[rows] + self.level_change[rows]
        return ((moved.round() - moved).detach() + moved).clamp(0, primitives.INT4_QMAX)

    def scales(self, rows: slice = slice(None)) -> torch.Tensor:
        return self.base_scales[rows] * (1 + self.scale_change[rows])

    def zeros(self, rows: slice = slice(None)) -> torch.Tensor:
        return self.base_zeros[rows] + self.zero_change[rows]

    def weight(self, rows: slice = slice(None)) -> torch.Tensor:
        w = (self.current_levels(rows) - self.zeros(rows)[..., None]) * self.scales(rows)[..., None]
        return w.flatten(1)[:, : self.in_features]

    def qweight(self) -> torch.Tensor:
        """The levels in the packed on-disk layout."""
        return primitives.pack_int4(self.current_levels().flatten(1)[:, : self.in_features].to(torch.uint8))


class GridRows(torch.nn.Module):
    """An HF linear layer computed from its rows of a fused TunedGrid (q/k/v share attention.qkv)."""

    def __init__(self, grid: TunedGrid, rows: slice, bias: torch.Tensor | None):
        super().__init__()
        self.grid, self.rows, self.bias = grid, rows, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.grid.weight(self.rows), self.bias)


def grid_optimizer(grids: list[TunedGrid], learning_rate: float) -> torch.optim.Adam:
    """Adam over the grids' scales (relative steps of `learning_rate`) and zero points (ZERO_STEP x, in levels)."""
    return torch.optim.Adam(
        [
            {"params": [g.scale_change for g in grids], "lr": learning_rate},
            {"params": [g.zero_change for g in grids], "lr": ZERO_STEP * learning_rate},
        ]
    )
