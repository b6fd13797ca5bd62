"""The CPU runtime's kernels (AVX2 + FMA, OpenMP): fused dequantize + matmul for skinny activations
(y = x @ W.T + bias), a decoder layer's dense part, the greedy lm_head, paged attention and add + RMSNorm.

They are one library of `torch.ops.llmpipe_quant.*` ops, built by the engine stage or else on first use (see
build.py). Callers check `kernels_available()` and otherwise use the pure-PyTorch path (dequantize + matmul,
SDPA, F.rms_norm); `kernels_unavailable_reason()` says why the kernels are off.

Every gemm_* takes x as fp32 CPU [M, K] (rows may be strided, columns dense) and weight tensors laid out as in
`pipeline.runtime.quant.primitives`, contiguous, on CPU, with fp32 scales / zeros / bias; it returns a new fp32
[M, N] tensor. `dequantize_int8` / `dequantize_int4` are multithreaded, bit-identical versions of the
primitives, for the many-row path (dequantize, then torch matmul). All run on `torch.get_num_threads()` threads
and raise RuntimeError on a wrong dtype, device or shape.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pipeline.runtime.kernels.build import BF16_CPU_FLAG, cpu_flags, load_library

_OP_NAMES = (
    "gemm_f32",
    "gemm_int8",
    "int8_byte_bias",
    "gemm_int4",
    "dequant_int8",
    "dequant_int4",
    "greedy_argmax",
    "paged_attention",
    "add_rms_norm",
    "set_wide_single_row",
    "set_far_prefetch",
    "set_tiles",
    "tiles_available",
)


@functools.cache
def _load() -> tuple[dict[str, Any], str]:
    library, reason = load_library()
    if library is None:
        return {}, reason
    # The `.default` overloads skip overload resolution on every call (~2 us each).
    return {name: getattr(torch.ops.llmpipe_quant, name).default for name in _OP_NAMES}, ""


def _op(name: str) -> Any:
    ops, reason = _load()
    if not ops:
        raise RuntimeError(f"the CPU kernels are unavailable: {reason}")
    return ops[name]


def kernels_available() -> bool:
    """True when the compiled kernels can run here (builds them on the first call)."""
    return not _load()[1]


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512_BF16 or AMX), which torch's bf16 GEMMs need to be
    faster than fp32 ones rather than ~100x slower."""
    return BF16_CPU_FLAG in cpu_flags() or "amx_bf16" in cpu_flags()


def kernels_unavailable_reason() -> str:
    """Why `kernels_available()` is False; empty when it is True."""
    return _load()[1]


def gemm_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in fp32; a bf16 weight is read as the fp32 values it
    widens to: the same result as its fp32 copy, bit for bit, except on AMX tiles (steps of 2+ rows of
    whole-tile shapes), whose products are as exact but whose fp32 sums go in another order (~1e-7 relative).
    Either way a row's result does not depend on the rows beside it from 2 rows on."""
    return _op("gemm_f32")(x, weight, bias)


def gemm_int8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    int8_activations: bool = False,
    byte_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ (qweight int8 [N, K] * scales [N, 1]).T (+ bias) -> [M, N], x's rows rounded to int16 levels,
    or to int8 ones with `int8_activations` (W8A8). W8A8 callers that keep `byte_bias` (int8_byte_bias of
    qweight) spare the kernel summing the weight rows on every call; the result is the same."""
    return _op("gemm_int8")(x, qweight, scales, bias, int8_activations, byte_bias)


def int8_byte_bias(qweight: torch.Tensor) -> torch.Tensor:
    """128 x the sum of each row of qweight int8 [N, K], int64 [N]: gemm_int8's byte_bias."""
    return _op("int8_byte_bias")(qweight)


