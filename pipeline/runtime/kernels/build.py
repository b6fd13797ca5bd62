"""Compile the kernels in csrc/ into one per-user cached library that registers the `torch.ops.llmpipe_quant` ops.

The torch backend's engine stage builds the library for its machine (a missing compiler fails that stage unless
LLMPIPE_DISABLE_KERNELS=1 chooses the pure-PyTorch path); the runtime loads it, building it first where an
engine directory moved to a machine without it. The shared object is keyed by a hash of the sources, the
compiler's identity (`<cc> --version`), its arguments and the torch version, so an edited kernel, an upgraded
compiler or another torch never picks up a stale build. Concurrent first uses (test workers, several Triton model
instances) are safe: each process compiles into its own temporary directory and atomically renames the result
into place; the losers of the race overwrite it with an identical file.
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
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.util.files import sha256_file

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(HERE.glob("*.cpp")))
HEADERS = tuple(sorted(HERE.glob("*.h")))
KERNEL_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=c++20")
# Instruction sets the kernels are built for, picked from this CPU's flags (the flags are part of the cache key,
# so hosts sharing a cache each get their own build). AVX-512 widens the vectors and doubles the registers;
# AVX512_BF16 adds the bf16 dot product that bfloat16 engines' GEMMs use (twice the fp32 FMA's work per op), and
# every CPU with it (Cooper Lake, Sapphire Rapids, Zen 4 on) has AVX512_VNNI, whose int16 dot the int8 GEMMs use.
_AVX512 = ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
# AMX (Sapphire Rapids on) adds tile multiply-adds of bf16 and int8 blocks, which steps of several rows use for
# bf16 and int8 weights (amx_tiles.h).
ISA_FLAGS = {
    "avx2": ("-mavx2", "-mfma"),
    "avx512": _AVX512,
    "avx512_bf16": (*_AVX512, "-mavx512bf16", "-mavx512vnni"),
    "amx": (*_AVX512, "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}
AVX512_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
BF16_CPU_FLAG = "avx512_bf16"
VNNI_CPU_FLAG = "avx512_vnni"
AMX_CPU_FLAGS = frozenset({"amx_tile", "amx_bf16", "amx_int8"})
# A lower ISA than the CPU's on request (tests, comparisons), e.g. "avx2" on an AVX-512 CPU.
ISA_ENV = "LLMPIPE_KERNEL_ISA"
COMPILE_TIMEOUT_S = 600
# "1": run the pure-PyTorch path and build no kernels; the only way to get that path without an error.
DISABLE_ENV = "LLMPIPE_DISABLE_KERNELS"
CACHE_ENV = "LLMPIPE_CACHE_DIR"


class KernelsUnavailable(Exception):
    """Why the kernel library cannot be built or loaded here; `chosen` when the user turned the kernels off."""

    def __init__(self, reason: str, chosen: bool = False) -> None:
        super().__init__(reason)
        self.chosen = chosen


@dataclass(frozen=True)
class KernelLibrary:
    """The library this machine builds: its instruction set, compiler and cache path."""

    isa: str
    compiler: str  # first line of `<cc> --version`
    path: Path

    def facts(self) -> dict[str, str]:
        """The engine manifest's record of the build (its hash names the exact binary the engine was built with)."""
        return {
            "isa": self.isa,
            "compiler": self.compiler,
            "library_sha256": sha256_file(self.path),
        }


def cache_dir() -> Path:
    """`$LLMPIPE_CACHE_DIR/kernels`, default `~/.cache/llmpipe/kernels`."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "llmpipe") / "kernels"


def kernels_disabled() -> bool:
    """Whether LLMPIPE_DISABLE_KERNELS=1 chose the pure-PyTorch path ("" or "0": it did not)."""
    value = os.environ.get(DISABLE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise KernelsUnavailable(f"{DISABLE_ENV}={value!r}: expected 1 (use the pure-PyTorch path) or 0")
    return value == "1"


def plan_library() -> KernelLibrary:
    """The library this machine loads, built or not; raises KernelsUnavailable where there can be none."""
    if kernels_disabled():
        raise KernelsUnavailable(f"disabled by {DISABLE_ENV}=1", chosen=True)
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise KernelsUnavailable(
            f"the kernels are built for x86-64 Linux, this is {sys.platform}/{platform.machine()}"
        )
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise KernelsUnavailable(f"the kernels need AVX2 + FMA; torch reports CPU capability {capability!r}")
    compiler = compiler_command()
    if shutil.which(compiler) is None:
        raise KernelsUnavailable(f"no C++ compiler {compiler!r} on PATH (install g++ or set CXX)")
    try:
        isa = kernel_isa()
    except ValueError as exc:
        raise KernelsUnavailable(str(exc)) from None
    try:
        identity = compiler_identity(compiler)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelsUnavailable(f"the C++ compiler {compiler!r} does not run: {exc}") from None
    args = _library_args(isa)
    path = cache_path(
        f"llmpipe_quant_{isa}", (*SOURCES, *HEADERS), args, compiler, identity, torch.__version__
    )
    return KernelLibrary(isa, identity, path)


def build_library() -> KernelLibrary:
    """`plan_library()`'s library, compiled unless cached; raises KernelsUnavailable saying why it cannot be."""
    library = plan_library()
    try:
        compile_cached(compiler_command(), SOURCES, _library_args(library.isa), library.path)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelsUnavailable(f"building the CPU kernels failed: {exc}") from None
    return library


