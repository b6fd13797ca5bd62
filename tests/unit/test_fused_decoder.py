"""The fused decoder-layer kernel equals the op-by-op torch computation (dequantize + matmul, F.rms_norm,
F.silu / F.gelu, moe_forward) for every weight format, norm layout, activation, row count and thread count, with
a gated MLP or a sparse MoE block, and a model step through it equals the op-by-op path."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pipeline.runtime.engine_config import model_config_from_dict
from pipeline.runtime.kernels import build
from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.model.attention import KernelAttention, LayerAttention, TorchAttention
from pipeline.runtime.model.decoder import DecoderModel
from pipeline.runtime.model.fused_decoder import FusedDecoder
from pipeline.runtime.model.layers import DenseLinear, Linear, ResidualRMSNorm
from pipeline.runtime.model.moe import moe_forward
from pipeline.runtime.model.rope import rotary_cos_sin
from pipeline.runtime.model.weights import LayerWeights, ModelWeights, MoEWeights
from pipeline.runtime.quant import primitives
from pipeline.runtime.quant.linear import QuantLinear
from pipeline.runtime.worker.attn_metadata import SequenceChunk, build_attention_metadata
from pipeline.runtime.worker.kv_cache import KVCache

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not kernels.kernels_available(), reason=f"kernels unavailable: {kernels.kernels_unavailable_reason()}"
)
EPS = 1e-5
# (name, scheme, group size); int4 at group 32 folds two groups per 64-weight chunk, 64 one group per chunk.
# bf16: dense bf16 weights, whose kernels round the activations to bf16 (dpbf16 or widened fp32 products).
FORMATS = [
    ("fp32", None, None),
    ("bf16", "bf16", None),
    ("int8", "int8", None),
    ("w8a8", "w8a8", None),
    ("int4-g32", "int4", 32),
    ("int4-g64", "int4", 64),
]
# bf16 outputs may differ from the reference's by one activation crossing a bf16 rounding boundary (2^-9
# relative) where the kernel's fp32 sums and torch's differ in the last bit.
BF16_TOLERANCE = 2e-3
# int8 layers round their inputs to int16 levels (1 / 16383 of the row's largest value): an activation whose
# fp32 value differs in the last bit may land one level apart (measured: up to 1e-4 of the outputs' largest
# value after 3 layers), as does leaving the rounding out of the reference.
INT8_TOLERANCE = 5e-4
# w8a8 layers round to int8 levels (1 / 127 of the row's largest value): one level apart moves an output by up
# to ~1 % of the largest.
W8A8_TOLERANCE = 2e-2
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# name: (activation, which norms a layer has: [attention output, post-attention (pre-MLP), MLP output, next]).
LAYOUTS = {
    "llama": ("silu", (False, True, False, True)),
    "pre-gelu": ("gelu_pytorch_tanh", (False, True, False, True)),
    "sandwich": ("gelu_pytorch_tanh", (True, True, True, True)),  # Gemma 2/3
    "post": ("silu", (True, False, True, False)),  # OLMo 2: the next q/k/v reads the residual stream
}


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def make_linear(out_f: int, in_f: int, scheme: str | None, group: int | None, seed: int, bias: bool = False):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen) * in_f**-0.5
    b = torch.randn(out_f, generator=gen) if bias else None
    if scheme is None:
        return DenseLinear(w, b), w
    if scheme == "bf16":
        return DenseLinear(w.bfloat16(), b), w.bfloat16().float()
    q = QuantLinear.from_float(w, b, scheme=scheme, group_size=group)  # type: ignore[arg-type]
    return q, q.dequantize()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    return x if weight is None else F.rms_norm(x, (x.shape[1],), weight, EPS)


def reference(hidden, attn, deq, biases, norms, inter, act="silu", round_inputs=None):
    """Op by op in torch, HF's order of operations: returns (updated hidden, next layer's qkv). `round_inputs`
    rounds each linear's input as the layer's kernels do (bf16, or int8 layers' int16 grid)."""
    dense, gate_up, down, qkv = deq
    attention_output_norm, post_norm, mlp_output_norm, next_norm = norms
    r = round_inputs or (lambda t: t)
    hidden = hidden + rms_norm(r(attn) @ dense.T, attention_output_norm)
    gu = r(rms_norm(hidden, post_norm)) @ gate_up.T
    hidden = hidden + rms_norm(r(ACTIVATIONS[act](gu[:, :inter]) * gu[:, inter:]) @ down.T, mlp_output_norm)
    return hidden, r(rms_norm(hidden, next_norm)) @ qkv.T + biases


def check_layer(
    name: str, scheme: str | None, group: int | None, rows: int, hidden_size: int, inter: int, layout: str
) -> None:
    act, has_norm = LAYOUTS[layout]
    shapes = [(hidden_size, hidden_size), (2 * inter, hidden_size), (hidden_size, inter), (160, hidden_size)]
    layers = [make_linear(o, i, scheme, group, seed, bias=seed == 3) for seed, (o, i) in enumerate(shapes)]
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(rows, hidden_size, generator=gen)
    attn = torch.randn(rows, hidden_size, generator=gen)
    norms = [torch.rand(hidden_size, generator=gen) + 0.5 if has else None for has in has_norm]
    qkv_bias = layers[3][0].bias
    assert qkv_bias is not None
    rounding = {
        "bf16": lambda t: t.bfloat16().float(),
        "int8": primitives.round_activations_int16,
        "w8a8": primitives.round_activations_int8,
    }.get(scheme)
    exact = [d for _, d in layers]
    deq = exact
    if scheme == "int4":  # as primitives.int4_operands says: int16 levels, or bf16 products for many rows
        rounding = primitives.round_activations_int16
        if rows > primitives.INT4_DIRECT_MAX_ROWS:
            rounding, deq = primitives.round_bf16, [primitives.round_bf16(d) for d in exact]
    ref_hidden, ref_qkv = reference(hidden, attn, deq, qkv_bias, norms, inter, act, rounding)
    _, unrounded_qkv = reference(hidden, attn, exact, qkv_bias, norms, inter, act)

    plan = FusedDecoder.plan([FusedDecoder.layer_args([lin for lin, _ in layers], norms)], EPS, act)
    out = plan.run(0, hidden, attn)  # hidden is updated in place
    for got, want in ((hidden, ref_hidden), (out, ref_qkv)):
        assert got.shape == want.shape
        tolerance = {
            primitives.round_bf16: BF16_TOLERANCE,
            primitives.round_activations_int16: INT8_TOLERANCE,
            primitives.round_activations_int8: W8A8_TOLERANCE,
        }
        tolerance = tolerance.get(rounding, BF16_TOLERANCE if scheme == "bf16" else 1e-5)
        assert (got - want).abs().max() <= tolerance * want.abs().max(), name
    if rounding:  # the kernel rounds its inputs as the reference does: closer to it than to unrounded inputs
        # (on average: the largest differences of both can tie where torch's reference GEMMs round alike)
        assert (out - ref_qkv).abs().mean() < (out - unrounded_qkv).abs().mean()


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize(("name", "scheme", "group"), FORMATS, ids=[f[0] for f in FORMATS])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
@pytest.mark.parametrize(("hidden_size", "inter"), [(64, 96), (576, 1536)], ids=["tiny", "smollm2"])
def test_layer_matches_op_by_op(
    threads: int, name: str, scheme: str | None, group: int | None, rows: int, hidden_size: int, inter: int
) -> None:
    check_layer(name, scheme, group, rows, hidden_size, inter, "llama")


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize(("name", "scheme", "group"), FORMATS, ids=[f[0] for f in FORMATS])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "llama"])
def test_other_layouts_match_op_by_op(
    threads: int, name: str, scheme: str | None, group: int | None, rows: int, layout: str
) -> None:
    check_layer(name, scheme, group, rows, 576, 1536, layout)


