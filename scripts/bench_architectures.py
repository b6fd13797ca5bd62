"""Decode speed per architecture: every family the torch runtime runs, at one shared shape, beside Llama.

For each tiny architecture (pipeline/sources/tiny.py) a random fp32 checkpoint at a benchmark size (hidden
256, 4 layers, MLP 512; MoE: 4 experts, 2 active, active parameters = dense; pipeline/bench/architectures.py)
is converted and built into a torch engine, and measured in-process, one engine per family: single-request
decode tok/s and the output tok/s of 16 concurrent requests, greedy, random prompts, a fixed number of new
tokens (no end id; pipeline/bench/decode.py), each also as a ratio to Llama's in the same run. The families
are measured in interleaved rounds and each keeps its best, so drifting background load hits all of them
alike. --real adds SmolLM2-135M and, when its build config and source are present, Gemma 3 270M.

    python scripts/bench_architectures.py --out benchmarks/results
    python scripts/bench_architectures.py --archs llama,gemma3,qwen3-moe --rounds 1   # a quick look
    python scripts/bench_architectures.py --real --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# this checkout's pipeline, not an installed llmpipe
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.util.openmp import default_wait_policy  # noqa: E402

default_wait_policy(os.environ)  # before torch loads

from pipeline.bench import report  # noqa: E402
from pipeline.errors import PipelineError, run_script  # noqa: E402
from pipeline.sources.tiny import ARCHITECTURES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BASELINE = "llama"
# label -> (build config, parameters) of a released model measured with --real
REAL_MODELS: dict[str, tuple[str, str]] = {
    "SmolLM2-135M": ("build_configs/smollm2-135m.yaml", "135M"),
    "Gemma 3 270M": ("build_configs/gemma3-270m.yaml", "270M"),
}
COLUMNS: tuple[tuple[str, str], ...] = (
    ("model", "model"),
    ("architecture", "HF architecture"),
    ("params", "params (active)"),
    ("fused", "fused decode"),
    ("single_tok_s", "1 request: decode tok/s"),
    ("single_cpu_tok_s", "per CPU-s"),
    ("single_ratio", "x llama"),
    ("concurrent_tok_s", "16 concurrent: output tok/s"),
    ("concurrent_cpu_tok_s", "per CPU-s"),
    ("concurrent_ratio", "x llama"),
    ("load", "load avg"),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--archs",
        default=",".join(ARCHITECTURES),
        help=f"comma-separated tiny architectures (default: all; {BASELINE} is always measured)",
    )
    parser.add_argument("--real", action="store_true", help="also SmolLM2-135M and Gemma 3 270M")
    parser.add_argument("--new-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved measurements; each keeps its best")
    parser.add_argument(
        "--single-repeats", type=int, default=3, help="single-request runs per round (each is short)"
    )
    parser.add_argument("--real-rounds", type=int, default=2, help="rounds of the released models (--real)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="checkpoints and engines (default: a temporary folder)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="also write <out>/<date>-<machine>-architectures.md"
    )
    args = parser.parse_args(argv)
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    unknown = [a for a in archs if a not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown architecture(s) {', '.join(unknown)}; choose from: {', '.join(ARCHITECTURES)}")
    args.archs = [BASELINE, *(a for a in archs if a != BASELINE)]
    for name in ("new_tokens", "prompt_len", "concurrency", "rounds", "single_repeats", "real_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


@dataclass
class Subject:
    """One engine under measurement and its best numbers so far."""

    model: str
    architecture: str
    params: str
    engine: Any  # LLMEngine
    tiny: bool
    best: dict[str, Any] = field(default_factory=dict)

    @property
    def fused(self) -> str:
        from pipeline.runtime.worker.model_runner import ModelRunner

        runner = self.engine.runner
        if not isinstance(runner, ModelRunner):
            return "-"
        return "yes" if runner.model.fused is not None else "no"


def _millions(total: int, active: int) -> str:
    text = f"{total / 1e6:.2f}M"
    return text if active == total else f"{text} ({active / 1e6:.2f}M)"


def tiny_subjects(archs: Sequence[str], work_dir: Path, threads: int | None) -> list[Subject]:
    from transformers.utils import logging as hf_logging

    from pipeline.bench.architectures import (
        bench_build_config,
        bench_tokenizer,
        build_engine,
        make_bench_checkpoint,
    )
    from pipeline.runtime.engine.engine_args import EngineArgs, RunnerArgs
    from pipeline.runtime.engine.llm_engine import LLMEngine

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    tokenizer = bench_tokenizer()
    subjects = []
    for arch in archs:
        started = time.perf_counter()
        hf_dir = work_dir / arch / "hf"
        facts = make_bench_checkpoint(hf_dir, arch, tokenizer)
        engine_dir = build_engine(bench_build_config(hf_dir, f"bench-{arch}"), hf_dir, work_dir / arch)
        engine = LLMEngine.from_engine_dir(engine_dir, EngineArgs(runner=RunnerArgs(num_threads=threads)))
        subjects.append(
            Subject(
                model=arch,
                architecture=facts["architecture"],
                params=_millions(facts["num_params"], facts["active_params"]),
                engine=engine,
                tiny=True,
            )
        )
        print(f"[{arch}] built in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return subjects


def real_subjects(threads: int | None) -> tuple[list[Subject], list[str]]:
    """The released models whose builds succeed, and a note for each one skipped."""
    from pipeline.bench.builds import ensure_built
    from pipeline.runtime.engine.engine_args import EngineArgs, RunnerArgs
    from pipeline.runtime.engine.llm_engine import LLMEngine
    from pipeline.runtime.worker.model_runner import ModelRunner

    subjects, notes = [], []
    for label, (config, params) in REAL_MODELS.items():
        if not (REPO / config).is_file():
            notes.append(f"{label}: skipped, {config} is not in this checkout.")
            continue
        try:
            build = ensure_built(REPO / config, until="engine")
        except PipelineError as err:
            notes.append(f"{label}: skipped, its build failed: {err.message}")
            continue
        assert build.engine_dir is not None
        engine = LLMEngine.from_engine_dir(
            build.engine_dir, EngineArgs(runner=RunnerArgs(num_threads=threads))
        )
        runner = engine.runner
        subjects.append(
            Subject(
                model=label,
                architecture=runner.config.model.architecture if isinstance(runner, ModelRunner) else "-",
                params=params,
                engine=engine,
                tiny=False,
            )
        )
    return subjects, notes


def measure_once(
    engine: Any, prompts: list[list[int]], args: argparse.Namespace, single_repeats: int
) -> dict[str, float]:
    """One request at a time (`single_repeats` of them: a tiny model's are short), then `args.concurrency`
    together: the best wall-clock rates and rates per process CPU-second."""
    from pipeline.bench.decode import decode_speed

    runs = [decode_speed(engine, prompts[:1], args.new_tokens) for _ in range(single_repeats)]
    cpu_started = time.process_time()
    batched = decode_speed(engine, prompts[1 : 1 + args.concurrency], args.new_tokens)
    cpu_seconds = time.process_time() - cpu_started
    return {
        "single_tok_s": max(run["decode_tok_s"] for run in runs),
        "single_cpu_tok_s": max(run["decode_tok_per_cpu_s"] for run in runs),
        "concurrent_tok_s": batched["end_to_end_tok_s"],
        "concurrent_cpu_tok_s": round(batched["output_tokens"] / cpu_seconds, 1),
    }


def measure(subjects: Sequence[Subject], args: argparse.Namespace) -> None:
    """Warm every engine, then `args.rounds` interleaved rounds (released models: `args.real_rounds`, one
    single request each); each subject keeps the best of each rate (and the load when its best
    single-request run started)."""
    from pipeline.bench.decode import decode_speed, random_prompts

    prompts: dict[str, list[list[int]]] = {}
    for subject in subjects:
        vocab = subject.engine.runner.config.model.vocab_size
        prompts[subject.model] = random_prompts(args.concurrency + 2, args.prompt_len, vocab)
        decode_speed(subject.engine, prompts[subject.model][-1:], 8)  # kernels, caches, allocator primed
    for round_index in range(max(args.rounds, args.real_rounds if any(not s.tiny for s in subjects) else 0)):
        for subject in subjects:
            if round_index >= (args.rounds if subject.tiny else args.real_rounds):
                continue
            load = report.load_1m()
            repeats = args.single_repeats if subject.tiny else 1
            rates = measure_once(subject.engine, prompts[subject.model], args, repeats)
            best = subject.best
            if rates["single_tok_s"] > best.get("single_tok_s", 0.0):
                best["load"] = load
            for name, value in rates.items():
                best[name] = max(best.get(name, 0.0), value)
            print(
                f"[{subject.model}] round {round_index + 1}: 1 request {rates['single_tok_s']} tok/s "
                f"({rates['single_cpu_tok_s']} per CPU-s), {args.concurrency} concurrent "
                f"{rates['concurrent_tok_s']} tok/s ({rates['concurrent_cpu_tok_s']} per CPU-s), load {load}",
                file=sys.stderr,
            )


def _ratio(value: float | None, baseline: float | None) -> str:
    if not value or not baseline:
        return "-"
    return f"{value / baseline:.2f}"


def table_rows(results: Sequence[dict[str, Any]], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Rows for COLUMNS from per-model results (model, architecture, params, fused, tiny and the rates of
    measure_once, load): the tiny models' ratios to `baseline`'s, per CPU-second."""
    base = next((r for r in results if r["model"] == baseline and r.get("tiny", True)), {})
    rows = []
    for result in results:
        row = dict(result)
        for value, ratio in (
            ("single_cpu_tok_s", "single_ratio"),
            ("concurrent_cpu_tok_s", "concurrent_ratio"),
        ):
            tiny = result.get("tiny", True)
            row[ratio] = _ratio(result.get(value), base.get(value)) if tiny else "-"
        rows.append(row)
    return rows


def slow_families(rows: Sequence[dict[str, Any]], threshold: float = 0.8) -> list[str]:
    """The tiny models whose single-request decode or 16-concurrent throughput is under `threshold` of
    the baseline's, described in one line each."""
    lines = []
    for row in rows:
        ratios = {"1 request": row.get("single_ratio"), "16 concurrent": row.get("concurrent_ratio")}
        slow = [
            f"{what} {value}x"
            for what, value in ratios.items()
            if value not in (None, "-") and float(value) < threshold
        ]
        if slow:
            fused = "" if row.get("fused") != "no" else " (off the fused decode path)"
            lines.append(f"- {row['model']}{fused}: {', '.join(slow)} of llama's")
    return lines


def markdown_page(
    command: str,
    rows: Sequence[dict[str, Any]],
    notes: Sequence[str],
    args: argparse.Namespace,
    kernels: str,
) -> str:
    facts = report.machine_facts()
    slow = slow_families(rows)
    lines = [
        "# Decode speed per architecture",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {facts['cpus']} CPUs, {facts['platform']}, Python {facts['python']}, torch {facts['torch']} "
        f"({facts['torch_threads']} threads), kernels {kernels}; load average at the end {facts['load_average']}.",
        "",
        "Tiny models: random fp32 weights, one shape for every family (hidden 256, 4 layers, 4 query / 2 KV "
        "heads of 64, MLP 512, the tiny tokenizer's 2000-token vocabulary; MoE: 4 experts of width 256, 2 "
        "active, so active parameters match the dense models'; Qwen2, Gemma 2/3 and SmolLM3 tie the "
        "embeddings as their released checkpoints do). Each family keeps its features (pipeline/sources/tiny.py).",
        f"Workload: greedy, random {args.prompt_len}-token prompts, {args.new_tokens} new tokens per request "
        "(no end id), in-process, one engine per model (pipeline/bench/decode.py). Decode tok/s counts the "
        "tokens after every request's first one; output tok/s counts every output token over the whole run "
        "(prefills included); per CPU-s: the same tokens per process CPU-second, which other processes on a "
        "shared machine change much less than wall-clock rates. x llama: the ratio of the per CPU-s rates "
        "to the tiny Llama's in this run; Mistral (no window here) has exactly Llama's structure, so its "
        f"ratios show the run's noise. Best of {args.rounds} interleaved round(s) ({args.single_repeats} "
        "single requests in each), each rate on its own; "
        "load avg: the 1-minute load when the best single-request run started. Fused decode: whether decode "
        "steps run the fused decoder-layer kernel (else op by op).",
    ]
    if getattr(args, "real", False):
        lines.append(
            "Released models (--real): their build configs' engines (pipeline/bench/builds.py), best of "
            f"{args.real_rounds} round(s) of one single request and one concurrent run; no ratio (other shapes)."
        )
    lines += ["", report.markdown_table(rows, COLUMNS)]
    if slow:
        lines += ["", "Under 0.8x of Llama's:", "", *slow]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python scripts/bench_architectures.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    import torch

    from pipeline.runtime.kernels.build import kernel_isa
    from pipeline.runtime.kernels.ops import kernels_available, kernels_unavailable_reason

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-architectures-") as tmp:
        work_dir = args.work_dir or Path(tmp)
        subjects = tiny_subjects(args.archs, work_dir, args.threads)
        notes: list[str] = []
        if args.real:
            real, notes = real_subjects(args.threads)
            subjects += real
        measure(subjects, args)
    kernels = kernel_isa() if kernels_available() else f"off ({kernels_unavailable_reason()})"
    results = [
        {
            "model": s.model,
            "architecture": s.architecture,
            "params": s.params,
            "fused": s.fused,
            "tiny": s.tiny,
            **s.best,
        }
        for s in subjects
    ]
    rows = table_rows(results)
    print(report.format_table(rows, COLUMNS))
    for line in [*slow_families(rows), *notes]:
        print(line)
    if args.out is not None:
        page = args.out / f"{time.strftime('%Y-%m-%d')}-{report.machine_tag()}-architectures.md"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(markdown_page(command, rows, notes, args, kernels))
        print(f"wrote {page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_script(main)
