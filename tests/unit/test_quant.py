"""Weight-only quantization: round-trip bounds, the on-disk layout, kernels vs the dequantize + matmul path."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.runtime.kernels import build
from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.kernels.build import cache_path, compile_cached, compiler_identity
from pipeline.runtime.model.layers import DenseLinear
from pipeline.runtime.quant import linear as linear_module
from pipeline.runtime.quant import primitives
from pipeline.runtime.quant.linear import QuantLinear, fp32_linear, max_kernel_rows

ROOT = Path(__file__).resolve().parents[2]
needs_kernels = pytest.mark.skipif(
    not kernels.kernels_available(), reason=f"kernels unavailable: {kernels.kernels_unavailable_reason()}"
)
# (group_size, in): short last groups, in % 32 != 0; on AVX-512, chunk pairs of every group size they fold, an
# odd last chunk after them, and a group size they leave to the 8-lane loop (192)
INT4_CASES = [(32, 96), (64, 130), (64, 96), (128, 576), (32, 320), (256, 448), (192, 448)]


def random_weight(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitude, as in real checkpoints, plus an all-zero row.
    w = torch.randn(out_f, in_f, generator=gen) * torch.logspace(-3, 0, out_f)[:, None]
    w[out_f // 2] = 0
    return w


def assert_close_rel(y: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    err = (y - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max abs error {err:.3g} vs max |ref| {ref.abs().max():.3g}"


def test_int8_round_trip_within_half_a_step_per_row() -> None:
    w = random_weight(37, 131)
    qweight, scales = primitives.quantize_int8_per_channel(w)
    assert qweight.dtype == torch.int8 and qweight.shape == (37, 131)
    assert scales.dtype == torch.float32 and scales.shape == (37,)
    assert qweight.abs().max() <= 127
    err = (primitives.dequantize_int8(qweight, scales) - w).abs().amax(dim=1)
    assert torch.all(err <= scales / 2 * (1 + 1e-5))
    assert err[37 // 2] == 0  # the all-zero row decodes to zeros


@pytest.mark.parametrize(("group_size", "in_f"), INT4_CASES)
def test_int4_round_trip_within_half_a_step_per_group(group_size: int, in_f: int) -> None:
    w = random_weight(19, in_f)
    w[3, :group_size] = 0.25  # a constant group
    packed, scales, zeros = primitives.quantize_int4_groupwise(w, group_size)
    num_g = -(-in_f // group_size)
    assert packed.dtype == torch.uint8 and packed.shape == (19, in_f // 2)
    assert scales.shape == zeros.shape == (19, num_g)
    deq = primitives.dequantize_int4(packed, scales, zeros, group_size)
    bound = (scales / 2).repeat_interleave(group_size, dim=1)[:, :in_f]
    assert torch.all((deq - w).abs() <= bound * (1 + 1e-5) + 1e-7)
    assert torch.equal(deq[3, :group_size], w[3, :group_size])


def test_int4_packing_layout_is_low_nibble_first() -> None:
    # Row [1, 2, 3, 4, 15, 0]: byte j = q[2j] | q[2j + 1] << 4.
    q = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = primitives.pack_int4(q)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(primitives.unpack_int4(packed), q)


def test_int4_reproduces_a_16_level_grid_exactly() -> None:
    # A Q4_1-style block (min + q * step, min and max both present) survives requantization at group 32.
    gen = torch.Generator().manual_seed(1)
    levels = torch.randint(0, 16, (4, 32), generator=gen)
    levels[:, 0], levels[:, 1] = 0, 15
    w = -0.37 + levels.float() * 0.0123
    packed, scales, zeros = primitives.quantize_int4_groupwise(w, 32)
    assert torch.equal(primitives.unpack_int4(packed), levels.to(torch.uint8))
    torch.testing.assert_close(primitives.dequantize_int4(packed, scales, zeros, 32), w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("group_size", [0, 48, 100])
def test_int4_rejects_group_sizes_the_kernels_cannot_walk(group_size: int) -> None:
    with pytest.raises(ValueError, match="group_size"):
        primitives.quantize_int4_groupwise(torch.zeros(4, 192), group_size)


def test_int4_rejects_odd_in_features() -> None:
    with pytest.raises(ValueError, match="even"):
        primitives.quantize_int4_groupwise(torch.zeros(4, 65), 32)


def test_kernels_build_on_x86_linux_with_a_compiler() -> None:
    reason = kernels.kernels_unavailable_reason()
    if "x86-64 Linux" in reason or "compiler" in reason or "LLMPIPE_DISABLE_KERNELS" in reason:
        pytest.skip(reason)
    assert kernels.kernels_available(), reason


@needs_kernels
@pytest.mark.parametrize("int8_activations", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize(("out_f", "in_f"), [(5, 7), (37, 131), (130, 576)])
def test_int8_kernel_matches_dequantize_matmul(
    rows: int, out_f: int, in_f: int, int8_activations: bool
) -> None:
    qweight, scales = primitives.quantize_int8_per_channel(random_weight(out_f, in_f))
    x = torch.randn(rows, in_f)
    bias = torch.randn(out_f)
    rounded = (primitives.round_activations_int8 if int8_activations else primitives.round_activations_int16)(
        x
    )
    ref = F.linear(rounded, primitives.dequantize_int8(qweight, scales), bias)
    assert_close_rel(kernels.gemm_int8(x, qweight, scales, bias, int8_activations), ref)
    if int8_activations:  # int8 levels are 128x coarser: the int16 rounding's result is measurably elsewhere
        other = F.linear(
            primitives.round_activations_int16(x), primitives.dequantize_int8(qweight, scales), bias
        )
        assert not torch.allclose(
            kernels.gemm_int8(x, qweight, scales, bias, True), other, rtol=1e-4, atol=1e-4
        )


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17])
@pytest.mark.parametrize(("out_f", "in_f"), [(37, 131), (130, 576)])
def test_w8a8_with_its_byte_bias_kept_gives_the_bits_of_summing_it_per_call(
    rows: int, out_f: int, in_f: int
) -> None:
    qweight, scales = primitives.quantize_int8_per_channel(random_weight(out_f, in_f))
    byte_bias = kernels.int8_byte_bias(qweight)
    assert torch.equal(byte_bias, 128 * qweight.sum(dim=1, dtype=torch.int64))
    x, bias = torch.randn(rows, in_f) * 3, torch.randn(out_f)
    want = kernels.gemm_int8(x, qweight, scales, bias, True)
    assert torch.equal(kernels.gemm_int8(x, qweight, scales, bias, True, byte_bias), want)
    layer = QuantLinear("w8a8", {"qweight": qweight, "scales": scales, "bias": bias})
    assert torch.equal(layer(x), want) and torch.equal(layer(x), want)  # the second call reuses the sums


@pytest.mark.parametrize(
    ("round_rows", "qmax"),
    [
        (primitives.round_activations_int16, primitives.ACT_QMAX),
        (primitives.round_activations_int8, primitives.W8A8_ACT_QMAX),
    ],
    ids=["int16", "int8"],
)
def test_activations_round_to_each_rows_grid(
    round_rows: Callable[[torch.Tensor], torch.Tensor], qmax: int
) -> None:
    x = torch.tensor([[0.5, -2.0, 1e-6, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.75, 1e-3]])
    rounded = round_rows(x)
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / qmax
    levels = rounded[[0, 2]] / scale[[0, 2]]
    assert torch.equal(levels, levels.round()) and levels.abs().max() == qmax
    assert torch.equal(rounded[1], x[1])  # an all-zero row stays zero
    assert rounded[0, 2] == 0.0  # below half a step
    assert ((rounded - x).abs() <= scale / 2 * (1 + 1e-6)).all()


@needs_kernels
@pytest.mark.parametrize("in_f", [8192 + 96, 16384 + 96, 40000])
def test_int8_kernel_sums_exactly_past_an_int32_lanes_range(in_f: int) -> None:
    # Every weight and activation at full scale: each int32 lane would overflow after 8256 columns (AVX2) or
    # 16512 (AVX-512) if the kernel did not fold its sums into int64 span by span.
    qweight = torch.full((5, in_f), 127, dtype=torch.int8)
    qweight[1] = -127
    scales = torch.ones(5)
    x = torch.ones(2, in_f)
    y = kernels.gemm_int8(x, qweight, scales)
    exact = 127.0 * in_f
    torch.testing.assert_close(y[:, 0], torch.full((2,), exact), rtol=1e-6, atol=0)
    torch.testing.assert_close(y[:, 1], torch.full((2,), -exact), rtol=1e-6, atol=0)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize(("group_size", "in_f"), INT4_CASES)
def test_int4_kernel_matches_dequantize_matmul(rows: int, group_size: int, in_f: int) -> None:
    out_f = 37
    packed, scales, zeros = primitives.quantize_int4_groupwise(random_weight(out_f, in_f), group_size)
    x = torch.randn(rows, in_f)
    bias = torch.randn(out_f)
    ref = int4_reference(x, packed, scales, zeros, group_size, bias)
    assert_close_rel(kernels.gemm_int4(x, packed, scales, zeros, group_size, bias), ref)


def int4_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The int4 layer's product as primitives documents it, in fp32."""
    return F.linear(
        *primitives.int4_operands(x, primitives.dequantize_int4(packed, scales, zeros, group_size)), bias
    )


