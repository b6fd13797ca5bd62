"""Where a decode step of the torch engine spends its time, and A/B ratios of kernel builds, on this CPU.

    .venv/bin/python scripts/bench_kernels.py limits
    .venv/bin/python scripts/bench_kernels.py breakdown --engine-dir build/smollm2-135m-bf16/engine
    .venv/bin/python scripts/bench_kernels.py ab --engine-dir build/smollm2-135m-bf16/engine \\
        --variant avx512_bf16 --variant avx512 --rows 1 4 16

`limits`: this machine's DRAM read bandwidth and torch's fp32 / bf16 matmul rates (the ceilings the parts are
measured against). `breakdown`: an in-process engine decodes --concurrency requests and every decode step is
split into the fused decoder-layer kernel (all layers' GEMMs, norms, MLP), paged attention, the greedy lm_head
and the rest (Python: scheduler, metadata, embedding), in wall-clock ms per step (and the step's CPU ms, all
threads), with the decoder kernel's achieved GB/s (weights read) and GFLOP/s. To time the two apart it runs
a step as one kernel call per layer and one attention call per layer, as the engine does for models with q/k
norms; the engine runs other models' steps in one call, so their steps take less than the sum shown here.
`ab`: the fused decoder kernel alone over all layers, and the greedy lm_head, at each row count, one subprocess
per variant and round, the variants interleaved so that load from other processes lands on all of them; a
variant is an instruction set (LLMPIPE_KERNEL_ISA) or the path of a kernel library built earlier (e.g. a copy
of the cached .so from before a change). Prints the fastest call of every variant (on a shared machine, the
estimate of a quiet one) and its ratio to the first.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.util.openmp import default_wait_policy  # noqa: E402

default_wait_policy(os.environ)  # before torch loads
import torch  # noqa: E402

LIBRARY_ENV = "BENCH_KERNELS_LIBRARY"  # a prebuilt library to load: set by `ab`, or by hand for `breakdown`


def _min_ms(fn: Any, repeats: int, clock: Any = time.perf_counter) -> float:
    """The fastest of `repeats` timed calls: on a shared machine, the estimate of a quiet one."""
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best * 1e3


def limits(threads: int) -> dict[str, float]:
    """Read bandwidth (GB/s: sum of a 512 MiB fp32 tensor, far beyond the caches) and matmul GFLOP/s (16 rows
    x SmolLM2's gate_up 576 -> 3072, hot, the shape of a 16-row decode step; and 1024^3)."""
    torch.set_num_threads(threads)
    big = torch.ones(128 << 20)
    big.sum()
    read_ms = _min_ms(big.sum, 15)
    out: dict[str, float] = {"read_GB_s": big.nbytes / read_ms / 1e6}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for m, k, n in ((16, 576, 3072), (1024, 1024, 1024)):
            a, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
            torch.nn.functional.linear(a, b)
            ms = _min_ms(lambda a=a, b=b: torch.nn.functional.linear(a, b), 60)
            out[f"{name}_mm_{m}x{k}x{n}_GFLOP_s"] = 2 * m * k * n / ms / 1e6
    return {k: round(v, 1) for k, v in out.items()}


def _runner(engine_dir: Path, threads: int) -> Any:
    from pipeline.runtime.engine.engine_args import RunnerArgs
    from pipeline.runtime.worker.model_runner import ModelRunner

    return ModelRunner.from_engine_dir(engine_dir, RunnerArgs(device="cpu", num_threads=threads))


def _weight_bytes(runner: Any) -> int:
    """Bytes the fused decoder reads per step: every layer's linear weights."""
    layers = runner.model.weights.layers
    return sum(
        lin.weight_bytes for layer in layers for lin in (layer.qkv, layer.dense, layer.gate_up, layer.proj)
    )


def _flops_per_row(runner: Any) -> int:
    """Multiply-adds x 2 of one token row through every layer's linears (a dense model's)."""
    m = runner.config.model
    qkv = (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
    per_layer = m.hidden_size * (qkv + m.num_attention_heads * m.head_dim + 3 * m.intermediate_size)
    return 2 * per_layer * m.num_hidden_layers


class _Timed:
    """Wraps a callable (or an object with `run`) and sums the seconds spent in it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, 0.0

    def _call(self, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def __call__(self, *args: Any) -> Any:
        return self._call(self.inner, *args)

    def run(self, *args: Any) -> Any:
        return self._call(self.inner.run, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _use_library_from_env() -> None:
    """Load the kernel library named by BENCH_KERNELS_LIBRARY, if set, instead of building this checkout's."""
    library = os.environ.get(LIBRARY_ENV)
    if library:
        from pipeline.runtime.kernels import ops

        torch.ops.load_library(library)
        loaded = ({n: getattr(torch.ops.llmpipe_quant, n).default for n in ops._OP_NAMES}, "")
        ops._load = lambda: loaded  # type: ignore[assignment]


def breakdown(engine_dir: Path, threads: int, concurrency: int, new_tokens: int, prompt_len: int) -> dict:
    from pipeline.bench.decode import random_prompts
    from pipeline.runtime.core.sampling_params import SamplingParams
    from pipeline.runtime.core.scheduler import SchedulerConfig
    from pipeline.runtime.engine.llm_engine import LLMEngine

    _use_library_from_env()
    runner = _runner(engine_dir, threads)
    build = runner.config.build
    engine = LLMEngine(
        runner,
        SchedulerConfig(
            max_batch_size=max(build.max_batch_size, concurrency),
            max_num_tokens=build.max_num_tokens,
            max_input_len=build.max_input_len,
            max_seq_len=build.max_seq_len,
            enable_chunked_context=runner.config.runtime.enable_chunked_context,
        ),
    )
    model = runner.model
    if model.fused is None:
        raise SystemExit("this engine runs no fused decoder kernel here")
    prompts = random_prompts(concurrency + 1, prompt_len, runner.config.model.vocab_size)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)

    def decode(batch: list[list[int]], tag: str) -> dict[str, float]:
        plan = model.fused._plan = _Timed(model.fused._plan)
        attention = model.attention = _Timed(model.attention)
        head = model.greedy_head = _Timed(model.greedy_head) if model.greedy_head else None
        requests = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(batch)]
        steps, step_s, step_cpu_s = 0, 0.0, 0.0
        parts = {"decoder": 0.0, "attention": 0.0, "head": 0.0}
        while engine.has_unfinished():
            decoding = all(r.num_output_tokens >= 1 for r in requests)
            before = (plan.seconds, attention.seconds, head.seconds if head else 0.0)
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.step()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            if decoding and all(not r.status.finished for r in requests):
                steps += 1
                step_s += elapsed
                step_cpu_s += cpu
                after = (plan.seconds, attention.seconds, head.seconds if head else 0.0)
                for key, b, a in zip(parts, before, after, strict=True):
                    parts[key] += a - b
        model.fused._plan, model.attention = plan.inner, attention.inner
        if head:
            model.greedy_head = head.inner
        ms = {k: v / steps * 1e3 for k, v in parts.items()}
        ms["step"] = step_s / steps * 1e3
        ms["step_cpu"] = step_cpu_s / steps * 1e3  # all threads' CPU time: what other load changes least
        ms["other"] = ms["step"] - ms["decoder"] - ms["attention"] - ms["head"]
        rows = len(batch)
        return {
            "rows": rows,
            "steps": steps,
            "tok_s": round(rows / ms["step"] * 1e3, 1),
            **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
            "decoder_GB_s": round(_weight_bytes(runner) / ms["decoder"] / 1e6, 1),
            "decoder_GFLOP_s": round(rows * _flops_per_row(runner) / ms["decoder"] / 1e6, 1),
        }

    decode(prompts[:1], "warmup")
    return {
        "engine_dir": str(engine_dir),
        "weights_MB": round(_weight_bytes(runner) / 1e6, 1),
        "single": decode(prompts[:1], "single"),
        f"concurrent_{concurrency}": decode(prompts[1:], "batch"),
    }


