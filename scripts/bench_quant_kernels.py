"""Time the quantized CPU kernels against torch on SmolLM2-135M's linear shapes.

    .venv/bin/python scripts/bench_quant_kernels.py                  # 2 threads, rows 1 16 128, cold weights
    .venv/bin/python scripts/bench_quant_kernels.py --rows 1 2 4 8 16 32 64 128 --shapes down lm_head
    .venv/bin/python scripts/bench_quant_kernels.py --hot            # weights resident in cache

Each method gets its own copies of the weight, cycled so that together they exceed the last-level cache: a
decode step streams every layer's weights from DRAM, and timing one copy in a loop would measure L3 instead
(`--hot` does that). Methods are interleaved within each repeat so that noise from other processes lands on all
of them. Every call is timed on its own; the table shows the median (or, with `--stat min`, the fastest) call
in milliseconds: on a shared machine the minimum estimates a quiet one. "deq+mm" is QuantLinear's many-row path
(compiled dequantize to fp32, then torch matmul); ratios are torch fp32 time / method time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from pipeline.util.openmp import default_wait_policy  # noqa: E402

default_wait_policy(os.environ)  # before torch loads
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pipeline.runtime.kernels import ops as kernels  # noqa: E402
from pipeline.runtime.kernels.build import kernel_isa  # noqa: E402
from pipeline.runtime.quant import primitives  # noqa: E402

# (name, out_features, in_features) of SmolLM2-135M: hidden 576, 9 heads + 2 x 3 KV heads of 64, MLP 1536.
SHAPES = {
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
COLD_BYTES = 64 << 20  # 2x this machine's 32 MiB L3
SLOW_CALL_S = 0.5  # methods slower than this per call get a single repeat
INT8PACK_MAX_ROWS = 16  # torch's int8pack kernel takes seconds per call beyond this on AVX2-class CPUs


def build_methods(out_f: int, in_f: int, rows: int, hot: bool) -> dict[str, tuple[Callable, list]]:
    """name -> (fn(weights) -> y, list of weight copies)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_f, in_f, generator=gen) * 0.02
    x = torch.randn(rows, in_f, generator=gen)
    q8, s8 = primitives.quantize_int8_per_channel(w)
    g64 = primitives.quantize_int4_groupwise(w, 64)
    g128 = primitives.quantize_int4_groupwise(w, 128)

    def copies(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        size = sum(t.numel() * t.element_size() for t in tensors)
        count = 1 if hot else max(1, -(-COLD_BYTES // size))
        return [tuple(t.clone() for t in tensors) for _ in range(count)]

    methods: dict[str, tuple[Callable, list]] = {
        "fp32 torch": (lambda c: F.linear(x, c[0]), copies(w)),
        "fp32 kern": (lambda c: kernels.gemm_f32(x, c[0]), copies(w)),
        "int8 kern": (lambda c: kernels.gemm_int8(x, c[0], c[1]), copies(q8, s8)),
        "int8 deq+mm": (lambda c: F.linear(x, kernels.dequantize_int8(c[0], c[1])), copies(q8, s8)),
        "int4g64 kern": (lambda c: kernels.gemm_int4(x, c[0], c[1], c[2], 64), copies(*g64)),
        "int4g128 kern": (lambda c: kernels.gemm_int4(x, c[0], c[1], c[2], 128), copies(*g128)),
        "int4g64 deq+mm": (
            lambda c: F.linear(x, kernels.dequantize_int4(c[0], c[1], c[2], 64)),
            copies(*g64),
        ),
    }
    if rows <= INT8PACK_MAX_ROWS:  # one copy: it is far from bandwidth-bound
        methods["torch int8pack"] = (lambda c: torch.ops.aten._weight_int8pack_mm(x, c[0], c[1]), [(q8, s8)])
    return methods


def time_methods(
    methods: dict[str, tuple[Callable, list]], repeats: int, stat: Callable[[list[float]], float]
) -> dict[str, float]:
    """Milliseconds per call: `stat` over every timed call (each call is timed on its own)."""
    samples: dict[str, list[float]] = {name: [] for name in methods}
    slow: set[str] = set()
    for name, (fn, weights) in methods.items():  # warm-up; finds the very slow ones
        start = time.perf_counter()
        fn(weights[0])
        if time.perf_counter() - start > SLOW_CALL_S:
            slow.add(name)
    for rep in range(repeats):
        for name, (fn, weights) in methods.items():
            if name in slow and rep > 0:
                continue
            for c in weights[:1] if name in slow else weights:
                start = time.perf_counter()
                fn(c)
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: stat(v) for name, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128], help="activation rows M")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--hot", action="store_true", help="one weight copy per method (cache-resident)")
    parser.add_argument("--stat", choices=["median", "min"], default="median", help="over the repeats")
    args = parser.parse_args()
    stat = statistics.median if args.stat == "median" else min

    torch.set_num_threads(args.threads)
    if not kernels.kernels_available():
        raise SystemExit(f"kernels unavailable: {kernels.kernels_unavailable_reason()}")
    print(f"torch {torch.__version__}, kernels {kernel_isa()}, {args.threads} threads, "
          f"{'hot' if args.hot else 'cold'} weights, {args.stat} of {args.repeats}, ms per call")  # fmt: skip
    header: list[str] = []
    for shape in args.shapes:
        out_f, in_f = SHAPES[shape]
        for rows in args.rows:
            ms = time_methods(build_methods(out_f, in_f, rows, args.hot), args.repeats, stat)
            if not header:
                header = [*ms] if "torch int8pack" in ms else [*ms, "torch int8pack"]
                cols = ["shape (out x in)", "M", *header, "int8 x", "int4g64 x", "int4g128 x"]
                print("| " + " | ".join(cols) + " |")
                print("|" + "---|" * len(cols))
            base = ms["fp32 torch"]
            ratios = [base / ms[k] for k in ("int8 kern", "int4g64 kern", "int4g128 kern")]
            timings = [f"{ms[k]:.3f}" if k in ms else "-" for k in header]
            cells = [f"{shape} {out_f}x{in_f}", str(rows), *timings]
            print("| " + " | ".join(cells + [f"{r:.2f}" for r in ratios]) + " |", flush=True)


if __name__ == "__main__":
    main()