@needs_kernels
@pytest.mark.parametrize(("group_size", "in_f"), [(32, 96), (128, 576)])
def test_int4_kernel_switches_roundings_at_the_same_row_count_as_the_fallback(
    group_size: int, in_f: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed, scales, zeros = primitives.quantize_int4_groupwise(random_weight(64, in_f), group_size)
    layer = QuantLinear("int4", {"qweight": packed, "scales": scales, "zeros": zeros}, group_size)
    w = primitives.dequantize_int4(packed, scales, zeros, group_size)
    for rows in (primitives.INT4_DIRECT_MAX_ROWS, primitives.INT4_DIRECT_MAX_ROWS + 1):
        x = torch.randn(rows, in_f)
        int16 = F.linear(primitives.round_activations_int16(x), w)
        bf16 = F.linear(primitives.round_bf16(x), primitives.round_bf16(w))
        assert (int16 - bf16).abs().max() > 1e-3 * int16.abs().max()  # the two products are told apart
        want = int16 if rows <= primitives.INT4_DIRECT_MAX_ROWS else bf16
        assert_close_rel(kernels.gemm_int4(x, packed, scales, zeros, group_size), want, rel=1e-5)
        with torch.no_grad():
            assert_close_rel(layer(x), want, rel=1e-5)
            with monkeypatch.context() as patch:  # the dequantize + matmul path
                patch.setattr(linear_module, "_kernel_ok", lambda _x: False)
                assert_close_rel(layer(x), want, rel=1e-5)


@needs_kernels
@pytest.mark.parametrize("in_f", [131, 1000])  # 1000: many rows take K in slices, the last one short
@pytest.mark.parametrize("rows", [1, 3, 17, 40])
def test_fp32_kernel_matches_torch(rows: int, in_f: int) -> None:
    w, x = random_weight(37, in_f), torch.randn(rows, in_f)
    assert_close_rel(kernels.gemm_f32(x, w), F.linear(x, w))
    assert_close_rel(fp32_linear(x, w), F.linear(x, w))


@needs_kernels
def test_a_bf16_weight_widened_gives_the_fp32_copys_bits() -> None:
    """A bf16 weight read widened (a bf16 checkpoint's lm_head) gives what its fp32 copy gives, bit for bit,
    in the kernel and in fp32_linear past the kernel's rows; a bf16 DenseLinear that is not widened rounds the
    activations instead, which this test tells apart."""
    w = random_weight(37, 131).bfloat16()
    bias = torch.randn(37)
    for rows in (1, 2, 5, 16, max_kernel_rows("fp32") + 1):
        x = torch.randn(rows, 131)
        if rows <= max_kernel_rows("fp32"):
            assert torch.equal(kernels.gemm_f32(x, w, bias), kernels.gemm_f32(x, w.float(), bias))
        assert torch.equal(fp32_linear(x, w, bias), fp32_linear(x, w.float(), bias))
        widened = DenseLinear(w, bias, widened=True)
        assert torch.equal(widened(x), fp32_linear(x, w.float(), bias))
        assert not torch.equal(DenseLinear(w, bias)(x), widened(x))


@needs_kernels
@pytest.mark.parametrize("in_f", [131, 576, 1000])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(in_f: int) -> None:
    # Steps of few rows and of many run different vector forms (ymm / zmm on AVX-512), and steps of several row
    # tiles take K in slices (576, 1000: a short last slice and a tail past the last whole vector; 40 rows: more
    # than one group of tiles): a sequence's logits must not change with how many other sequences share its step.
    # One-row steps may take either form (set_wide_single_row, chosen per machine at load).
    w = random_weight(37, in_f)
    qweight, scales = primitives.quantize_int8_per_channel(w)
    batch = torch.randn(40, in_f)
    before = kernels.set_wide_single_row(False)
    try:
        for gemm in (lambda x: kernels.gemm_f32(x, w), lambda x: kernels.gemm_int8(x, qweight, scales)):
            together = gemm(batch)
            for count in (1, 2, 3, 4, 6, 7, 17, 25):
                assert torch.equal(gemm(batch[:count]), together[:count]), count
            kernels.set_wide_single_row(True)
            assert torch.equal(gemm(batch[:1]), together[:1])
            kernels.set_wide_single_row(False)
    finally:
        kernels.set_wide_single_row(before)


@pytest.mark.skipif(
    not (kernels.kernels_available() and kernels.tiles_available()), reason="no AMX tiles here"
)
@pytest.mark.parametrize("int8_activations", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 12, 16, 17, 40])
def test_int8_on_amx_tiles_gives_the_register_tiles_bits(rows: int, int8_activations: bool) -> None:
    # The tiles split each int16 activation level into a signed high and an unsigned low byte (w8a8: take the
    # int8 level as it is) and sum exactly, so every row count (the tiles take steps of 3+ rows, one B tile of
    # exactly the rows up to 16) gives the bits of the vector path. 96 x 576: whole 16-row blocks and 64-wide
    # k-steps, as the tiles need.
    qweight, scales = primitives.quantize_int8_per_channel(random_weight(96, 576))
    x, bias = torch.randn(rows, 576) * 3, torch.randn(96)
    before = kernels.set_tiles(False)
    try:
        want = kernels.gemm_int8(x, qweight, scales, bias, int8_activations)
        kernels.set_tiles(True)
        assert torch.equal(kernels.gemm_int8(x, qweight, scales, bias, int8_activations), want)
    finally:
        kernels.set_tiles(before)


