"""Checks shared by the tests of models whose bf16 lm_head is read widened (fp32 logits from bf16 weights)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.runtime.kernels import ops as kernels


def assert_widened_logits(logits: Callable[[], torch.Tensor], fp32_copy: torch.Tensor) -> None:
    """`logits()` of a widened head equal its fp32 copy's bit for bit on the register tiles; on AMX tiles (steps of
    2+ rows) the same exact products summed in another order, so to within fp32 rounding."""
    if kernels.kernels_available() and kernels.tiles_available():
        torch.testing.assert_close(logits(), fp32_copy, rtol=1e-5, atol=1e-5)
        before = kernels.set_tiles(False)
        try:
            assert torch.equal(logits(), fp32_copy)
        finally:
            kernels.set_tiles(before)
        return
    assert torch.equal(logits(), fp32_copy)