def gemm_int4(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantize_int4(packed [N, K / 2], scales, zeros, group_size).T (+ bias) -> [M, N]."""
    return _op("gemm_int4")(x, packed, scales, zeros, group_size, bias)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """primitives.dequantize_int8, bit for bit."""
    return _op("dequant_int8")(qweight, scales)


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """primitives.dequantize_int4, bit for bit."""
    return _op("dequant_int4")(packed, scales, zeros, group_size)


def decoder_plan(
    linears: list[torch.Tensor | None],
    norms: list[torch.Tensor | None],
    group_sizes: list[int],
    eps: float,
    activation: str = "silu",
    moe_linears: list[torch.Tensor | None] | None = None,
    moe_group_sizes: list[int] | None = None,
    moe_shapes: list[int] | None = None,
    *,
    int8_activations: bool = False,
) -> Any:
    """A `torch.classes.llmpipe_quant.DecoderPlan`: validated decoder-layer steps whose `run(i, hidden, attn)`
    computes entry i's dense part in one call, updating the residual stream hidden [M, H] in place.

    Per entry: 4 x [weight, scales, zeros, bias] in `linears` (None where absent) for the attention output
    projection, the fused gate/up projection (gate rows first), the down projection and the next layer's fused
    q/k/v, the weight's dtype picking the format (float32, int8 per channel, uint8 packed int4 with the entry's
    `group_sizes`); [attention output, post-attention (pre-MLP), MLP output, next] RMSNorm weights in `norms`,
    each None where the layer has none. `run` with attn [M, dense in]:
        a = attn @ dense.T;  hidden += rms_norm(a) * attention_output_norm, or a without that norm
        x = rms_norm(hidden) * post_norm, or hidden
        m = down(act(gate(x)) * up(x));  hidden += rms_norm(m) * mlp_output_norm, or m
    with act = silu or gelu_pytorch_tanh (`activation`). Then, with a next norm or next_qkv, it returns
    next_qkv(x) for x = rms_norm(hidden) * next_norm (or hidden), or x itself without next_qkv; with neither,
    an empty [0, H] tensor. The plan keeps the weights alive.

    A sparse entry has no gate_up or down but a MoE block in place of the MLP (m above): `moe_shapes` holds
    [num_experts E, top_k, normalize] per entry (E = 0 for the others; all zero when omitted) and each sparse
    entry, in order, takes its next 2 E + 1 linears from `moe_linears` (4 tensors each, as above: the fp32
    router [E, H] without scales or bias, then every expert's gate_up and down) and group sizes from
    `moe_group_sizes`. It computes pipeline.runtime.model.moe.moe_forward(x): router softmax in fp32, the top_k
    experts (renormalized when `normalize`), their SwiGLU outputs times the weights summed in ascending expert
    order. `int8_activations`: every int8 linear is W8A8 (rows rounded to int8 levels, as gemm_int8's).
    """
    _op("gemm_f32")  # builds and loads the library, or raises why not
    count = len(norms) // 4
    return torch.classes.llmpipe_quant.DecoderPlan(
        linears,
        norms,
        group_sizes,
        eps,
        activation,
        int8_activations,
        moe_linears or [],
        moe_group_sizes or [],
        moe_shapes if moe_shapes is not None else [0] * (3 * count),
    )


def greedy_argmax(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    weight: torch.Tensor,
    error_per_l1: torch.Tensor,
    error_per_level: torch.Tensor,
) -> torch.Tensor:
    """argmax_v x[r] . weight[v] per row of x [R, K] (int64 [R], first maximum on ties), screening with the int8
    copy (qweight [V, K], scales [V]) of weight [V, K]: exact when, for token v, error_per_l1[v] * ||x||_1 +
    error_per_level[v] * step (the row's int16 activation step, amax / 16383) bounds how far its screened logit
    and its computed fp32 logit can each be from the true one. The exact logits are gemm_f32's register-tile
    ones, bit for bit (a widened bf16 weight on AMX tiles sums them in another order)."""
    return _op("greedy_argmax")(x, qweight, scales, weight, error_per_l1, error_per_level)


def paged_attention(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    num_heads: int,
    block_size: int,
    window: int,
    max_context: int,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One layer's RoPE (on the query and key heads of qkv [T, (H + 2 KV) D], in place), K/V cache write and
    causal attention over the paged cache -> [T, H D]. The caches are [num_blocks * block_size, KV, D] fp32,
    bf16 or int8 (the int8 one with fp32 k_scales/v_scales [num_blocks * block_size, KV]); the rest is an
    `AttentionMetadata`'s (positions, slots int64 [T]; block_tables [S, max_blocks], token_seq [T] int32) and
    the RoPE table cos_sin [max_positions, D]. window 0 = none; scale multiplies q . k; softcap > 0 caps each
    score s to softcap * tanh(s / softcap) before the mask and softmax (Gemma 2), 0 = none."""
    return _op("paged_attention")(
        qkv,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        cos_sin,
        positions,
        slots,
        block_tables,
        token_seq,
        num_heads,
        block_size,
        window,
        max_context,
        scale,
        softcap,
    )


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """hidden [T, H] += delta [T, H] (in place, when given), then RMSNorm(hidden) * weight [H] into a new
    tensor, in HF's order of operations; contiguous fp32."""
    return _op("add_rms_norm")(hidden, delta, weight, eps)


def set_wide_single_row(on: bool) -> bool:
    """Whether one-row steps run the kernels' 512-bit vector form (AVX-512 builds; the results are the same bits
    either way, only the speed differs by CPU). Process-wide; returns the previous setting (always False where
    the build has no such form)."""
    return bool(_op("set_wide_single_row")(on))


def set_far_prefetch(on: bool) -> bool:
    """Whether the kernels' register tiles prefetch every weight stream far ahead into L2 (on) or, except for
    fp32 steps of several rows, one block ahead into L1 (off). Which is faster depends on the CPU's memory
    system; the results are the same bits either way. Process-wide; returns the previous setting."""
    return bool(_op("set_far_prefetch")(on))


def set_tiles(on: bool) -> bool:
    """Whether bf16, int8 and int4 linears of whole-tile shapes (16-row blocks, K a multiple of 32 / 64) run on
    AMX tiles (builds for AMX CPUs, where Linux grants the tile state) or on the vector register tiles. int8
    gives the same bits either way; bf16 and many-row int4 sum their products in another order. Process-wide;
    returns the previous setting (always False where there are no tiles)."""
    return bool(_op("set_tiles")(on))


def tiles_available() -> bool:
    """Whether the kernels built here have AMX tiles and Linux granted this process their state."""
    return bool(_op("tiles_available")())