@pytest.mark.skipif(
    not (kernels.kernels_available() and kernels.tiles_available()), reason="no AMX tiles here"
)
def test_a_widened_bf16_weight_on_amx_tiles_gives_fp32_logits() -> None:
    # 96 x 576: whole 16-row blocks and 32-wide k-steps, so steps of 2+ rows take the tiles. The activations are
    # split into three bf16 parts whose products with the bf16 weights are exact: against a float64 product the
    # error stays at fp32 summation's, where multiplying bf16-rounded activations would be ~1000x off, and the
    # register tiles (the fp32 copy) agree to within that rounding.
    w = random_weight(96, 576).bfloat16()
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(1)) * 3
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T  # the error bound of a K-term fp32 sum grows with it
    before = kernels.set_tiles(True)
    try:
        together = kernels.gemm_f32(x, w)
        for rows in (2, 5, 6, 7, 16, 17, 40):  # one shared tile, a tile per part, several groups
            alone = kernels.gemm_f32(x[:rows], w)
            assert torch.equal(alone, together[:rows]), rows
            assert ((alone.double() - exact[:rows]).abs() <= 576 * 2**-24 * scale[:rows]).all(), rows
        # One activation per row against weights of 1: every logit is that activation, all 24 bits of it.
        single = torch.zeros(16, 576)
        single[torch.arange(16), torch.arange(16) * 31] = x[:16, 0]
        assert torch.equal(
            kernels.gemm_f32(single, torch.ones(96, 576).bfloat16()), x[:16, :1].expand(16, 96)
        )
        rounded = F.linear(primitives.round_bf16(x), w.float())
        assert ((rounded.double() - exact).abs() > 1e-4 * scale).any()
        kernels.set_tiles(False)
        assert_close_rel(kernels.gemm_f32(x, w), together, rel=1e-6)
    finally:
        kernels.set_tiles(before)


