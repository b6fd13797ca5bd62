"""Exact greedy argmax of the lm_head reading an int8 copy of it.

For batch-1 decode on CPU the lm_head GEMV (vocab x hidden: 113 MB for SmolLM2 in fp32, 57 MB in bf16) is
bandwidth-bound and a sixth of the step. Greedy only needs the argmax, so: compute approximate logits with an int8 copy of
the weight, keep every token whose logit could still be the largest under a rigorous error bound, and
compute exact fp32 logits for those candidates only. The result is the argmax of the fp32 logits.
"""

from __future__ import annotations

import torch

from pipeline.runtime.kernels.ops import greedy_argmax, kernels_available
from pipeline.runtime.model.layers import DenseLinear, Linear
from pipeline.runtime.quant.primitives import quantize_int8_per_channel

# Unit roundoff of fp32.
_U = 2.0**-24


class GreedyLMHead:
    # Screening pays off while the int8 screen is cheaper than the fp32 logits: measured on SmolLM2's head
    # (2 threads), 1.8x faster at 16 rows (int8 FMAs from half the bytes, no logits tensor), slower at 32.
    max_rows = 16

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # [vocab, hidden] fp32, or bf16 widened exactly (DenseLinear.widened)
        self.qweight, self.scales = quantize_int8_per_channel(weight)
        hidden = weight.shape[1]
        # NOTE: |x.w - x.w_q| <= ||x||_1 * max_i |w_i - w_q,i| <= ||x||_1 * scale / 2 (round to nearest), per
        # token with its own scale: bounding every token by the largest scale instead left ~100x more
        # candidates (thousands per row on SmolLM2). Both dot products also carry fp32 summation error
        # <= hidden * u * ||x||_1 * max|w|, and max|w| = 127 * scale; twice that (each side) plus margin is the
        # second term, and the last factor covers the rounding of the bound arithmetic itself.
        self.error_per_l1 = (self.scales * (0.5 + 4 * hidden * _U * 127) * (1 + 2**-10)).contiguous()
        # NOTE: the screen also rounds each row to int16 levels of step amax / 16383 (quantize_rows_int16), which
        # moves token v's approximate logit by at most scale_v * sum_i |q_v,i| * step / 2: the kernel multiplies
        # this by the row's step (the step's own rounding, and the levels' clamp, stay within the margins).
        self.error_per_level = (
            self.scales * self.qweight.abs().sum(dim=1, dtype=torch.float64).float() * 0.5 * (1 + 2**-10)
        ).contiguous()

    @classmethod
    def for_lm_head(cls, lm_head: Linear) -> GreedyLMHead | None:
        """The screening head of a dense CPU lm_head without bias whose logits are fp32 ones (an fp32 weight,
        or a widened bf16 one), where the kernels run; None otherwise."""
        if not isinstance(lm_head, DenseLinear) or lm_head.bias is not None:
            return None
        weight = lm_head.weight
        fp32_logits = weight.dtype == torch.float32 or lm_head.widened
        return cls(weight) if weight.device.type == "cpu" and fp32_logits and kernels_available() else None

    def __call__(self, x: torch.Tensor) -> list[int]:
        """x [R, hidden] (final-normed rows) -> argmax token id per row (one kernel call: the int8 screen,
        then exact fp32 logits for the tokens whose bounds reach the best one's)."""
        return greedy_argmax(
            x, self.qweight, self.scales, self.weight, self.error_per_l1, self.error_per_level
        ).tolist()