def smollm2_layer(scheme: str | None, seed: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A SmolLM2-shaped decoder layer's plan (int4 at group size 64) and 40 rows of its inputs: hidden, attention."""
    shapes = [(576, 576), (2 * 1536, 576), (576, 1536), (960, 576)]
    group = 64 if scheme == "int4" else None
    layers = [make_linear(o, i, scheme, group, s, bias=s == 3)[0] for s, (o, i) in enumerate(shapes)]
    norms = [None, torch.rand(576) + 0.5, None, torch.rand(576) + 0.5]
    plan = FusedDecoder.plan([FusedDecoder.layer_args(layers, norms)], EPS, "silu")
    gen = torch.Generator().manual_seed(seed)
    return plan, torch.randn(40, 576, generator=gen), torch.randn(40, 576, generator=gen)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("scheme", [None, "bf16", "int8", "w8a8", "int4"])
def test_a_rows_layer_output_does_not_depend_on_the_rows_beside_it(scheme: str | None, threads: int) -> None:
    """Steps of different row counts multiply in different forms (ymm or zmm registers; bf16 steps of one or two
    rows by FMAs, larger ones by dpbf16), and many-row steps take K in slices: a sequence's hidden state must not
    change with how many sequences share its step, on the vector register tiles. int4 rounds its operands one
    way up to primitives.INT4_DIRECT_MAX_ROWS rows and another way above, so it is held to each range apart."""
    plan, hidden, attn = smollm2_layer(scheme, 5)

    def step(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        h = hidden[:rows].clone()
        return h, plan.run(0, h, attn[:rows])

    tiles, wide = kernels.set_tiles(False), kernels.set_wide_single_row(False)
    try:
        few = primitives.INT4_DIRECT_MAX_ROWS
        groups = (
            [(few, (1, 2, 3)), (40, (5, 17, 25))] if scheme == "int4" else [(40, (1, 2, 3, 4, 5, 17, 25))]
        )
        for together_rows, counts in groups:
            together = step(together_rows)
            for rows in counts:
                for alone, shared in zip(step(rows), together, strict=True):
                    assert torch.equal(alone, shared[:rows]), rows
        kernels.set_wide_single_row(True)
        for alone, shared in zip(step(1), step(40 if scheme != "int4" else few), strict=True):
            assert torch.equal(alone, shared[:1])
    finally:
        kernels.set_tiles(tiles)
        kernels.set_wide_single_row(wide)


@pytest.mark.skipif(not kernels.tiles_available(), reason="no AMX tiles here")
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("scheme", ["bf16", "int8", "w8a8", "int4"])
def test_layers_on_amx_tiles(scheme: str, threads: int) -> None:
    """SmolLM2-shaped bf16, int8, w8a8 and int4 layers of many rows run on AMX tiles: int8 and w8a8 with the
    register tiles' bits, bf16 and int4 (bf16 products in steps of more than 4 rows) with their values up to the order of the
    fp32 sums; and a row's result does not depend on how many rows share its step, from the fewest each format
    takes to the tiles to 40 (several B tiles)."""
    plan, hidden, attn = smollm2_layer(scheme, 3)

    def step(rows: int, tiles: bool) -> tuple[torch.Tensor, torch.Tensor]:
        before = kernels.set_tiles(tiles)
        try:
            h = hidden[:rows].clone()
            return h, plan.run(0, h, attn[:rows])
        finally:
            kernels.set_tiles(before)

    first = {"bf16": 2, "int8": 5, "w8a8": 2, "int4": 5}[scheme]  # the fewest rows each takes to the tiles
    for rows in (16, 40):
        tiled, vector = step(rows, True), step(rows, False)
        for got, want in zip(tiled, vector, strict=True):
            if scheme in ("int8", "w8a8"):
                assert torch.equal(got, want)
            else:  # sums of the same products in another order, then rounded to bf16 for the next linear
                assert (got - want).abs().max() <= BF16_TOLERANCE * want.abs().max()
    together = step(40, True)
    for rows in (first, 16, 17):
        for alone, shared in zip(step(rows, True), together, strict=True):
            assert torch.equal(alone, shared[:rows]), rows


def test_gelu_matches_torch_over_its_range() -> None:
    """The kernel's x / (1 + e^(-2 y)) form of the tanh gelu, where torch computes 0.5 x (1 + tanh(y)): both are
    within ~1e-7 (1 + |x|) of the exact value, so within twice that of each other."""
    x = torch.linspace(-12, 12, 4099)
    # One value per row; the MLP output lands in column 1.
    hidden = torch.stack((x, torch.zeros_like(x)), dim=1)
    gate_up = DenseLinear(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.tensor([0.0, 1.0]))  # gate x, up 1
    down = DenseLinear(torch.tensor([[0.0], [1.0]]))
    dense = DenseLinear(torch.zeros(2, 2))
    entry = FusedDecoder.layer_args([dense, gate_up, down, None], [None] * 4)
    FusedDecoder.plan([entry], EPS, "gelu_pytorch_tanh").run(0, hidden, torch.zeros_like(hidden))
    want = F.gelu(x, approximate="tanh")
    assert ((hidden[:, 1] - want).abs() <= 2e-7 * (1 + x.abs())).all()


def test_entry_and_exit_calls() -> None:
    """No attn: only the next norm + q/k/v; no next q/k/v: the normed rows; no next norm: the q/k/v of the
    residual stream itself."""
    lin, w = make_linear(32, 64, None, None, 0)
    gen = torch.Generator().manual_seed(1)
    hidden, norm = torch.randn(3, 64, generator=gen), torch.rand(64, generator=gen) + 0.5
    before = hidden.clone()
    entries = [
        FusedDecoder.layer_args([None, None, None, lin], [None, None, None, norm]),
        FusedDecoder.layer_args([None] * 4, [None, None, None, norm]),
        FusedDecoder.layer_args([None, None, None, lin], [None] * 4),
    ]
    plan = FusedDecoder.plan(entries, EPS)
    normed = F.rms_norm(before, (64,), norm, EPS)
    assert torch.allclose(plan.run(0, hidden, None), normed @ w.T, atol=1e-5)
    assert torch.allclose(plan.run(1, hidden, None), normed)
    assert torch.allclose(plan.run(2, hidden, None), before @ w.T, atol=1e-5)
    assert torch.equal(hidden, before)
    with pytest.raises(RuntimeError, match="takes no attn"):
        plan.run(0, hidden, torch.randn(3, 64))
    with pytest.raises(RuntimeError, match="no entry 3"):
        plan.run(3, hidden, None)


def test_rejects_layers_that_do_not_chain() -> None:
    dense, _ = make_linear(64, 64, None, None, 0)
    gate_up, _ = make_linear(2 * 96, 64, None, None, 1)
    down, _ = make_linear(64, 95, None, None, 2)  # should take 96 inputs
    norms = [None, torch.ones(64), None, None]
    with pytest.raises(RuntimeError, match="do not chain"):
        FusedDecoder.plan([FusedDecoder.layer_args([dense, gate_up, down, None], norms)], EPS)
    down, _ = make_linear(64, 96, None, None, 2)
    with pytest.raises(RuntimeError, match="activation must be"):
        FusedDecoder.plan([FusedDecoder.layer_args([dense, gate_up, down, None], norms)], EPS, "relu")
    with pytest.raises(RuntimeError, match="norms but no dense"):
        FusedDecoder.plan([FusedDecoder.layer_args([None] * 4, norms)], EPS)
    plan = FusedDecoder.plan([FusedDecoder.layer_args([dense, gate_up, down, None], norms)], EPS)
    with pytest.raises(RuntimeError, match="hidden"):
        plan.run(0, torch.randn(2, 64).double(), torch.randn(2, 64))
    assert plan.run(0, torch.randn(2, 64), torch.randn(2, 64)).shape == (0, 64)  # no next layer: no output


def make_moe(
    hidden: int, inter: int, experts: int, top_k: int, normalize: bool, scheme: str | None, seed: int
) -> tuple[MoEWeights, MoEWeights]:
    """The block in `scheme` and its fp32 (dequantized) twin."""
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(experts, hidden, generator=gen)
    gate_up = [make_linear(2 * inter, hidden, scheme, 32, seed + 1 + e) for e in range(experts)]
    down = [make_linear(hidden, inter, scheme, 32, seed + 101 + e) for e in range(experts)]

    def block(index: int) -> MoEWeights:
        pick = (lambda p: p[0]) if index == 0 else (lambda p: DenseLinear(p[1]))
        return MoEWeights(router, [pick(p) for p in gate_up], [pick(p) for p in down], top_k, normalize)

    return block(0), block(1)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize(("name", "scheme", "group"), FORMATS, ids=[f[0] for f in FORMATS])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize(
    ("experts", "top_k", "normalize", "layout"),
    [(4, 2, True, "llama"), (8, 3, False, "llama"), (4, 1, False, "sandwich"), (4, 4, True, "post")],
    ids=["mixtral", "qwen3-moe", "sandwich-top1", "post-all"],
)
def test_moe_layer_matches_moe_forward(
    threads: int,
    name: str,
    scheme: str | None,
    group: int | None,
    rows: int,
    experts: int,
    top_k: int,
    normalize: bool,
    layout: str,
) -> None:
    """A sparse entry: output projection, then the MoE block (router softmax, top k, experts ascending) in
    place of the MLP, then the next norm + q/k/v, against moe_forward and torch on the dequantized weights
    (bf16: to a few bf16 roundings of the activations); hidden size 256 wakes the second thread."""
    _, has_norm = LAYOUTS[layout]
    hidden_size, inter = 256, 96
    dense, dense_w = make_linear(hidden_size, hidden_size, scheme, group, 0)
    qkv, qkv_w = make_linear(160, hidden_size, scheme, group, 1, bias=True)
    moe, moe_fp32 = make_moe(hidden_size, inter, experts, top_k, normalize, scheme, 10)
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(rows, hidden_size, generator=gen)
    attn = torch.randn(rows, hidden_size, generator=gen)
    norms = [torch.rand(hidden_size, generator=gen) + 0.5 if has else None for has in has_norm]
    attention_output_norm, post_norm, mlp_output_norm, next_norm = norms
    bf16_products = scheme == "int4" and rows > primitives.INT4_DIRECT_MAX_ROWS  # as primitives says
    if bf16_products:  # the weights as the kernel rounds them; the activations left unrounded, as for bf16
        dense_w, qkv_w = primitives.round_bf16(dense_w), primitives.round_bf16(qkv_w)
        moe_fp32 = MoEWeights(
            moe_fp32.router,
            *(
                [DenseLinear(primitives.round_bf16(lin.weight)) for lin in part]
                for part in (moe_fp32.gate_up, moe_fp32.proj)
            ),
            top_k,
            normalize,
        )

    # w8a8's int8 activation levels (~1 % steps, grown ~7x by the output norms of "post") are held to the
    # reference's: its inputs rounded the same way, its experts the op-by-op QuantLinear layers.
    rounded = primitives.round_activations_int8 if scheme == "w8a8" else (lambda t: t)
    want_hidden = hidden + rms_norm(rounded(attn) @ dense_w.T, attention_output_norm)
    moe_out = moe_forward(rms_norm(want_hidden, post_norm), moe if scheme == "w8a8" else moe_fp32)
    want_hidden = want_hidden + rms_norm(moe_out, mlp_output_norm)
    want_qkv = rounded(rms_norm(want_hidden, next_norm)) @ qkv_w.T + qkv.bias

    plan = FusedDecoder.plan([FusedDecoder.layer_args([dense, None, None, qkv], norms, moe)], EPS)
    out = plan.run(0, hidden, attn)
    # int8: the reference multiplies unrounded activations, the kernel int16 levels (~1e-4 of each output,
    # up to 7e-4 after the output norms of "post"; the layer test holds the rounding itself to the reference's).
    tolerance = {"bf16": 1e-2, "int8": 2e-3, "w8a8": 2e-3, "int4": 1e-2 if bf16_products else 2e-3}.get(
        scheme or "", 1e-5
    )
    for got, want in ((hidden, want_hidden), (out, want_qkv)):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= tolerance * want.abs().max(), name


def test_moe_routing_follows_transformers() -> None:
    """One-hot routers: each row's experts and weights are known, so the sum shows which experts ran, with
    which weights, renormalized or not; experts with no rows are skipped."""
    hidden_size, experts = 8, 4
    # Expert e's MLP outputs (e + 1) * 2^e in column 0 for input column 0 = 1: silu(g) * u with g = u = 1.
    gate_up_w = torch.zeros(2, hidden_size)
    gate_up_w[:, 0] = 1.0
    gate_up: list[Linear] = [DenseLinear(gate_up_w) for _ in range(experts)]
    down: list[Linear] = []
    for e in range(experts):
        down_w = torch.zeros(hidden_size, 1)
        down_w[0, 0] = (e + 1) * 2.0**e / F.silu(torch.tensor(1.0)).item()
        down.append(DenseLinear(down_w))
    router = torch.zeros(experts, hidden_size)
    router[:, 1:5] = torch.eye(experts) * 4.0  # row r's logits: 4 on the experts its columns 1..4 pick
    x_rows = torch.zeros(3, hidden_size)
    x_rows[:, 0] = 1.0
    x_rows[0, [1 + 3, 1 + 1]] = torch.tensor([1.0, 0.5])  # experts 3 (logit 4) and 1 (logit 2)
    x_rows[1, [1 + 0, 1 + 3]] = torch.tensor([1.0, 1.0])  # experts 0 and 3, tied; expert 2 has no row
    x_rows[2, [1 + 1, 1 + 3]] = torch.tensor([1.0, 0.25])  # experts 1 and 3
    for normalize in (True, False):
        moe = MoEWeights(router, gate_up, down, 2, normalize)
        want = moe_forward(x_rows, moe)
        dense = DenseLinear(torch.zeros(hidden_size, hidden_size))
        plan = FusedDecoder.plan([FusedDecoder.layer_args([dense, None, None, None], [None] * 4, moe)], EPS)
        hidden = x_rows.clone()
        plan.run(0, hidden, torch.zeros(3, hidden_size))
        assert torch.allclose(hidden - x_rows, want, rtol=1e-6, atol=1e-6)
        assert want[:, 0].abs().min() > 0.1  # the experts did run


def test_rejects_moe_entries_that_do_not_fit() -> None:
    dense, _ = make_linear(64, 64, None, None, 0)
    gate_up, _ = make_linear(2 * 96, 64, None, None, 1)
    down, _ = make_linear(64, 96, None, None, 2)
    moe, _ = make_moe(64, 32, 4, 2, True, None, 3)

    def plan(linears, moe_weights, norms=(None,) * 4):
        return FusedDecoder.plan([FusedDecoder.layer_args(linears, list(norms), moe_weights)], EPS)

    out = plan([dense, None, None, None], moe).run(0, torch.randn(2, 64), torch.randn(2, 64))
    assert out.shape == (0, 64)
    with pytest.raises(RuntimeError, match="no gate_up or down"):
        plan([dense, gate_up, down, None], moe)
    with pytest.raises(RuntimeError, match="needs dense"):
        plan([None, None, None, None], moe, (None, None, None, torch.ones(64)))
    with pytest.raises(RuntimeError, match="or else a MoE block"):
        plan([dense, None, None, None], None)
    with pytest.raises(RuntimeError, match="picks 5 of 4"):
        plan([dense, None, None, None], MoEWeights(moe.router, moe.gate_up, moe.proj, 5, True))
    with pytest.raises(RuntimeError, match="router"):
        narrow = moe.router[:, :32].contiguous()
        plan([dense, None, None, None], MoEWeights(narrow, moe.gate_up, moe.proj, 2, True))
    with pytest.raises(RuntimeError, match="expert 1"):
        odd = [moe.gate_up[0], make_linear(2 * 16, 64, None, None, 4)[0], *moe.gate_up[2:]]
        plan([dense, None, None, None], MoEWeights(moe.router, odd, moe.proj, 2, True))


# name: (config.norm_layout, hidden_act); a layer has the norms its layout names (see DecoderModel).
MODEL_LAYOUTS = {
    "llama": ("pre", "silu"),
    "gemma": ("sandwich", "gelu_pytorch_tanh"),
    "olmo2": ("post", "silu"),
}


class CallPerLayer:
    """An attention that is not KernelAttention to the fused decoder: its steps go one call per layer."""

    def __init__(self, inner: KernelAttention) -> None:
        self.inner = inner

    def begin_step(self, meta) -> None:
        self.inner.begin_step(meta)

    def __call__(self, layer: int, qkv: torch.Tensor, meta) -> torch.Tensor:
        return self.inner(layer, qkv, meta)


def model_steps(
    config, weights: ModelWeights, fused: bool, attention: str = "torch", window: int | None = None
) -> list[torch.Tensor]:
    """The hidden states of a prefill and then decode steps of 3 sequences, fused or op by op; `attention`:
    torch, kernel (the fused decoder runs whole steps) or kernel per layer (a call per layer)."""
    cache = KVCache(config, 16, 4, torch.float32, torch.device("cpu"), zero=True)
    layer_attention = [LayerAttention(rotary_cos_sin(config, 128), window)] * len(weights.layers)
    if attention == "torch":
        model = DecoderModel(
            config, weights, TorchAttention(cache, config, layer_attention), ResidualRMSNorm(False, 64, EPS)
        )
    else:
        kernel = KernelAttention(cache, config, layer_attention)
        model = DecoderModel(config, weights, kernel, ResidualRMSNorm(False, 64, EPS))
        if attention == "kernel per layer":
            model.attention = CallPerLayer(kernel)
    assert model.fused is not None
    if not fused:
        model.fused = None
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    steps = []
    for start, count in ((0, 7), (7, 1), (8, 1), (9, 1)):
        chunks = [SequenceChunk(start, count, t) for t in tables]
        meta = build_attention_metadata(chunks, 4, torch.device("cpu"), padded=True)
        ids = torch.randint(0, 50, (meta.num_tokens,), generator=torch.Generator().manual_seed(start))
        steps.append(model.forward(ids, meta).clone())
    if attention == "kernel" and fused:
        assert model.fused._bound is model.attention  # the steps ran whole, in one call each
    return steps


def assert_steps_match(fused: list[torch.Tensor], plain: list[torch.Tensor], scheme: str | None) -> None:
    for fused_step, plain_step in zip(fused, plain, strict=True):
        bf16_products = scheme == "bf16" or (
            scheme == "int4" and fused_step.shape[0] > primitives.INT4_DIRECT_MAX_ROWS
        )
        if bf16_products:  # a few bf16 roundings (2^-9) per layer, compounded over 3 layers
            assert (fused_step - plain_step).abs().max() <= 2e-2 * plain_step.abs().max()
        else:  # int8 / int4 decode: both round to int16 levels; an input differing in
            # its last bit may land a level apart, and over 3 layers (gemma's and olmo2's norms after each
            # sublayer) that grew to 1.2e-3 at 1.5 on a Xeon whose torch GEMMs round differently; w8a8 the same
            # at int8 levels
            tolerance = {"int8": 4 * INT8_TOLERANCE, "int4": 4 * INT8_TOLERANCE, "w8a8": W8A8_TOLERANCE}.get(
                scheme or "", 1e-5
            )
            assert torch.allclose(fused_step, plain_step, atol=tolerance, rtol=tolerance)


MODEL_CONFIG = {
    "architecture": "LlamaForCausalLM", "dtype": "float32", "vocab_size": 50, "hidden_size": 64,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "max_position_embeddings": 128, "norm_epsilon": EPS,
}  # fmt: skip


@pytest.mark.parametrize("layout", list(MODEL_LAYOUTS))
@pytest.mark.parametrize(
    ("scheme", "group"), [(None, None), ("bf16", None), ("int8", None), ("w8a8", None), ("int4", 32)]
)
def test_model_step_equals_op_by_op_path(layout: str, scheme: str | None, group: int | None) -> None:
    """A prefill and then decode steps of 3 sequences: fused and op-by-op forwards give the same hidden states
    (bf16: to bf16 rounding, as the op-by-op GEMMs may round their outputs to bf16 too)."""
    norm_layout, act = MODEL_LAYOUTS[layout]
    config = model_config_from_dict({**MODEL_CONFIG, "hidden_act": act, "norm_layout": norm_layout})
    gen = torch.Generator().manual_seed(0)

    def norm(present: bool) -> torch.Tensor | None:
        return torch.rand(64, generator=gen) + 0.5 if present else None

    layers = [
        LayerWeights(
            input_norm=norm(norm_layout != "post"),
            qkv=make_linear(128, 64, scheme, group, 10 * i)[0],
            dense=make_linear(64, 64, scheme, group, 10 * i + 1)[0],
            post_norm=norm(norm_layout != "post"),
            gate_up=make_linear(192, 64, scheme, group, 10 * i + 2)[0],
            proj=make_linear(64, 96, scheme, group, 10 * i + 3)[0],
            attention_output_norm=norm(norm_layout != "pre"),
            mlp_output_norm=norm(norm_layout != "pre"),
        )
        for i in range(3)
    ]
    embedding = torch.randn(50, 64, generator=gen)
    weights = ModelWeights(embedding, layers, torch.ones(64), DenseLinear(embedding))
    assert_steps_match(model_steps(config, weights, True), model_steps(config, weights, False), scheme)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("scheme", [None, "int8"])
def test_a_whole_step_in_one_call_equals_a_call_per_layer(scheme: str | None, window: int | None) -> None:
    """With the attention kernel the fused decoder runs a step's layers and their attention in one call; the
    hidden states are those of one call per layer, bit for bit (a sliding window included)."""
    config = model_config_from_dict({**MODEL_CONFIG, "hidden_act": "silu"})
    gen = torch.Generator().manual_seed(0)
    layers = [
        LayerWeights(
            input_norm=torch.rand(64, generator=gen) + 0.5,
            qkv=make_linear(128, 64, scheme, None, 10 * i)[0],
            dense=make_linear(64, 64, scheme, None, 10 * i + 1)[0],
            post_norm=torch.rand(64, generator=gen) + 0.5,
            gate_up=make_linear(192, 64, scheme, None, 10 * i + 2)[0],
            proj=make_linear(64, 96, scheme, None, 10 * i + 3)[0],
        )
        for i in range(3)
    ]
    embedding = torch.randn(50, 64, generator=gen)
    weights = ModelWeights(embedding, layers, torch.ones(64), DenseLinear(embedding))
    whole = model_steps(config, weights, True, "kernel", window)
    per_layer = model_steps(config, weights, True, "kernel per layer", window)
    for whole_step, per_layer_step in zip(whole, per_layer, strict=True):
        assert torch.equal(whole_step, per_layer_step)
    assert_steps_match(whole, model_steps(config, weights, False, "kernel", window), scheme)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("scheme", [None, "bf16"])
def test_moe_model_step_equals_op_by_op_path(normalize: bool, scheme: str | None) -> None:
    """Sparse layers 0 and 2 around a dense one (Qwen3-MoE's mlp_only_layers): fused (one call per layer,
    the MoE block in it) and op-by-op (moe_forward) forwards agree."""
    config = model_config_from_dict({**MODEL_CONFIG, "hidden_act": "silu"})
    gen = torch.Generator().manual_seed(0)
    layers = []
    for i in range(3):
        sparse = i != 1
        layers.append(
            LayerWeights(
                input_norm=torch.rand(64, generator=gen) + 0.5,
                qkv=make_linear(128, 64, scheme, None, 10 * i)[0],
                dense=make_linear(64, 64, scheme, None, 10 * i + 1)[0],
                post_norm=torch.rand(64, generator=gen) + 0.5,
                gate_up=None if sparse else make_linear(192, 64, scheme, None, 10 * i + 2)[0],
                proj=None if sparse else make_linear(64, 96, scheme, None, 10 * i + 3)[0],
                moe=make_moe(64, 32, 4, 2, normalize, scheme, 100 * i)[0] if sparse else None,
            )
        )
    embedding = torch.randn(50, 64, generator=gen)
    weights = ModelWeights(embedding, layers, torch.ones(64), DenseLinear(embedding))
    assert_steps_match(model_steps(config, weights, True), model_steps(config, weights, False), scheme)


def test_model_falls_back_for_what_the_kernel_does_not_compute() -> None:
    """FusedDecoder.build declines what the kernel does not compute: another activation, MoE experts other
    than SwiGLU, a MoE block without experts or with a non-fp32 router; it takes sparse SwiGLU layers."""
    layer = LayerWeights(
        input_norm=torch.ones(64),
        qkv=DenseLinear(torch.randn(128, 64)),
        dense=DenseLinear(torch.randn(64, 64)),
        post_norm=torch.ones(64),
        gate_up=DenseLinear(torch.randn(192, 64)),
        proj=DenseLinear(torch.randn(64, 96)),
    )
    embedding = torch.randn(50, 64)
    weights = ModelWeights(embedding, [layer], torch.ones(64), DenseLinear(embedding))
    base = model_config_from_dict({**MODEL_CONFIG, "num_hidden_layers": 1, "hidden_act": "silu"})
    gelu = model_config_from_dict({**MODEL_CONFIG, "num_hidden_layers": 1, "hidden_act": "gelu_pytorch_tanh"})
    assert FusedDecoder.build(base, weights) is not None
    gelu_erf = model_config_from_dict({**MODEL_CONFIG, "num_hidden_layers": 1, "hidden_act": "gelu"})
    assert FusedDecoder.build(gelu_erf, weights) is None
    assert FusedDecoder.build(gelu, weights) is not None
    moe, _ = make_moe(64, 32, 4, 2, True, None, 0)
    layer.gate_up = layer.proj = None
    layer.moe = moe
    assert FusedDecoder.build(base, weights) is not None
    assert FusedDecoder.build(gelu, weights) is None  # moe_forward's experts are SwiGLU
    layer.moe = MoEWeights(moe.router.double(), moe.gate_up, moe.proj, 2, True)
    assert FusedDecoder.build(base, weights) is None
    layer.moe = MoEWeights(torch.randn(2, 64), [], [], 1, True)
    assert FusedDecoder.build(base, weights) is None


# Run in a fresh interpreter: the kernel library is picked and loaded once per process.
ISA_SCRIPT = """
import torch, torch.nn.functional as F
from pipeline.runtime.model.fused_decoder import FusedDecoder
from pipeline.runtime.model.greedy_head import GreedyLMHead
from pipeline.runtime.model.layers import DenseLinear
from pipeline.runtime.model.moe import moe_forward
from pipeline.runtime.model.weights import MoEWeights
from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.kernels.build import kernel_isa
print("isa", kernel_isa(), "available", kernels.kernels_available())
if kernels.kernels_available():
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g) * i**-0.5 for o, i in ((576, 576), (3072, 576), (576, 1536), (960, 576))]
    n = [torch.rand(576, generator=g) + 0.5 for _ in range(4)]
    norms = [None, n[1], None, n[3]]
    rms = lambda t, w: F.rms_norm(t, (576,), w, 1e-5)
    plan = FusedDecoder.plan([FusedDecoder.layer_args([DenseLinear(w) for w in ws], norms)], 1e-5)
    gemma = FusedDecoder.plan([FusedDecoder.layer_args([DenseLinear(w) for w in ws], n)], 1e-5, "gelu_pytorch_tanh")
    for rows in (1, 16):
        hidden, attn = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g)
        h = hidden + attn @ ws[0].T
        gu = rms(h, n[1]) @ ws[1].T
        h = h + (F.silu(gu[:, :1536]) * gu[:, 1536:]) @ ws[2].T
        want = rms(h, n[3]) @ ws[3].T
        got = plan.run(0, hidden, attn)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() and torch.allclose(hidden, h, atol=1e-4)
        hidden = torch.randn(rows, 576, generator=g)
        h = hidden + rms(attn @ ws[0].T, n[0])
        gu = rms(h, n[1]) @ ws[1].T
        h = h + rms((F.gelu(gu[:, :1536], approximate="tanh") * gu[:, 1536:]) @ ws[2].T, n[2])
        want = rms(h, n[3]) @ ws[3].T
        got = gemma.run(0, hidden, attn)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() and torch.allclose(hidden, h, atol=1e-4)
        # bf16 weights: bf16 dot products, or (below AVX512_BF16) widened weights and rounded activations.
        r = lambda t: t.bfloat16().float()
        wb = [r(w) for w in ws]
        plan16 = FusedDecoder.plan([FusedDecoder.layer_args([DenseLinear(w.bfloat16()) for w in ws], norms)], 1e-5)
        hidden = torch.randn(rows, 576, generator=g)
        h = hidden + r(attn) @ wb[0].T
        gu = r(rms(h, n[1])) @ wb[1].T
        h = h + r(F.silu(gu[:, :1536]) * gu[:, 1536:]) @ wb[2].T
        want = r(rms(h, n[3])) @ wb[3].T
        assert (plan16.run(0, hidden, attn) - want).abs().max() <= 2e-3 * want.abs().max()
        # A MoE block in place of the MLP: 8 experts, 2 per row.
        moe = MoEWeights(torch.randn(8, 576, generator=g),
                         [DenseLinear(torch.randn(512, 576, generator=g) * 576**-0.5) for _ in range(8)],
                         [DenseLinear(torch.randn(576, 256, generator=g) * 256**-0.5) for _ in range(8)], 2, True)
        sparse = FusedDecoder.plan([FusedDecoder.layer_args([DenseLinear(ws[0]), None, None, DenseLinear(ws[3])],
                                                            norms, moe)], 1e-5)
        hidden = torch.randn(rows, 576, generator=g)
        h = hidden + attn @ ws[0].T
        h = h + moe_forward(rms(h, n[1]), moe)
        want = rms(h, n[3]) @ ws[3].T
        got = sparse.run(0, hidden, attn)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() and torch.allclose(hidden, h, atol=1e-4)
        head = torch.randn(5000, 576, generator=g)
        x = torch.randn(rows, 576, generator=g)
        assert GreedyLMHead(head)(x) == kernels.gemm_f32(x, head).argmax(1).tolist()
    print("ok")
"""


def run_isa_script(env: dict[str, str]) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", ISA_SCRIPT],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow  # compiles the AVX2 build of the kernels (~20-40 s) when this host has AVX-512
def test_avx2_build_matches_the_reference_on_any_host() -> None:
    out = run_isa_script({"LLMPIPE_KERNEL_ISA": "avx2"})
    assert "isa avx2 available True" in out and "ok" in out


def test_isa_follows_the_cpu_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "fma", *build.AVX512_CPU_FLAGS}))
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    assert build.kernel_isa() == "avx512"
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    assert build.kernel_isa() == "avx2"
    monkeypatch.setenv(build.ISA_ENV, "avx512_bf16")  # an override never raises the level past the CPU's
    assert build.kernel_isa() == "avx512"
    monkeypatch.setattr(  # AVX512_BF16 without AVX512_VNNI (no such CPU shipped): the int8 dot is missing
        build, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512_bf16", *build.AVX512_CPU_FLAGS})
    )
    monkeypatch.delenv(build.ISA_ENV)
    assert build.kernel_isa() == "avx512"
    monkeypatch.setattr(
        build,
        "cpu_flags",
        lambda: frozenset({"avx2", "fma", "avx512_bf16", "avx512_vnni", *build.AVX512_CPU_FLAGS}),
    )
    assert build.kernel_isa() == "avx512_bf16"
    monkeypatch.setenv(build.ISA_ENV, "avx512")
    assert build.kernel_isa() == "avx512"
    monkeypatch.setattr(
        build,
        "cpu_flags",
        lambda: frozenset(
            {"avx2", "fma", "avx512_bf16", "avx512_vnni", *build.AMX_CPU_FLAGS, *build.AVX512_CPU_FLAGS}
        ),
    )
    monkeypatch.delenv(build.ISA_ENV)
    assert build.kernel_isa() == "amx"
    monkeypatch.setenv(build.ISA_ENV, "avx512_bf16")  # the same CPU without its tiles, to compare the two
    assert build.kernel_isa() == "avx512_bf16"
    monkeypatch.setenv(build.ISA_ENV, "sse")
    with pytest.raises(ValueError, match="LLMPIPE_KERNEL_ISA"):
        build.kernel_isa()
    monkeypatch.delenv(build.ISA_ENV)
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))  # no VL/BW/DQ
    assert build.kernel_isa() == "avx2"
    # The ISA's flags are compile arguments, so part of the cache key.
    assert build.ISA_FLAGS["avx2"] != build.ISA_FLAGS["avx512"]