@pytest.mark.skipif(
    not (kernels.kernels_available() and kernels.tiles_available()), reason="no AMX tiles here"
)
@pytest.mark.parametrize(("group_size", "in_f"), [(32, 96), (192, 448), (128, 576), (448, 448)])
def test_int4_on_amx_tiles_multiplies_the_bf16_rounded_values(group_size: int, in_f: int) -> None:
    # Steps of up to 16 rows dequantize each 16-row block one group at a time between their tile steps (groups
    # of 192 end off the 128-wide spans, 448 is one group per row); longer steps the whole block first. Both
    # multiply the bf16-rounded weights and activations, and a row's sums do not depend on the path.
    packed, scales, zeros = primitives.quantize_int4_groupwise(random_weight(64, in_f), group_size)
    w = primitives.round_bf16(primitives.dequantize_int4(packed, scales, zeros, group_size))
    x = torch.randn(17, in_f)
    before = kernels.set_tiles(True)
    try:
        together = kernels.gemm_int4(x, packed, scales, zeros, group_size)
        for rows in (primitives.INT4_DIRECT_MAX_ROWS + 1, 16):
            alone = kernels.gemm_int4(x[:rows], packed, scales, zeros, group_size)
            assert_close_rel(alone, F.linear(primitives.round_bf16(x[:rows]), w), rel=1e-5)
            assert torch.equal(alone, together[:rows]), rows
    finally:
        kernels.set_tiles(before)