def plan_ms(engine_dir: Path, threads: int, rows: list[int], repeats: int, hot: bool) -> dict[str, float]:
    """Fastest ms of the fused decoder kernel over all layers (random activations, attention skipped) and of
    the greedy lm_head per row count; the weights come from the engine, read from DRAM as in a decode step
    (`hot`: layer 0's for every layer, read from cache)."""
    _use_library_from_env()
    runner = _runner(engine_dir, threads)
    model = runner.model
    fused = model.fused
    if fused is None:
        raise SystemExit("this engine runs no fused decoder kernel here")
    m = runner.config.model
    plan = fused._plan
    if hot:  # every layer's entry is layer 0's: its weights stay in cache
        from pipeline.runtime.model.fused_decoder import FusedDecoder

        first = model.weights.layers[0]
        entry = FusedDecoder.layer_args(
            [first.dense, first.gate_up, first.proj, first.qkv],
            [first.attention_output_norm, first.post_norm, first.mlp_output_norm, first.input_norm],
        )
        head = FusedDecoder.layer_args([None, None, None, first.qkv], [None, None, None, first.input_norm])
        plan = FusedDecoder.plan([head] + [entry] * fused._num_layers, m.norm_epsilon, m.hidden_act)
    width = m.num_attention_heads * m.head_dim
    out = {}
    for count in rows:
        gen = torch.Generator().manual_seed(count)
        hidden0 = torch.randn(count, m.hidden_size, generator=gen)
        attn = torch.randn(count, width, generator=gen)

        def step(hidden0: torch.Tensor = hidden0, attn: torch.Tensor = attn) -> torch.Tensor:
            hidden = hidden0.clone()
            plan.run(0, hidden, None)
            for i in range(fused._num_layers):
                plan.run(i + 1, hidden, attn)
            return hidden

        # The greedy lm_head on the final-normed rows the step leaves, where the engine has one.
        normed = model.norm(step(), None, model.weights.final_norm)
        parts: dict[str, Callable[[], object]] = {"decoder": step}
        if model.greedy_head is not None:
            parts["head"] = functools.partial(model.greedy_head, normed)
        for name, fn in parts.items():
            fn()
            out[f"M={count} {name} wall"] = round(_min_ms(fn, repeats), 3)
            # CPU time of the process (all threads): what other processes on the machine change least
            out[f"M={count} {name} cpu"] = round(_min_ms(fn, repeats, time.process_time), 3)
    return out


