"""Exact greedy argmax of the lm_head reading a quarter of its bytes.

For batch-1 decode on CPU the lm_head GEMV (vocab x hidden fp32, 113 MB for SmolLM2) is bandwidth-bound
and a sixth of the step. Greedy only needs the argmax, so: compute approximate logits with an int8 copy of
the weight, keep every token whose logit could still be the largest under a rigorous error bound, and
compute exact fp32 logits for those candidates only. The result is the argmax of the fp32 logits.
"""

from __future__ import annotations

import torch

from pipeline.runtime.quant.kernels import gemm_int8, kernels_available
from pipeline.runtime.quant.primitives import quantize_int8_per_channel

# Unit roundoff of fp32.
_U = 2.0**-24


class GreedyLMHead:
    # Screening pays off while the int8 GEMV is bandwidth-bound (few rows); beyond that fp32 is as fast.
    max_rows = 4

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # [vocab, hidden] fp32
        self.qweight, self.scales = quantize_int8_per_channel(weight)
        hidden = weight.shape[1]
        # NOTE: |x.w - x.w_q| <= ||x||_1 * max_i |w_i - w_q,i| <= ||x||_1 * scale / 2 (round to nearest).
        # Both dot products also carry fp32 summation error <= hidden * u * ||x||_1 * max|w|, and
        # max|w| = 127 * scale; twice that (each side) plus margin is the second term.
        worst_scale = float(self.scales.max())
        self.error_per_l1 = worst_scale * (0.5 + 4 * hidden * _U * 127)

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.float32 and kernels_available()

    def __call__(self, x: torch.Tensor) -> list[int]:
        """x [R, hidden] (final-normed rows) -> argmax token id per row."""
        approx = gemm_int8(x, self.qweight, self.scales)  # [R, vocab]
        bound = x.abs().sum(dim=1, keepdim=True) * self.error_per_l1  # [R, 1]
        # A token can be the argmax only if its upper bound reaches the best lower bound.
        candidates = approx >= approx.amax(dim=1, keepdim=True) - 2 * bound  # [R, vocab]
        ids = candidates.any(dim=0).nonzero().squeeze(1)  # union over rows [C]
        exact = x @ self.weight.index_select(0, ids).T  # [R, C]
        exact.masked_fill_(~candidates.index_select(1, ids), float("-inf"))
        return ids[exact.argmax(dim=1)].tolist()