@needs_kernels
@pytest.mark.parametrize(("group_size", "in_f"), INT4_CASES)
def test_an_int4_rows_result_does_not_depend_on_the_few_rows_beside_it(group_size: int, in_f: int) -> None:
    # Decode steps of up to four rows take integer dots per group (zmm chunks on AVX-512), each row folded in
    # one order whatever shares its step.
    packed, scales, zeros = primitives.quantize_int4_groupwise(random_weight(37, in_f), group_size)
    batch = torch.randn(4, in_f)
    together = kernels.gemm_int4(batch, packed, scales, zeros, group_size)
    for count in (1, 2, 3):
        assert torch.equal(
            kernels.gemm_int4(batch[:count], packed, scales, zeros, group_size), together[:count]
        )


@needs_kernels
@pytest.mark.parametrize(("group_size", "in_f"), INT4_CASES)
def test_compiled_dequantizers_are_bit_identical(group_size: int, in_f: int) -> None:
    w = random_weight(37, in_f)
    q8 = primitives.quantize_int8_per_channel(w)
    assert torch.equal(kernels.dequantize_int8(*q8), primitives.dequantize_int8(*q8))
    q4 = primitives.quantize_int4_groupwise(w, group_size)
    assert torch.equal(kernels.dequantize_int4(*q4, group_size), primitives.dequantize_int4(*q4, group_size))


@needs_kernels
def test_kernels_reject_mismatched_arguments() -> None:
    qweight, scales = primitives.quantize_int8_per_channel(random_weight(16, 64))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="scales: expected"):
        kernels.gemm_int8(x, qweight, scales[:-1])
    with pytest.raises(RuntimeError, match="x: expected"):
        kernels.gemm_int8(torch.randn(2, 63), qweight, scales)
    with pytest.raises(RuntimeError, match="non-contiguous"):
        kernels.gemm_int8(x, qweight.t().contiguous().t(), scales)
    with pytest.raises(RuntimeError, match="byte_bias: expected"):
        kernels.gemm_int8(x, qweight, scales, None, True, kernels.int8_byte_bias(qweight)[:-1])
    packed, scales4, zeros = primitives.quantize_int4_groupwise(random_weight(16, 64), 32)
    with pytest.raises(RuntimeError, match="group_size must be 32 or a multiple of 64"):
        kernels.gemm_int4(x, packed, scales4, zeros, 48)  # ceil(64 / 48) == 2 groups, like group 32


@needs_kernels
def test_kernels_read_strided_activation_rows() -> None:
    # A column slice of a wider activation (row stride != in_features) is read in place.
    wide = torch.randn(3, 200)
    x = wide[:, 10:141]
    qweight, scales = primitives.quantize_int8_per_channel(random_weight(16, 131))
    ref = F.linear(primitives.round_activations_int16(x), primitives.dequantize_int8(qweight, scales))
    assert_close_rel(kernels.gemm_int8(x, qweight, scales), ref)


