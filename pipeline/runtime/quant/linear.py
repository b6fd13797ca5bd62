"""Weight-only quantized linear layers for the torch backend, plus a fast fp32 linear for decode.

`QuantLinear` stores the tensors of `primitives.py` (the on-disk layout) as buffers and picks a path per call:
the fused CPU kernel up to `max_kernel_rows` activation rows (decode; on AVX-512 builds prefill chunks too), else
dequantize + torch matmul (many rows on AVX2 builds, CUDA, and wherever the kernels are unavailable). Both paths
compute with the same fp32 weights and the same rounded activations (int8: int16 levels per row; w8a8: int8 levels
per row, the same weights; int4: int16 levels, or bf16-rounded weights and activations in steps of many rows,
`primitives.int4_operands`), so they agree to float rounding. `fp32_linear` picks the same way between the fp32
kernel and torch's GEMM, whose many-row steps outrun the kernel's on some CPUs (`gemm_probe`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.kernels.build import has_wide_vectors
from pipeline.runtime.kernels.gemm_probe import torch_outruns_fp32_kernel
from pipeline.runtime.kernels.ops import kernels_available, kernels_unavailable_reason
from pipeline.runtime.quant import primitives

__all__ = [
    "QuantLinear",
    "Scheme",
    "bf16_linear",
    "fp32_kernel_weight",
    "fp32_linear",
    "kernels_available",
    "kernels_unavailable_reason",
    "max_kernel_rows",
]

Scheme = Literal["int8", "w8a8", "int4"]
SCHEMES: tuple[Scheme, ...] = ("int8", "w8a8", "int4")
# Schemes whose weights are int8 per output channel (the same tensors; they differ in the activations' rounding).
INT8_WEIGHT_SCHEMES: tuple[Scheme, ...] = ("int8", "w8a8")

# Largest activation-row count sent to the kernels; above it, dequantize + torch matmul. AVX2 builds, measured
# with scripts/bench_quant_kernels.py on SmolLM2 shapes, 2 threads (benchmarks/NOTES.md): at 128 rows int8
# still ties or leads, int4 already loses on 3 of the 4 layer shapes; the fp32 GEMV ties torch at 64 rows on
# 576x1536 and loses at 128.
_AVX2_MAX_KERNEL_ROWS: dict[str, int] = {"fp32": 32, "bf16": 32, "int8": 128, "w8a8": 128, "int4": 64}
# AVX-512 builds run steps of 4+ rows in 512-bit vectors: on a Zen 5 (2 threads, 3072x576 and 576x1536) the
# fp32, int8 and int4 kernels ran 1.1-3.7x the rate of torch's fp32 matmul (after dequantizing) at every row
# count from 64 to 2048, so prefill chunks take them too. bf16 keeps oneDNN's bf16 GEMM for many rows.
_AVX512_MAX_KERNEL_ROWS: dict[str, int] = {"fp32": 2048, "bf16": 32, "int8": 2048, "w8a8": 2048, "int4": 2048}
# Where torch's fp32 GEMM outruns the kernel on prefill-sized steps (gemm_probe), steps of more rows than this go
# to torch. On a Sapphire Rapids Xeon (2 threads, SmolLM2's shapes) torch took 0.85-0.87x the kernel's time at 64
# rows and 0.63-0.72x at 128; one step of more than 64 rows also leaves the fused decoder for a call per layer,
# which costs ~10 ms more. A 256-token prompt of the fp32 SmolLM2-135M prefilled in 447-462 ms on the kernel,
# 290-299 ms this way; 512 tokens in 1218-1224 ms, 602-638 ms.
FP32_MAX_KERNEL_ROWS_WHERE_TORCH_WINS = 64


def max_kernel_rows(kind: str) -> int:
    """Most activation rows a linear with `kind` weights ("fp32", "bf16", "int8", "w8a8", "int4") sends to the kernels
    built for this CPU."""
    if not has_wide_vectors():
        return _AVX2_MAX_KERNEL_ROWS[kind]
    if kind == "fp32" and kernels_available() and torch_outruns_fp32_kernel():
        return FP32_MAX_KERNEL_ROWS_WHERE_TORCH_WINS
    return _AVX512_MAX_KERNEL_ROWS[kind]


class QuantLinear(torch.nn.Module):
    """y = x @ W.T + bias with W stored as int8 (per output channel; x rounded per row to int16 first, or to int8
    for w8a8, see primitives) or int4 (group-wise, with zero points).

    Buffers (also `state_tensors()` keys; the engine stores them as `<layer name>.<key>`):
    `qweight` (int8 [out, in] or packed uint8 [out, in // 2]), `scales`, `zeros` (int4 only), `bias` (if any).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        scheme: Scheme,
        tensors: dict[str, torch.Tensor],
        group_size: int | None = None,
    ) -> None:
        super().__init__()
        _check_tensors(scheme, tensors, group_size)
        self.scheme: Scheme = scheme
        self.group_size = group_size
        self.out_features = tensors["qweight"].shape[0]
        self.in_features = tensors["qweight"].shape[1] * (2 if scheme == "int4" else 1)
        self.int8_activations = scheme == "w8a8"
        self.max_kernel_rows = max_kernel_rows(scheme)
        for name in ("qweight", "scales", "zeros", "bias"):
            tensor = tensors.get(name)
            self.register_buffer(name, None if tensor is None else tensor.contiguous())
        # W8A8 kernels subtract 128 x each weight row's sum from their byte dots: summed at the first kernel
        # call, not at every one (which also lets one-row steps take the byte dots).
        self._byte_bias: torch.Tensor | None = None

    @property
    def weight_bytes(self) -> int:
        return sum(b.nbytes for name, b in self.named_buffers() if name != "bias")

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        scheme: Scheme = "int8",
        group_size: int | None = None,
    ) -> QuantLinear:
        """Quantize a float [out, in] weight (the bias stays fp32)."""
        tensors: dict[str, torch.Tensor] = {}
        if scheme in INT8_WEIGHT_SCHEMES:
            tensors["qweight"], tensors["scales"] = primitives.quantize_int8_per_channel(weight)
        elif scheme == "int4":
            if group_size is None:
                raise ValueError("int4 needs a group_size (32 or a multiple of 64)")
            packed, scales, zeros = primitives.quantize_int4_groupwise(weight, group_size)
            tensors.update(qweight=packed, scales=scales, zeros=zeros)
        else:
            raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
        if bias is not None:
            tensors["bias"] = bias.detach().to(torch.float32)
        return cls(scheme, tensors, group_size)

    @classmethod
    def from_packed(
        cls, tensors: dict[str, torch.Tensor], scheme: Scheme, group_size: int | None = None
    ) -> QuantLinear:
        """Rebuild from `state_tensors()` output. `scheme` and `group_size` come from the artifact manifest:
        they cannot be told apart from shapes alone (a short last group hides the group size)."""
        return cls(scheme, dict(tensors), group_size)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {name: buf for name, buf in self.named_buffers(recurse=False) if buf is not None}

    def quantized_bytes(self) -> int:
        """Bytes of all stored tensors (weights, scales, zeros, bias)."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors().values())

    def dequantize(self) -> torch.Tensor:
        """The fp32 [out, in] weight (int4 steps of many rows round it to bf16: see primitives)."""
        # The compiled dequantizers return the primitives' exact values, several times faster.
        native = self.qweight.is_cpu and kernels_available()
        if self.scheme in INT8_WEIGHT_SCHEMES:
            fn8 = kernels.dequantize_int8 if native else primitives.dequantize_int8
            return fn8(self.qweight, self.scales)
        assert self.zeros is not None and self.group_size is not None
        fn4 = kernels.dequantize_int4 if native else primitives.dequantize_int4
        return fn4(self.qweight, self.scales, self.zeros, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if x.shape[0] <= self.max_kernel_rows and _kernel_ok(x):
            if self.scheme in INT8_WEIGHT_SCHEMES:
                if self.int8_activations and self._byte_bias is None:
                    self._byte_bias = kernels.int8_byte_bias(self.qweight)
                return kernels.gemm_int8(
                    x, self.qweight, self.scales, self.bias, self.int8_activations, self._byte_bias
                )
            assert self.zeros is not None and self.group_size is not None
            return kernels.gemm_int4(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias)
        bias, weight = self.bias, self.dequantize()
        if self.scheme == "w8a8":
            x = primitives.round_activations_int8(x).to(x.dtype)
        elif self.scheme == "int8":
            x = primitives.round_activations_int16(x).to(x.dtype)
        else:
            rounded, weight = primitives.int4_operands(x, weight)
            x = rounded.to(x.dtype)
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.scheme == "int4" else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}{group}"
        )


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in x's dtype, but fp32 CPU inputs of few rows go to the hand GEMV (faster than torch's, e.g.
    for the lm_head). `weight` [out, in] is fp32, or bf16 taken as the fp32 values it widens to (the GEMV
    reads it as it is: the widened copy's logits at half the bytes, see kernels.gemm_f32; more rows than it takes,
    e.g. every prompt position's logits, multiply a widened copy made for the call); it must be contiguous to
    take the kernel path."""
    if (
        x.dim() == 2
        and x.shape[0] <= max_kernel_rows("fp32")
        and _kernel_ok(x)
        and fp32_kernel_weight(weight)
    ):
        return kernels.gemm_f32(x, weight, bias)
    if x.dim() > 2:  # the row count decides the path: flatten leading dims
        return fp32_linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight.to(x.dtype), bias)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 x @ bf16 weight.T (+ fp32 bias) -> fp32, the inputs rounded to bf16 like the decoder kernel's.
    oneDNN's bf16 GEMM where the CPU has bf16 dot products (~2.3x fp32 here; it rounds its outputs to bf16
    too); elsewhere torch's bf16 matmul is ~100x slower than fp32 (MODELS.md), so the weights are widened."""
    rounded = x.to(torch.bfloat16)
    if not weight.is_cpu or kernels.cpu_has_bf16_dot():
        y = F.linear(rounded, weight).to(x.dtype)
    else:
        y = F.linear(rounded.to(x.dtype), weight.to(x.dtype))
    return y if bias is None else y + bias


