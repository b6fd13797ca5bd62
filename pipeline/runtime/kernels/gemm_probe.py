"""Whether torch's fp32 GEMM (oneDNN) outruns the fp32 kernel on prefill-sized steps, on this machine.

Measured, not assumed. With 2 threads, the kernel ran steps of 64-2048 rows at 1.1-3.7x torch's rate on a Zen 5,
while on a Sapphire Rapids Xeon torch ran 256-512 rows at 1.5-2.6x the kernel's (oneDNN blocks the activations
for the caches; the kernel streams every weight block past all the rows). The first process on a machine times
both on one prefill-sized product and writes the answer beside the kernels it built. Later processes read it, so
every process on the machine (a served engine and its in-process reference, say) prefills the same way.

LLMPIPE_FP32_GEMM=kernel keeps every fp32 step on the kernel (a sequence's logits then stay the same bits whatever
shares its step), =torch sends the many-row ones to torch without measuring; unset or `auto`, the probe decides.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.errors import ConfigError
from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.kernels.build import cache_dir, cpu_model, kernel_isa

# One product of a prefill chunk's size. On the Xeon above the kernel took 1.7-2.1x torch's time on it and on
# SmolLM2's MLP shapes; a 1024-wide input (activations that fit its caches) measured as close as 1.27x once.
PROBE_ROWS, PROBE_IN, PROBE_OUT = 256, 2048, 1024
PROBE_ROUNDS = 7
# torch takes the many-row steps only when it is clearly faster: near a tie, a noisy probe must not flip how
# one machine prefills from one process to the next.
MARGIN = 1.25
CHOICE_ENV = "LLMPIPE_FP32_GEMM"
CHOICES = ("auto", "kernel", "torch")


def record_path() -> Path:
    """Where this machine's answer is kept: per kernel build, CPU model and thread count."""
    key = f"{kernel_isa()}-{cpu_model()}-{torch.get_num_threads()}t"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
    return cache_dir() / f"fp32-gemm-probe-{safe}.json"


@functools.cache
def torch_outruns_fp32_kernel() -> bool:
    """True where torch's fp32 GEMM ran PROBE_ROWS rows more than MARGIN times faster than the kernel, or where
    LLMPIPE_FP32_GEMM=torch says so. Call it only where the kernels are available."""
    choice = os.environ.get(CHOICE_ENV, "").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ConfigError(
            f"{CHOICE_ENV}={choice!r} is invalid",
            hint="kernel (every fp32 step on the kernel), torch (steps of many rows on torch's GEMM) or auto",
        )
    if choice != "auto":
        return choice == "torch"
    path = record_path()
    try:
        return bool(json.loads(path.read_text())["torch_outruns_kernel"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    kernel_s, torch_s = _fastest_of_both()
    outruns = kernel_s > MARGIN * torch_s
    record = {
        "torch_outruns_kernel": outruns,
        "rows": PROBE_ROWS,
        "shape": [PROBE_OUT, PROBE_IN],
        "kernel_ms": round(kernel_s * 1e3, 3),
        "torch_ms": round(torch_s * 1e3, 3),
        "threads": torch.get_num_threads(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    partial.replace(path)  # atomic: a process reading it sees a whole record or none
    return outruns


def _fastest_of_both() -> tuple[float, float]:
    """The fastest of PROBE_ROUNDS calls of the kernel and of torch, interleaved (seconds)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, PROBE_IN, generator=generator)
    w = torch.randn(PROBE_OUT, PROBE_IN, generator=generator)
    calls: list[Callable[[], torch.Tensor]] = [lambda: kernels.gemm_f32(x, w, None), lambda: F.linear(x, w)]
    best = [float("inf"), float("inf")]
    for call in calls:
        call()  # warm: the first call pays for allocations and oneDNN's kernel selection
    for _ in range(PROBE_ROUNDS):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]