def test_prefill_chunks_take_the_kernels_where_they_are_built_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "fma", *build.AVX512_CPU_FLAGS}))
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    monkeypatch.setattr(linear_module, "kernels_available", lambda: True)
    monkeypatch.setattr(linear_module, "torch_outruns_fp32_kernel", lambda: False)
    build.has_wide_vectors.cache_clear()  # read once per process; this test changes the machine under it
    try:
        assert [max_kernel_rows(k) for k in ("fp32", "bf16", "int8", "w8a8", "int4")] == [
            2048,
            32,
            2048,
            2048,
            2048,
        ]
        # Where torch's fp32 GEMM outruns the kernel, fp32 steps of many rows go to torch; only fp32 ones.
        monkeypatch.setattr(linear_module, "torch_outruns_fp32_kernel", lambda: True)
        assert [max_kernel_rows(k) for k in ("fp32", "bf16", "int8", "w8a8", "int4")] == [
            linear_module.FP32_MAX_KERNEL_ROWS_WHERE_TORCH_WINS,
            32,
            2048,
            2048,
            2048,
        ]
        x, w = torch.randn(linear_module.FP32_MAX_KERNEL_ROWS_WHERE_TORCH_WINS + 1, 64), torch.randn(8, 64)
        monkeypatch.setattr(kernels, "gemm_f32", lambda *args: pytest.fail("many rows took the kernel"))
        assert torch.equal(fp32_linear(x, w), F.linear(x, w))
        monkeypatch.setenv(build.ISA_ENV, "avx2")  # AVX2 builds decide by their own limits, without the probe
        build.has_wide_vectors.cache_clear()
        assert [max_kernel_rows(k) for k in ("fp32", "bf16", "int8", "w8a8", "int4")] == [
            32,
            32,
            128,
            128,
            64,
        ]
        monkeypatch.setenv(build.ISA_ENV, "sse")  # refused when the kernels load; the torch path has no limit
        build.has_wide_vectors.cache_clear()
        assert max_kernel_rows("int8") == 128
    finally:
        build.has_wide_vectors.cache_clear()


@pytest.mark.parametrize(("scheme", "group_size"), [("int8", None), ("w8a8", None), ("int4", 64)])
def test_quant_linear_both_paths_match_reference(scheme: str, group_size: int | None) -> None:
    w, bias = random_weight(48, 192), torch.randn(48)
    layer = QuantLinear.from_float(w, bias, scheme, group_size)  # type: ignore[arg-type]

    def ref(x: torch.Tensor) -> torch.Tensor:
        if scheme in ("int8", "w8a8"):
            w = primitives.dequantize_int8(layer.qweight, layer.scales)
            rounding = (
                primitives.round_activations_int8 if scheme == "w8a8" else primitives.round_activations_int16
            )
            return F.linear(rounding(x), w, bias)
        assert layer.zeros is not None
        return int4_reference(x, layer.qweight, layer.scales, layer.zeros, 64, bias)

    for rows in (1, layer.max_kernel_rows, layer.max_kernel_rows + 1):  # kernel, kernel, fallback
        x = torch.randn(rows, 192)
        assert_close_rel(layer(x), ref(x))
    x3 = torch.randn(2, 3, 192)  # leading dims are kept
    assert layer(x3).shape == (2, 3, 48)
    assert_close_rel(layer(x3), ref(x3.reshape(6, 192)).view(2, 3, 48))


@pytest.mark.parametrize(("scheme", "group_size"), [("int8", None), ("w8a8", None), ("int4", 32)])
def test_quant_linear_packed_round_trip(scheme: str, group_size: int | None) -> None:
    layer = QuantLinear.from_float(random_weight(24, 64), torch.randn(24), scheme, group_size)  # type: ignore[arg-type]
    tensors = layer.state_tensors()
    expected_keys = {"qweight", "scales", "bias"} | ({"zeros"} if scheme == "int4" else set())
    assert set(tensors) == expected_keys
    assert set(layer.state_dict()) == expected_keys  # nn.Module state_dict uses the same names
    again = QuantLinear.from_packed(tensors, scheme, group_size)  # type: ignore[arg-type]
    x = torch.randn(2, 64)
    assert torch.equal(again(x), layer(x))


