"""GPTQ (Frantar et al. 2022) for the int4 group-wise format: the rounding math, on plain tensors.

Round-to-nearest rounds every weight on its own. GPTQ rounds the input columns of a linear layer one at a
time and moves each column's rounding error onto the columns not yet rounded, weighted so that the layer's
output error on calibration inputs, E||x @ (W' - W).T||^2 with H = E[x x^T], stays least: after rounding
column i, every later column j gets  w_j -= err_i * U[i, j] / U[i, i]  with U the upper Cholesky factor of
H^-1 (rows of H^-1 restricted to the columns left, without re-inverting H each step). Updates to columns
beyond the current batch of LAZY_BATCH columns are applied once per batch, as one matrix product.

Columns are visited in order of decreasing input energy H[c, c] ("act order"): the columns that matter most
are rounded while the most columns remain to absorb their error. So that the order cannot change the format,
every group's grid is fixed before any error moves ("static groups"): per (row, group) the clipping range
that runtime.quant.awq.search_clip picks on the weight as given, which is worth more at 4 bits than the bare
min and max. The result is the engine's int4 format unchanged (primitives.py: groups of consecutive
columns, each with its scale and zero point); GPTQ only chooses which level each weight takes.
"""

from __future__ import annotations

import torch

from pipeline.runtime.quant import primitives
from pipeline.runtime.quant.awq import WeightFormat, search_clip

# H + DAMP * mean(diag H) * I: the calibration Gram matrix is near-singular (correlated channels, few
# tokens per dimension); 1 % is the paper's setting.
DAMP = 0.01
LAZY_BATCH = 128  # columns per batch of deferred updates


def gptq_int4(
    weight: torch.Tensor, second_moment: torch.Tensor, group_size: int, *, damp: float = DAMP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float weight and its inputs' [in, in] E[x x^T] -> (packed uint8 [out, in // 2], scales
    fp32 [out, G], zeros fp32 [out, G]), the layout of primitives.quantize_int4_groupwise."""
    weight = weight.detach().to(torch.float32)
    out_features, in_features = weight.shape
    lo, hi = primitives.int4_group_range(
        search_clip(weight, second_moment, WeightFormat("int4", group_size)), group_size
    )
    scales, zeros = primitives.int4_grid(lo, hi)
    order = torch.argsort(second_moment.diagonal(), descending=True, stable=True)
    groups = (order // group_size).tolist()
    w = weight[:, order]  # a copy, in visiting order
    u = inverse_hessian_factor(second_moment[order][:, order], damp)
    levels = torch.empty(out_features, in_features, dtype=torch.uint8)  # in visiting order
    for start in range(0, in_features, LAZY_BATCH):
        stop = min(start + LAZY_BATCH, in_features)
        cols = w[:, start:stop]  # a view: updated in place
        errors = torch.empty_like(cols)
        u_batch = u[start:stop, start:stop]
        for i in range(stop - start):
            g = groups[start + i]
            q = primitives.int4_levels(cols[:, i], lo[:, g], scales[:, g])
            levels[:, start + i] = q
            # what the engine computes with (primitives.dequantize_int4), so the error moved on is exact
            rounded = (q.to(torch.float32) - zeros[:, g]) * scales[:, g]
            errors[:, i] = (cols[:, i] - rounded) / u_batch[i, i]
            cols[:, i:].addr_(errors[:, i], u_batch[i, i:], alpha=-1.0)
        w[:, stop:].addmm_(errors, u[start:stop, stop:], alpha=-1.0)
    unpermuted = torch.empty_like(levels)
    unpermuted[:, order] = levels
    return primitives.pack_int4(unpermuted), scales, zeros


def inverse_hessian_factor(second_moment: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, U^T U = H^-1, fp32 [in, in]. Inputs
    that never fired get H[c, c] = 1: their columns neither take nor give error."""
    h = second_moment.detach().to(torch.float64).clone()
    diag = h.diagonal()
    dead = diag == 0
    h[dead, dead] = 1.0
    diag += damp * diag.mean()
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True).to(torch.float32)