def ab(args: argparse.Namespace) -> None:
    variants: list[str] = args.variant
    samples: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            env = dict(os.environ)
            if Path(variant).is_file():
                env[LIBRARY_ENV] = str(Path(variant).resolve())
            else:
                env["LLMPIPE_KERNEL_ISA"] = variant
            command = [sys.executable, __file__, "_plan", "--engine-dir", str(args.engine_dir)]
            command += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
            command += ["--hot", "--rows"] if args.hot else ["--rows"]
            command += [str(r) for r in args.rows]
            proc = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            for key, ms in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                samples[variant].setdefault(key, []).append(ms)
    base = variants[0]
    print(
        f"{args.engine_dir}, {args.threads} threads, fastest of {args.rounds} rounds x {args.repeats} steps"
    )
    print(
        "wall: wall-clock ms per call; cpu: CPU ms of all threads together; x: the first variant's ms / this"
    )
    keys = list(samples[base])
    print("| variant | " + " | ".join(f"{k} ms | x" for k in keys) + " |")
    print("|---|" + "---|---|" * len(keys))
    for variant in variants:
        cells = []
        for key in keys:
            ms = min(samples[variant][key])
            cells += [f"{ms:.2f}", f"{min(samples[base][key]) / ms:.2f}"]
        print(f"| {Path(variant).name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["limits", "breakdown", "ab", "_plan"])
    parser.add_argument("--engine-dir", type=Path, default=Path("build/smollm2-135m/engine"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--variant", action="append", default=[], help="ISA name or kernel library path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--hot", action="store_true", help="ab: layer 0's weights for every layer (cache, not DRAM)"
    )
    args = parser.parse_args()
    if args.what == "limits":
        print(json.dumps(limits(args.threads)))
    elif args.what == "breakdown":
        print(
            json.dumps(
                breakdown(args.engine_dir, args.threads, args.concurrency, args.new_tokens, args.prompt_len)
            )
        )
    elif args.what == "_plan":
        print(json.dumps(plan_ms(args.engine_dir, args.threads, args.rows, args.repeats, args.hot)))
    else:
        ab(args)


if __name__ == "__main__":
    main()