def test_quantized_bytes_counts_every_stored_tensor() -> None:
    int8 = QuantLinear.from_float(torch.randn(24, 64), torch.randn(24), "int8")
    assert int8.quantized_bytes() == 24 * 64 + 24 * 4 + 24 * 4
    int4 = QuantLinear.from_float(torch.randn(24, 128), None, "int4", 64)
    assert int4.quantized_bytes() == 24 * 64 + 2 * (24 * 2 * 4)


def test_from_packed_rejects_mismatched_tensors() -> None:
    tensors = QuantLinear.from_float(torch.randn(24, 128), None, "int4", 64).state_tensors()
    with pytest.raises(ValueError, match="scales"):
        QuantLinear.from_packed(tensors, "int4", 32)  # manifest group size disagrees with the tensors
    with pytest.raises(ValueError, match="missing"):
        QuantLinear.from_packed({"qweight": tensors["qweight"]}, "int4", 64)
    with pytest.raises(ValueError, match="qweight: expected torch.int8"):  # int4 tensors read as int8
        QuantLinear.from_packed({k: tensors[k] for k in ("qweight", "scales")}, "int8")


FALLBACK_SCRIPT = """
import torch, torch.nn.functional as F
from pipeline.runtime.quant import primitives
from pipeline.runtime.quant.linear import QuantLinear, kernels_available, kernels_unavailable_reason
assert not kernels_available()
print(kernels_unavailable_reason())
w, b, x = torch.randn(40, 128), torch.randn(40), torch.randn(1, 128)
layer = QuantLinear.from_float(w, b, "int8")
x8 = primitives.round_activations_int16(x)
torch.testing.assert_close(layer(x), F.linear(x8, primitives.dequantize_int8(layer.qweight, layer.scales), b))
layer = QuantLinear.from_float(w, b, "int4", 64)
ref = primitives.dequantize_int4(layer.qweight, layer.scales, layer.zeros, 64)
torch.testing.assert_close(layer(x), F.linear(*primitives.int4_operands(x, ref), b))
"""


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"LLMPIPE_DISABLE_KERNELS": "1"}, "disabled by LLMPIPE_DISABLE_KERNELS=1"),
        ({"CXX": "false"}, "the C++ compiler 'false' does not run"),  # a compiler that always fails
    ],
)
def test_without_kernels_layers_fall_back_to_dequantize_matmul(
    env: dict[str, str], reason: str, tmp_path: Path
) -> None:
    full_env = {**os.environ, "LLMPIPE_CACHE_DIR": str(tmp_path), **env}  # empty cache: nothing prebuilt
    proc = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert reason in proc.stdout


def c_compiler() -> str:
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    return compiler


def compile_c(source: Path, compiler: str) -> Path:
    args = ["-shared", "-fPIC"]
    target = cache_path(source.stem, [source], args, compiler, compiler_identity(compiler), salt="")
    return compile_cached(compiler, [source], args, target)


def test_concurrent_first_builds_leave_one_cached_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = c_compiler()
    monkeypatch.setenv("LLMPIPE_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")

    def build(_: int) -> Path:
        return compile_c(source, compiler)

    with ThreadPoolExecutor(max_workers=4) as pool:
        paths = set(pool.map(build, range(4)))
    assert len(paths) == 1
    (path,) = paths
    assert list((tmp_path / "cache" / "kernels").iterdir()) == [path]  # no temporary build directory left
    assert ctypes.CDLL(str(path)).answer() == 42
    source.write_text("int answer(void) { return 43; }\n")  # an edited source gets a new library
    assert ctypes.CDLL(str(build(0))).answer() == 43


def test_compile_errors_name_the_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = c_compiler()
    monkeypatch.setenv("LLMPIPE_CACHE_DIR", str(tmp_path))
    source = tmp_path / "broken.c"
    source.write_text("int broken(void) { return }\n")
    with pytest.raises(OSError, match="exited with"):
        compile_c(source, compiler)
    assert list((tmp_path / "kernels").iterdir()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_uses_the_dequantize_path() -> None:
    layer = QuantLinear.from_float(random_weight(64, 128), None, "int4", 64)
    x = torch.randn(1, 128)
    assert_close_rel(layer.to("cuda")(x.cuda()).cpu(), layer.cpu()(x))
