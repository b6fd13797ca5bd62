"""The CPU runtime's C kernels (model/kernels/*.c): compiled with the system C compiler on first use,
cached per source/flags/compiler, and called through ctypes. Without a compiler the runtime falls back
to its torch code path, which computes the same thing more slowly."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from pipeline.runtime.kernels.build import compile_cached, cpu_flags

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "csrc"


def compile_flags() -> list[str]:
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=gnu11"]
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= cpu_flags():
        flags += ["-mavx2", "-mfma"]
    return flags


def build_shared_library(source: Path) -> Path | None:
    """Compile `source` into the shared kernel cache (once per source, flags and compiler) and return the
    .so; None when no compiler is available or compilation fails (the reason is logged)."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler found: %s not built, using the slower torch path", source.name)
        return None
    try:
        return compile_cached(source.stem, [source], compile_flags(), compiler, salt="")
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("compiling %s failed, using the slower torch path: %s", source.name, exc)
        return None


class PagedAttentionKernel:
    """RoPE + KV-cache write + paged causal attention for one layer (see kernels/paged_attention.c)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.llmpipe_paged_attention
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [
            ptr,
            i64,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            i64,
            ptr,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            i64,
        ]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(
        self,
        qkv: int,
        qkv_stride: int,
        k_cache: int,
        v_cache: int,
        k_scales: int | None,
        v_scales: int | None,
        out: int,
        step_args: tuple,
    ) -> None:
        """Pointers are `tensor.data_ptr()`s; the scales are None for a fp32 cache, the int8 cache's scale
        tensors otherwise. step_args are the C function's remaining arguments (cos_sin, positions, slots,
        block_tables, bt_stride, token_seq, T, H, KV, D, block_size, window, max_context, scale, cache_bf16),
        the same for every layer of a step."""
        status = self._fn(qkv, qkv_stride, k_cache, v_cache, k_scales, v_scales, out, *step_args)
        if status != 0:
            raise RuntimeError(
                f"paged attention kernel failed (status {status}: 1 = unsupported shape, 2 = no memory)"
            )


class AddRMSNormKernel:
    """hidden += delta (optional), then RMSNorm(hidden) * weight into a new tensor (kernels/rms_norm.c)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.llmpipe_add_rms_norm
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
        fn.restype = None
        self._fn = fn

    def __call__(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """All fp32, contiguous, on CPU: hidden/delta [T, H], weight [H]."""
        out = torch.empty_like(hidden)
        tokens, width = hidden.shape
        self._fn(
            hidden.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            tokens,
            width,
            eps,
        )
        return out


@functools.cache
def _library(stem: str) -> ctypes.CDLL | None:
    path = build_shared_library(KERNEL_DIR / f"{stem}.c")
    return None if path is None else ctypes.CDLL(str(path))


def load_paged_attention() -> PagedAttentionKernel | None:
    library = _library("paged_attention")
    return None if library is None else PagedAttentionKernel(library)


def load_add_rms_norm() -> AddRMSNormKernel | None:
    library = _library("rms_norm")
    return None if library is None else AddRMSNormKernel(library)
