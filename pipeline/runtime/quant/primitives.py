"""Quantization primitives: pure functions shared by the offline quantize stage and the runtime.

The tensors these functions return are an on-disk format: the quantize stage writes them to safetensors as they
are, and the runtime kernels (`kernels/qgemv.cpp`) read them without repacking. Changing a layout below means a
new scheme name in the artifact manifest, not a silent edit.

int8: per output channel, symmetric
    qweight  int8  [out, in]
    scales   fp32  [out]           scales[o] = max_i |W[o, i]| / 127  (1.0 for an all-zero row)
    W[o, i] ~= qweight[o, i] * scales[o]          qweight in [-127, 127]

int4: group-wise along `in`, asymmetric
    packed   uint8 [out, in // 2]  byte j of row o = q[o, 2j] | q[o, 2j + 1] << 4   (low nibble first)
    scales   fp32  [out, G]        G = ceil(in / group_size); group g covers columns
    zeros    fp32  [out, G]            [g * group_size, min((g + 1) * group_size, in)): the last may be shorter
    W[o, i] ~= (q[o, i] - zeros[o, g]) * scales[o, g]     q in [0, 15], g = i // group_size
    Per group: scales = (max - min) / 15 and zeros = -min / scales, a real number (not rounded to an
    integer), so each group's min and max are reproduced exactly. NOTE: that makes requantizing a GGUF Q4_1
    checkpoint (blocks of 32 with scale and min) at group_size=32 lossless up to fp32 rounding.
    `in` must be even; group_size must be 32 or a multiple of 64 (the kernels walk K in 64-wide chunks).

int8 layers multiply their weights with activations rounded per row to 16-bit fixed point (not stored):
    x[m, i] ~= q[m, i] * s[m],  s[m] = max_i |x[m, i]| / 16383 (1.0 for an all-zero row), q in [-16383, 16383]
    15 bits + sign keep the kernels' int32 sums exact (each product < 2^21); on SmolLM2-135M the rounding
    changed none of the accuracy metrics against weight-only int8 with fp32 activations.

w8a8 layers store int8 weights exactly as int8 does, and round their activations per row to int8 levels the
same way (s[m] = max_i |x[m, i]| / 127, q in [-127, 127]): SmoothQuant's per-token dynamic activations, whose
integer dots AMX tiles take in one pass where int16 levels need two.

int4 layers in steps of up to INT4_DIRECT_MAX_ROWS rows (decode) multiply their levels with the activations
rounded as int8 layers round them (int16 per row), summed exactly per group and scaled by the group's fp32
scale and zero point: the kernels take integer dot products there. Steps of more rows (batched decode, prefill)
round both the dequantized fp32 weights and the activations to bf16 instead (round_bf16) and sum in fp32, as a
bf16 layer does: the kernels' tiles then take bf16 dot products. Either rounding (2^-15 or 2^-9 relative) is
small beside int4's own steps.
"""

from __future__ import annotations

import torch

INT8_QMAX = 127
INT4_QMAX = 15
ACT_QMAX = 16383
W8A8_ACT_QMAX = 127
INT4_DIRECT_MAX_ROWS = 4  # the kernels' kInt4DirectMaxRows


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (qweight int8 [out, in], scales fp32 [out]); see the module docstring."""
    w = _as_fp32_matrix(weight)
    amax = w.abs().amax(dim=1)  # [out]
    scales = torch.where(amax > 0, amax / INT8_QMAX, torch.ones_like(amax))
    qweight = torch.round(w / scales[:, None]).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return qweight, scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(qweight int8 [out, in], scales [out]) -> fp32 [out, in]."""
    return qweight.to(torch.float32) * scales.to(torch.float32)[:, None]


def round_activations_int16(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] float -> fp32 q * s per row (see the module docstring): the values int8 layers multiply."""
    return _round_rows(x, ACT_QMAX)


def round_activations_int8(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] float -> fp32 q * s per row at int8 levels: the values w8a8 layers multiply."""
    return _round_rows(x, W8A8_ACT_QMAX)


