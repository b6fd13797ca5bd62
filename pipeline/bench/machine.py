"""What the machine can do, measured before a benchmark so its results read against it: the vector
instruction sets the CPU has, the memory read bandwidth and the matmul rate at the benchmark's thread
count, and from those the fastest single-request decode the memory allows.

Single-request decode reads every weight once per token, so on CPU it is bound by memory bandwidth:
tokens/s <= bandwidth / weight bytes. That bound is the yardstick for how close an engine gets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")
# the flags that decide which kernels run, as /proc/cpuinfo spells them, in the order they arrived
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx_vnni",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
_BANDWIDTH_BYTES = 256 * 1024 * 1024  # far beyond any last-level cache
_GEMM_SIZE = 1024
# the input embedding's name in llmpipe's engine (TensorRT-LLM's naming) and in HF checkpoints
_EMBEDDING_TABLES = ("vocab_embedding.weight", "embed_tokens.weight")


@dataclass(frozen=True)
class MachineFacts:
    isa: tuple[str, ...]  # ISA_FLAGS the CPU has
    threads: int
    read_bandwidth_gb_s: float
    gemm_gflops: dict[str, float]  # dtype name (fp32 | bf16) -> GFLOP/s

    def row(self) -> dict[str, Any]:
        return {
            "isa": list(self.isa),
            "threads": self.threads,
            "read_bandwidth_gb_s": round(self.read_bandwidth_gb_s, 2),
            "gemm_gflops": {k: round(v, 1) for k, v in self.gemm_gflops.items()},
        }


def isa_flags(cpuinfo: str) -> tuple[str, ...]:
    """The ISA_FLAGS present in the first `flags` line of a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            present = set(value.split())
            return tuple(f for f in ISA_FLAGS if f in present)
    return ()


def cpu_isa() -> tuple[str, ...]:
    return isa_flags(CPUINFO.read_text()) if CPUINFO.is_file() else ()


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best_seconds(work: Callable[[], object], repeats: int) -> float:
    work()  # first touch: page faults and lazy initialisation are not the rate
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth_gb_s(num_threads: int, num_bytes: int = _BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Memory read rate: a sum over a buffer far larger than the caches (one read per byte, negligible
    arithmetic), best of `repeats`."""
    import torch

    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    with torch_threads(num_threads):
        seconds = _best_seconds(data.sum, repeats)
    return num_bytes / seconds / 1e9


def gemm_gflops(dtype_name: str, num_threads: int, size: int = _GEMM_SIZE, repeats: int = 5) -> float:
    """torch.matmul rate of two size x size matrices in `dtype_name` (fp32 | bf16), best of `repeats`."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    with torch_threads(num_threads), torch.inference_mode():
        seconds = _best_seconds(lambda: torch.matmul(a, b), repeats)
    return 2 * size**3 / seconds / 1e9


def measure(num_threads: int, dtypes: Sequence[str] = ("fp32", "bf16")) -> MachineFacts:
    return MachineFacts(
        isa=cpu_isa(),
        threads=num_threads,
        read_bandwidth_gb_s=read_bandwidth_gb_s(num_threads),
        gemm_gflops={d: gemm_gflops(d, num_threads) for d in dtypes},
    )


def tensor_bytes(path: Path) -> dict[str, int]:
    """Each tensor's size in a safetensors file, from its header alone."""
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    return {
        name: info["data_offsets"][1] - info["data_offsets"][0]
        for name, info in header.items()
        if name != "__metadata__"
    }


def weight_bytes(engine_dir: Path) -> int:
    """What one decode step reads from an engine's weight files: every tensor but the input embedding
    table when a separate lm_head is stored (a step looks up one row of the table; the lm_head is read
    whole)."""
    sizes: dict[str, int] = {}
    for path in sorted(engine_dir.glob("*.safetensors")):
        sizes.update(tensor_bytes(path))
    if any(name.endswith("lm_head.weight") for name in sizes):
        sizes = {n: b for n, b in sizes.items() if not n.endswith(_EMBEDDING_TABLES)}
    return sum(sizes.values())


def decode_limit_tok_s(num_weight_bytes: int, bandwidth_gb_s: float) -> float:
    """The single-request decode rate at which reading the weights alone takes all the bandwidth."""
    if num_weight_bytes <= 0:
        raise ValueError(f"weight bytes must be > 0, got {num_weight_bytes}")
    return bandwidth_gb_s * 1e9 / num_weight_bytes


def header(facts: MachineFacts, weights: Mapping[str, int], verdicts: Mapping[str, str] | None = None) -> str:
    """The results page's machine block: ISA, bandwidth, GEMM rates, and per precision the weight bytes,
    the bandwidth limit on single-request decode and `verdicts[precision]` (how close llmpipe came)."""
    gemm = ", ".join(f"{d} {v:.0f} GFLOP/s" for d, v in facts.gemm_gflops.items())
    lines = [
        f"CPU ISA: {', '.join(facts.isa) or 'none of ' + ', '.join(ISA_FLAGS)} (from /proc/cpuinfo). "
        f"Measured with {facts.threads} threads: memory read bandwidth {facts.read_bandwidth_gb_s:.1f} GB/s; "
        f"torch matmul {_GEMM_SIZE}x{_GEMM_SIZE}: {gemm}.",
    ]
    if weights:
        lines += [
            "",
            "Bandwidth limit on single-request decode (weight bytes read per token / bandwidth):",
            "",
        ]
        for p, n in weights.items():
            limit = decode_limit_tok_s(n, facts.read_bandwidth_gb_s)
            verdict = f"; {verdicts[p]}" if verdicts and p in verdicts else ""
            lines.append(f"- {p}: {n / 1e6:.0f} MB -> {limit:.1f} tok/s{verdict}")
    return "\n".join(lines)


def limit_measurements(facts: MachineFacts, weights: Mapping[str, int]) -> dict[str, float]:
    """`machine.<precision>.decode_limit_tok_s` keys, for the targets that compare decode against them."""
    return {
        f"machine.{p}.decode_limit_tok_s": decode_limit_tok_s(n, facts.read_bandwidth_gb_s)
        for p, n in weights.items()
    }