NO_KERNELS_SCRIPT = """
import torch
from pipeline.runtime.engine_config import model_config_from_dict
from pipeline.runtime.model.fused_decoder import FusedDecoder
from pipeline.runtime.model.greedy_head import GreedyLMHead
from pipeline.runtime.model.layers import DenseLinear
from pipeline.runtime.model.weights import LayerWeights, ModelWeights
config = model_config_from_dict({
    "architecture": "LlamaForCausalLM", "dtype": "float32", "vocab_size": 50, "hidden_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "max_position_embeddings": 128, "norm_epsilon": 1e-5, "hidden_act": "silu"})
dense = lambda o, i: DenseLinear(torch.randn(o, i))
layer = LayerWeights(torch.ones(64), dense(128, 64), dense(64, 64), torch.ones(64), dense(192, 64), dense(64, 96))
embedding = torch.randn(50, 64)
weights = ModelWeights(embedding, [layer], torch.ones(64), DenseLinear(embedding))
print(FusedDecoder.build(config, weights), GreedyLMHead.for_lm_head(weights.lm_head))
"""


def test_without_kernels_nothing_needs_them() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", NO_KERNELS_SCRIPT],
        cwd=ROOT,
        env={**os.environ, "LLMPIPE_DISABLE_KERNELS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None", "None"]  # the model then runs op by op, logits + argmax
