"""Building blocks of the forward: linear layers, RMSNorm and the MLP activations."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.quant.linear import bf16_linear, fp32_linear


class Linear(Protocol):
    """What the model needs from a (dense or quantized) linear layer: y = x @ W.T (+ b)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def weight_bytes(self) -> int:
        """Bytes of stored weights a forward reads (for a quantized layer: codes, scales, zero points)."""
        ...


class DenseLinear:
    """y = x @ W.T (+ b). A bf16 weight multiplies x rounded to bf16, unless `widened`: then it holds fp32
    values exactly (a bf16 checkpoint's) and the product is the fp32 one of the fp32 copy it widens to (up to
    summation order on AMX tiles: kernels.gemm_f32), at half the bytes read (the lm_head of a bf16 checkpoint:
    the logits and the greedy head stay fp32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, widened: bool = False) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias
        self.widened = widened

    @property
    def weight_bytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Few-row fp32 CPU inputs (decode) take the hand-written GEMV, ~20% faster than MKL's here and
        # ~40% on the lm_head; everything else is F.linear.
        if self.weight.dtype == torch.bfloat16 and x.dtype == torch.float32 and not self.widened:
            return bf16_linear(x, self.weight, self.bias)
        return fp32_linear(x, self.weight, self.bias)


class ResidualRMSNorm:
    """hidden += delta (when given), then RMSNorm(hidden) * weight: the compiled kernel when `use_kernel`
    (CPU, fp32), else torch."""

    def __init__(self, use_kernel: bool, hidden_size: int, eps: float) -> None:
        self.use_kernel = use_kernel
        self.shape = (hidden_size,)
        self.eps = eps

    def __call__(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        if self.use_kernel and (delta is None or delta.is_contiguous()):
            return kernels.add_rms_norm(hidden, delta, weight, self.eps)
        if delta is not None:
            hidden.add_(delta)
        return F.rms_norm(hidden, self.shape, weight, self.eps)


def activation(name: str, gate: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation of `gate`, in place: silu (SwiGLU) or tanh-approximated GELU (GeGLU)."""
    if name == "silu":
        return F.silu(gate, inplace=True)
    return F.gelu(gate, approximate="tanh")
