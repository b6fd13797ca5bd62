"""Compile qgemv.cpp on first use into a per-user cache and load it with ctypes.

The shared object is keyed by a hash of the source, the flags and the compiler name, so an edited kernel or a
different compiler never picks up a stale build. Concurrent first uses (several test workers, Triton instances)
are safe: each process compiles into its own temporary directory and atomically renames the result into place.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# NOTE: torch must be loaded before the kernel library: the library's libgomp.so.1 then resolves to the copy
# torch already mapped, so kernels and torch ops share one OpenMP thread team on two cores.
import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qgemv.cpp")
ABI_VERSION = 1
# AVX2 + FMA only: the project's machines have no AVX-512, and a cache directory may be shared across hosts.
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-exceptions")
COMPILE_TIMEOUT_S = 300
DISABLE_ENV = "LLMPIPE_DISABLE_KERNELS"
CACHE_ENV = "LLMPIPE_CACHE_DIR"


def cache_dir() -> Path:
    """`$LLMPIPE_CACHE_DIR/kernels`, default `~/.cache/llmpipe/kernels`."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "llmpipe") / "kernels"


def load_library() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") when the kernels can run here, else (None, why not)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None, f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the kernels are built for x86-64 Linux, this is {sys.platform}/{platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return None, f"the kernels need AVX2 + FMA; torch reports CPU capability {capability!r}"
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        return None, f"no C++ compiler {compiler!r} on PATH (install g++ or set CXX)"
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        reason = f"building {SOURCE.name} failed: {exc}"
        logger.warning("quantized CPU kernels unavailable, using dequantize + matmul: %s", reason)
        return None, reason
    if lib.llmp_abi_version() != ABI_VERSION:
        return None, f"{path} reports ABI {lib.llmp_abi_version()}, expected {ABI_VERSION}"
    return lib, ""


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), compiler.encode()])).hexdigest()[:16]
    target = cache_dir() / f"qgemv-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(out)],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if proc.returncode != 0:
            tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
            raise OSError(f"{compiler} exited with {proc.returncode}: {tail}")
        os.replace(out, target)
    return target
