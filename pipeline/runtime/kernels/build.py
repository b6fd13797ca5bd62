"""Compile the kernels on first use into a per-user cache and register them as torch ops (`llmpipe_quant`).

The shared object is keyed by a hash of the sources, the compiler command and the torch version, so an edited
kernel, another compiler or another torch never picks up a stale build. Concurrent first uses (test workers,
several Triton model instances) are safe: each process compiles into its own temporary directory and atomically
renames the result into place; the losers of the race overwrite it with an identical file.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent / "csrc"
SOURCES = tuple(HERE / name for name in ("qgemv.cpp", "decoder.cpp", "greedy_head.cpp", "torch_ops.cpp"))
HEADERS = tuple(HERE / name for name in ("gemm_blocks.h", "decoder.h", "greedy_head.h"))
KERNEL_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=c++20")
# Instruction sets the kernels are built for, picked from this CPU's flags (the flags are part of the cache key,
# so hosts sharing a cache each get their own build). AVX-512 widens the vectors and doubles the registers;
# AVX512_BF16 adds the bf16 dot product that bfloat16 engines' GEMMs use (twice the fp32 FMA's work per op).
_AVX512 = ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
ISA_FLAGS = {
    "avx2": ("-mavx2", "-mfma"),
    "avx512": _AVX512,
    "avx512_bf16": (*_AVX512, "-mavx512bf16"),
}
AVX512_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
BF16_CPU_FLAG = "avx512_bf16"
# A lower ISA than the CPU's on request (tests, comparisons), e.g. "avx2" on an AVX-512 CPU.
ISA_ENV = "LLMPIPE_KERNEL_ISA"
COMPILE_TIMEOUT_S = 600
DISABLE_ENV = "LLMPIPE_DISABLE_KERNELS"
CACHE_ENV = "LLMPIPE_CACHE_DIR"


def cache_dir() -> Path:
    """`$LLMPIPE_CACHE_DIR/kernels`, default `~/.cache/llmpipe/kernels`."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "llmpipe") / "kernels"


def load_library() -> str:
    """Build (once) and register the `torch.ops.llmpipe_quant` ops; returns "" on success, else why not."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"the kernels are built for x86-64 Linux, this is {sys.platform}/{platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the kernels need AVX2 + FMA; torch reports CPU capability {capability!r}"
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler {compiler!r} on PATH (install g++ or set CXX)"
    try:
        isa = kernel_isa()
        path = compile_cached(
            f"llmpipe_quant_{isa}",
            SOURCES,
            [*KERNEL_FLAGS, *ISA_FLAGS[isa], *_torch_flags()],
            compiler,
            torch.__version__,
            headers=HEADERS,
        )
        # NOTE: torch is already loaded, so the library's libgomp.so.1 resolves to torch's copy: kernels and
        # torch ops share one OpenMP thread team instead of two teams spinning on the same cores.
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
        reason = f"building the quantized CPU kernels failed: {exc}"
        logger.warning("%s; using dequantize + matmul instead", reason)
        return reason
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags /proc/cpuinfo lists for this CPU (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def kernel_isa() -> str:
    """The kernels' instruction set: avx512_bf16 where this CPU has AVX-512 F/BW/VL/DQ and AVX512_BF16,
    avx512 with the first four only, else avx2. LLMPIPE_KERNEL_ISA names a lower one to use instead."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced not in ("", *ISA_FLAGS):
        raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {', '.join(ISA_FLAGS)}")
    levels = list(ISA_FLAGS)
    if not cpu_flags() >= AVX512_CPU_FLAGS:
        best = "avx2"
    else:
        best = "avx512_bf16" if BF16_CPU_FLAG in cpu_flags() else "avx512"
    if forced and levels.index(forced) < levels.index(best):
        return forced
    return best


def compile_cached(
    name: str,
    sources: Sequence[Path],
    args: Sequence[str],
    compiler: str,
    salt: str,
    headers: Sequence[Path] = (),
) -> Path:
    """`<cache_dir>/<name>-<hash>.so` built from `sources` with `compiler *args`, compiling only if absent;
    `headers` (included by the sources) are part of the hash."""
    digest = hashlib.sha256()
    for part in [
        *(p.read_bytes() for p in (*sources, *headers)),
        compiler.encode(),
        *(a.encode() for a in args),
        salt.encode(),
    ]:
        digest.update(hashlib.sha256(part).digest())
    target = cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        out = Path(tmp) / target.name
        # Sources first: the linker resolves libraries left to right.
        command = [compiler, *(str(p) for p in sources), *args, "-o", str(out)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            errors = [
                line for line in proc.stderr.splitlines() if "error" in line
            ] or proc.stderr.splitlines()
            raise OSError(f"{compiler} exited with {proc.returncode}: {' | '.join(errors[:3])}")
        os.replace(out, target)
    return target


def _torch_flags() -> list[str]:
    root = Path(torch.__file__).parent
    lib = root / "lib"
    return [
        f"-I{root / 'include'}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-L{lib}",
        f"-Wl,-rpath,{lib}",
        "-ltorch_cpu",
        "-lc10",
    ]