def load_library() -> tuple[KernelLibrary | None, str]:
    """Build (unless cached) and register the `torch.ops.llmpipe_quant` ops: (the library, "") or (None, why
    not). Only the user's own choice of the torch path goes unlogged: any other reason is an ERROR, since every
    model then runs several times slower."""
    try:
        library = build_library()
        # NOTE: torch is already loaded, so the library's libgomp.so.1 resolves to torch's copy: kernels and
        # torch ops share one OpenMP thread team instead of two teams spinning on the same cores.
        torch.ops.load_library(str(library.path))
    except KernelsUnavailable as exc:
        if not exc.chosen:
            logger.error("CPU kernels unavailable, running the slower pure-PyTorch path: %s", exc)
        return None, str(exc)
    except (OSError, RuntimeError) as exc:
        logger.error("loading the CPU kernels failed, running the slower pure-PyTorch path: %s", exc)
        return None, f"loading the CPU kernels failed: {exc}"
    return library, ""


@functools.cache
def _cpuinfo_field(name: str) -> str | None:
    """The value of the first `name` line of /proc/cpuinfo (None where it cannot be read or has none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags /proc/cpuinfo lists for this CPU (empty where it cannot be read)."""
    return frozenset((_cpuinfo_field("flags") or "").split())


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it ("unknown" where it cannot be read)."""
    return _cpuinfo_field("model name") or "unknown"


def kernel_isa() -> str:
    """The kernels' instruction set: amx where this CPU has AVX-512 F/BW/VL/DQ, AVX512_BF16, AVX512_VNNI and AMX
    (tiles, bf16 and int8), avx512_bf16 without AMX, avx512 with the first four, else avx2. LLMPIPE_KERNEL_ISA
    names a lower one to use instead."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced not in ("", *ISA_FLAGS):
        raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {', '.join(ISA_FLAGS)}")
    levels = list(ISA_FLAGS)
    if not cpu_flags() >= AVX512_CPU_FLAGS:
        best = "avx2"
    else:
        best = "avx512_bf16" if {BF16_CPU_FLAG, VNNI_CPU_FLAG} <= cpu_flags() else "avx512"
        if best == "avx512_bf16" and cpu_flags() >= AMX_CPU_FLAGS:
            best = "amx"
    if forced and levels.index(forced) < levels.index(best):
        return forced
    return best


@functools.cache
def has_wide_vectors() -> bool:
    """Whether the kernels built for this CPU have their 512-bit form (AVX-512 builds); False where
    LLMPIPE_KERNEL_ISA is invalid (no kernels load then). Read once: every fp32 linear call asks."""
    try:
        return kernel_isa() != "avx2"
    except ValueError:
        return False


def compiler_command() -> str:
    """The C++ compiler: $CXX, default g++."""
    return os.environ.get("CXX", "g++")


def compiler_identity(compiler: str) -> str:
    """The first line of `<compiler> --version` (e.g. "g++ (Debian 12.2.0-14) 12.2.0"): the command's name alone
    stays the same across a compiler upgrade, whose code generation may not."""
    proc = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise OSError(f"`{compiler} --version` exited with {proc.returncode}: {proc.stderr.strip()[:200]}")
    return lines[0].strip()


def cache_path(
    name: str, inputs: Sequence[Path], args: Sequence[str], compiler: str, identity: str, salt: str
) -> Path:
    """`<cache_dir>/<name>-<hash>.so`, the hash over the input files' contents, the compiler command, its
    identity, its arguments and `salt`."""
    digest = hashlib.sha256()
    for part in [
        *(p.read_bytes() for p in inputs),
        compiler.encode(),
        identity.encode(),
        *(a.encode() for a in args),
        salt.encode(),
    ]:
        digest.update(hashlib.sha256(part).digest())
    return cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"


def compile_cached(compiler: str, sources: Sequence[Path], args: Sequence[str], target: Path) -> Path:
    """`target` (a `cache_path`), compiled from `sources` with `compiler *args` unless it exists."""
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


def _library_args(isa: str) -> list[str]:
    return [*KERNEL_FLAGS, *ISA_FLAGS[isa], *_torch_flags()]


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