def _round_rows(x: torch.Tensor, qmax: int) -> torch.Tensor:
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return torch.round(x32 / scale).clamp_(-qmax, qmax) * scale


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest bf16 (ties to even), as fp32: what int4 steps of many rows multiply."""
    return x.to(torch.bfloat16).to(torch.float32)


def int4_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What an int4 layer multiplies, in fp32, for activation rows x [rows, in] and its dequantized fp32
    weight [out, in] (see the module docstring)."""
    if x.shape[0] > INT4_DIRECT_MAX_ROWS:
        return round_bf16(x), round_bf16(weight)
    return round_activations_int16(x), weight


def check_int4_shape(in_features: int, group_size: int) -> None:
    """Raise ValueError unless the int4 layout can hold a weight with `in_features` columns."""
    if group_size != 32 and (group_size <= 0 or group_size % 64 != 0):
        raise ValueError(f"int4 group_size must be 32 or a positive multiple of 64, got {group_size}")
    if in_features % 2 != 0:
        raise ValueError(f"int4 packs two columns per byte: in_features must be even, got {in_features}")


def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def quantize_int4_groupwise(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float -> (packed uint8 [out, in // 2], scales fp32 [out, G], zeros fp32 [out, G])."""
    w = _as_fp32_matrix(weight)
    in_features = w.shape[1]
    lo, hi = int4_group_range(w, group_size)
    scales, zeros = int4_grid(lo, hi)  # [out, G]
    lo_cols = _expand_groups(lo, group_size, in_features)
    scale_cols = _expand_groups(scales, group_size, in_features)
    return pack_int4(int4_levels(w, lo_cols, scale_cols)), scales, zeros


def int4_group_range(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (min, max) of each (row, group), fp32 [out, G] each."""
    w = _as_fp32_matrix(weight)
    out_features, in_features = w.shape
    check_int4_shape(in_features, group_size)
    num_g = num_groups(in_features, group_size)
    pad = num_g * group_size - in_features
    # Padding with +inf / -inf keeps a short last group's min / max to its real columns.
    lo = (
        torch.nn.functional.pad(w, (0, pad), value=float("inf")).view(out_features, num_g, group_size).amin(2)
    )
    hi = (
        torch.nn.functional.pad(w, (0, pad), value=float("-inf"))
        .view(out_features, num_g, group_size)
        .amax(2)
    )
    return lo, hi


def int4_grid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros) of groups whose 16 levels span [lo, hi] (elementwise); see the module docstring."""
    span = hi - lo
    # A constant group gets scale 1 and zero -min: q = 0 decodes to the constant exactly.
    scales = torch.where(span > 0, span / INT4_QMAX, torch.ones_like(span))
    return scales, -lo / scales


def int4_levels(w: torch.Tensor, lo: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The level q in [0, 15] (uint8) of the grid lo + q * scales nearest to each w (elementwise)."""
    return torch.round((w - lo) / scales).clamp_(0, INT4_QMAX).to(torch.uint8)


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """(packed uint8 [out, in // 2], scales [out, G], zeros [out, G]) -> fp32 [out, in]."""
    q = unpack_int4(packed).to(torch.float32)
    out_features, in_features = q.shape
    num_g = num_groups(in_features, group_size)
    pad = num_g * group_size - in_features
    if pad:  # whole groups, so that columns can be viewed by group
        q = torch.nn.functional.pad(q, (0, pad))
    zeros3 = zeros.to(torch.float32)[:, :, None]  # [out, G, 1]
    scales3 = scales.to(torch.float32)[:, :, None]
    w = (q.view(out_features, num_g, group_size) - zeros3) * scales3
    return w.view(out_features, -1)[:, :in_features].contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values in [0, 15], [out, in] (in even) -> [out, in // 2], low nibble = even column."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [out, in // 2] uint8 -> [out, in] uint8."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=2).view(packed.shape[0], -1)


def _expand_groups(per_group: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    # [out, G] -> [out, in]: each group's value repeated over its columns.
    return per_group.repeat_interleave(group_size, dim=1)[:, :in_features]


def _as_fp32_matrix(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    return weight.detach().to(torch.float32)