def fp32_kernel_weight(weight: torch.Tensor) -> bool:
    """Whether the fp32 GEMV can read `weight` [out, in] as it is: fp32 or bf16 (widened), CPU, contiguous."""
    return weight.dtype in (torch.float32, torch.bfloat16) and weight.is_cpu and weight.is_contiguous()


def _kernel_ok(x: torch.Tensor) -> bool:
    return x.is_cpu and x.dtype == torch.float32 and kernels_available()


def _check_tensors(scheme: str, tensors: dict[str, torch.Tensor], group_size: int | None) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
    expected = {"qweight", "scales"} | ({"zeros"} if scheme == "int4" else set())
    missing, extra = expected - tensors.keys(), tensors.keys() - expected - {"bias"}
    if missing or extra:
        raise ValueError(f"{scheme} tensors: missing {sorted(missing)}, unexpected {sorted(extra)}")
    qweight, scales = tensors["qweight"], tensors["scales"]
    out_features = qweight.shape[0]
    if scheme in INT8_WEIGHT_SCHEMES:
        in_features = qweight.shape[1]
        _expect(qweight, torch.int8, (out_features, in_features), "qweight")
        _expect(scales, torch.float32, (out_features,), "scales")
    else:
        if group_size is None:
            raise ValueError("int4 needs a group_size (from the artifact manifest)")
        in_features = qweight.shape[1] * 2
        primitives.check_int4_shape(in_features, group_size)
        groups = (out_features, primitives.num_groups(in_features, group_size))
        _expect(qweight, torch.uint8, (out_features, in_features // 2), "qweight")
        _expect(scales, torch.float32, groups, "scales")
        _expect(tensors["zeros"], torch.float32, groups, "zeros")
    if "bias" in tensors:
        _expect(tensors["bias"], torch.float32, (out_features,), "bias")


def _expect(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], name: str) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
