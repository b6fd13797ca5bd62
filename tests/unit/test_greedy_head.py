"""The int8-screened greedy lm_head returns exactly the argmax of the fp32 logits the sampling path computes."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.model.greedy_head import GreedyLMHead
from pipeline.runtime.model.layers import DenseLinear

pytestmark = pytest.mark.skipif(
    not kernels.kernels_available(), reason=f"kernels unavailable: {kernels.kernels_unavailable_reason()}"
)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 4, 16])
def test_argmax_equals_the_fp32_logits_argmax(threads: int, rows: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(rows)
        weight = torch.randn(5003, 96, generator=gen)  # a vocabulary that is not a multiple of the row block
        weight[1:300] = weight[0] + 1e-5 * torch.randn(299, 96, generator=gen)  # near-ties with token 0
        head = GreedyLMHead(weight)
        for trial in range(20):
            x = torch.randn(rows, 96, generator=gen) * (1 + trial)
            x[0] = weight[0] * 0.5 if trial % 2 else x[0]  # a row whose best logits nearly tie
            logits = kernels.gemm_f32(x, weight)  # the sampling path's logits
            assert head(x) == logits.argmax(dim=1).tolist()
    finally:
        torch.set_num_threads(before)


def test_ties_go_to_the_first_token() -> None:
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    weight[40] = weight[7] = weight.abs().max() * 4 * torch.ones(32)
    assert GreedyLMHead(weight)(torch.ones(2, 32)) == [7, 7]


def test_argmax_survives_the_activation_rounding_of_the_screen() -> None:
    """The screen rounds each row to int16 levels (step amax / 16383). Here one large activation sets that step and
    575 small ones sit just under half of it, so all of them round to zero: token 0's weights meet only the small
    ones and its screened logit is 0, while its exact logit beats token 1's, which meets only the large one."""
    K, big = 576, 16383.0
    step = big / 16383.0
    x = torch.full((1, K), step * (0.5 - 2**-10))
    x[0, 0] = big
    small_sum = float(x[0, 1:].sum())
    weight = torch.zeros(2, K)
    weight[0, 1:] = 1.0
    weight[1, 0] = 0.99 * small_sum / big
    logits = kernels.gemm_f32(x, weight)
    assert logits.argmax(dim=1).tolist() == [0]
    assert GreedyLMHead(weight)(x) == [0]


@pytest.mark.parametrize("rows", [1, 16])
def test_a_bf16_weight_widened_gives_the_fp32_argmax(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(3001, 96, generator=gen).bfloat16()
    weight[1:200] = weight[0]  # exact ties with token 0 in bf16
    weight[1:200, :4] += torch.randn(199, 4, generator=gen).bfloat16() * 1e-2
    x = torch.randn(rows, 96, generator=gen)
    x[0] = weight[0].float()
    want = kernels.gemm_f32(x, weight.float()).argmax(dim=1).tolist()
    assert GreedyLMHead(weight)(x) == GreedyLMHead(weight.float())(x) == want


def test_only_heads_with_fp32_logits_are_screened() -> None:
    weight = torch.randn(64, 32)
    assert GreedyLMHead.for_lm_head(DenseLinear(weight)) is not None
    assert GreedyLMHead.for_lm_head(DenseLinear(weight.bfloat16(), widened=True)) is not None
    assert GreedyLMHead.for_lm_head(DenseLinear(weight.bfloat16())) is None  # logits of bf16-rounded rows
    assert GreedyLMHead.for_lm_head(DenseLinear(weight, torch.ones(64))) is None  # the screen has no bias
