"""Fused dequantize + matmul CPU kernels (AVX2 + FMA, OpenMP) for skinny activations: y = x @ W.T + bias.

The library is compiled on first use (see build.py). Callers check `kernels_available()` and otherwise use the
pure-PyTorch path (dequantize + matmul); `kernels_unavailable_reason()` says why the kernels are off.

`dequantize_int8` / `dequantize_int4` are multithreaded, bit-identical versions of the primitives, for the
many-row path (dequantize, then torch matmul). Every gemm_* takes x as fp32 CPU [M, K] with unit column stride (any row stride) and weight tensors laid out as
in `pipeline.runtime.quant.primitives`, contiguous, on CPU; scales / zeros / bias fp32 contiguous. They run on
`torch.get_num_threads()` threads and return a new fp32 [M, N] tensor.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pipeline.runtime.quant.kernels.build import load_library

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    lib, reason = load_library()
    if lib is not None:
        lib.llmp_gemm_f32.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _I64, _INT]
        lib.llmp_gemm_f32.restype = None
        lib.llmp_gemm_int8.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _INT]
        lib.llmp_gemm_int8.restype = None
        lib.llmp_gemm_int4.argtypes = [_P, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I64, _INT]
        lib.llmp_gemm_int4.restype = _INT
        lib.llmp_dequant_int8.argtypes = [_P, _P, _I64, _I64, _P, _INT]
        lib.llmp_dequant_int8.restype = None
        lib.llmp_dequant_int4.argtypes = [_P, _P, _P, _I64, _I64, _I64, _P, _INT]
        lib.llmp_dequant_int4.restype = _INT
    return lib, reason


def kernels_available() -> bool:
    """True when the compiled kernels can run here (builds them on the first call)."""
    return _library()[0] is not None


def kernels_unavailable_reason() -> str:
    """Why `kernels_available()` is False; empty when it is True."""
    return _library()[1]


def gemm_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N]."""
    x, lib = _checked(x)
    y = x.new_empty((x.shape[0], weight.shape[0]))
    lib.llmp_gemm_f32(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(), _ptr(bias),
        y.data_ptr(), weight.shape[0], torch.get_num_threads(),
    )  # fmt: skip
    return y


def gemm_int8(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ (qweight int8 [N, K] * scales [N, 1]).T (+ bias) -> [M, N]."""
    x, lib = _checked(x)
    y = x.new_empty((x.shape[0], qweight.shape[0]))
    lib.llmp_gemm_int8(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), qweight.data_ptr(), scales.data_ptr(),
        _ptr(bias), y.data_ptr(), qweight.shape[0], torch.get_num_threads(),
    )  # fmt: skip
    return y


def gemm_int4(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantize_int4(packed [N, K/2], scales, zeros, group_size).T (+ bias) -> [M, N]."""
    x, lib = _checked(x)
    y = x.new_empty((x.shape[0], packed.shape[0]))
    rc = lib.llmp_gemm_int4(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), packed.data_ptr(), scales.data_ptr(),
        zeros.data_ptr(), group_size, _ptr(bias), y.data_ptr(), packed.shape[0], torch.get_num_threads(),
    )  # fmt: skip
    _raise_for(rc, x.shape[1], group_size)
    return y


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """primitives.dequantize_int8, bit for bit, multithreaded."""
    lib = _checked_library()
    out = torch.empty(qweight.shape, dtype=torch.float32)
    lib.llmp_dequant_int8(
        qweight.data_ptr(), scales.data_ptr(), qweight.shape[0], qweight.shape[1], out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """primitives.dequantize_int4, bit for bit, multithreaded."""
    lib = _checked_library()
    out = torch.empty((packed.shape[0], packed.shape[1] * 2), dtype=torch.float32)
    rc = lib.llmp_dequant_int4(
        packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), group_size, out.shape[0], out.shape[1],
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _raise_for(rc, out.shape[1], group_size)
    return out


def _checked_library() -> ctypes.CDLL:
    lib, reason = _library()
    if lib is None:
        raise RuntimeError(f"quantized CPU kernels are unavailable: {reason}")
    return lib


def _raise_for(rc: int, in_features: int, group_size: int) -> None:
    if rc == -1:
        raise MemoryError("int4 kernel could not allocate its scratch")
    if rc != 0:
        raise ValueError(
            f"int4 kernel rejected in_features={in_features}, group_size={group_size} (code {rc})"
        )


def _checked(x: torch.Tensor) -> tuple[torch.Tensor, ctypes.CDLL]:
    return (x if x.stride(1) == 1 else x.contiguous()), _checked_library()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
