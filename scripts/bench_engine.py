"""The engine benchmark (a benchmark, not a timed test): SmolLM2-135M, 32 requests with prompt
lengths 16-512 and outputs 16-256 (uniform, fixed seed), served three ways in one run:

  1. Hugging Face `generate`, one request at a time;
  2. Hugging Face `generate` on padded static batches (--hf-batch-size, default 16);
  3. the llmpipe engine in-process (EngineThread), all requests submitted at once.

Reports output tokens/s, mean TTFT and mean inter-token latency per system, the engine's single-request
decode speed against HF's on the same first --single-requests prompts, and the engine's speed targets
(benchmarks/harness/targets.py) as ratios within this run. TTFT counts from when the system takes the request: HF one-at-a-time from
the start of its own generate call, a static batch from the start of its batch, the engine from
submission (queueing inside the engine included, the strictest of the three).

    python scripts/bench_engine.py --out benchmarks/results
    python scripts/bench_engine.py --requests 8 --hf-single-requests 4   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

# this checkout's pipeline, not an installed llmpipe, and benchmarks/harness, which is never installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.util.openmp import default_wait_policy  # noqa: E402

default_wait_policy(os.environ)  # before torch loads

from benchmarks.harness import targets  # noqa: E402
from pipeline.bench import report  # noqa: E402
from pipeline.bench.builds import ensure_built  # noqa: E402
from pipeline.bench.clients.inprocess import InProcessTarget  # noqa: E402
from pipeline.bench.load import OnRecord, RunResult, run_closed_loop  # noqa: E402
from pipeline.bench.metrics import summarize  # noqa: E402
from pipeline.bench.peers.hf import HFPeer  # noqa: E402
from pipeline.bench.workloads import LengthSpec, synthetic, tokenize  # noqa: E402
from pipeline.errors import run_script  # noqa: E402
from pipeline.runtime.engine.engine_args import EngineArgs, RunnerArgs  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", default="build_configs/smollm2-135m.yaml", help="build config of the engine"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-range", default="16,512", help="prompt lengths, uniform: LOW,HIGH")
    parser.add_argument("--output-range", default="16,256", help="output lengths, uniform: LOW,HIGH")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument(
        "--hf-single-requests",
        type=int,
        default=None,
        help="run HF one-at-a-time on only the first N requests (its tok/s is per-request "
        "sequential, so a subset estimates it; default: all)",
    )
    parser.add_argument(
        "--single-requests",
        type=int,
        default=4,
        help="requests for the single-request decode comparison (engine at concurrency 1)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for HF and the engine alike (default: torch's, all cores)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def _range(text: str) -> LengthSpec:
    low, high = (int(v) for v in text.split(","))
    return LengthSpec.between(low, high)


def _tag(result: RunResult, label: str, load: float | None) -> RunResult:
    result.system = label
    result.extra["load_1m"] = load
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python scripts/bench_engine.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    build = ensure_built(args.config, args.overrides, until="engine")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build.hf_dir)
    requests = tokenize(
        synthetic(
            args.requests,
            _range(args.input_range),
            _range(args.output_range),
            seed=args.seed,
            tokenizer=tokenizer,
        ),
        tokenizer,
    )
    warmup = tokenize(
        synthetic(2, LengthSpec(64), LengthSpec(8), seed=args.seed + 1, tokenizer=tokenizer), tokenizer
    )
    single = requests[: args.single_requests]
    hf_single_requests = requests[: args.hf_single_requests] if args.hf_single_requests else requests
    progress = not args.no_progress

    hf = HFPeer(build.hf_dir)
    assert build.engine_dir is not None
    engine = InProcessTarget.from_engine_dir(
        build.engine_dir,
        engine_args=EngineArgs(runner=RunnerArgs(num_threads=args.threads)),
        end_id=tokenizer.eos_token_id,
        name=f"llmpipe-{build.precision}",
    )
    # NOTE: each engine run follows the HF run it is compared with, so drifting background load (other
    # processes on a shared machine) hits both sides of a ratio alike; the idle engine thread sleeps.
    runs: list[tuple[str, Callable[[OnRecord], RunResult], int]] = [
        (
            "hf-fp32 one-at-a-time",
            lambda bar: hf.run(hf_single_requests, 1, on_record=bar),
            len(hf_single_requests),
        ),
        ("llmpipe single", lambda bar: run_closed_loop(engine, single, 1, on_record=bar), len(single)),
        (
            "hf-fp32 static-batch",
            lambda bar: hf.run(requests, args.hf_batch_size, on_record=bar),
            len(requests),
        ),
        (
            "llmpipe all-at-once",
            lambda bar: run_closed_loop(engine, requests, len(requests), on_record=bar),
            len(requests),
        ),
    ]
    results: list[RunResult] = []
    try:
        hf.run(warmup, 1)
        run_closed_loop(engine, warmup, concurrency=len(warmup))
        for label, run, total in runs:
            load = report.load_1m()
            with report.ProgressBar(total, label, progress) as bar:
                results.append(_tag(run(bar), label, load))
    finally:
        engine.close()
        hf.close()

    hf_single, engine_single, hf_static, engine_all = results
    hf_single_subset = [r for r in hf_single.records if r.index < len(single)]
    found = {
        "engine.fp32.output_tok_s": engine_all.metrics().output_tok_s,
        "hf.fp32.static_batch.output_tok_s": hf_static.metrics().output_tok_s,
        "hf.fp32.single.output_tok_s": hf_single.metrics().output_tok_s,
        "engine.fp32.single_decode_tok_s": engine_single.metrics().decode_tok_s_per_user or 0.0,
        "hf.fp32.single_decode_tok_s": summarize(hf_single_subset, 1.0).decode_tok_s_per_user or 0.0,
    }
    verdicts = targets.check(targets.ENGINE_TARGETS, found)
    run_dir = args.out / f"{time.strftime('%Y-%m-%d')}-{report.machine_tag()}-engine"
    files = report.write_results(
        run_dir,
        results,
        {"command": command, "config": args.config},
        found,
        {"targets": [v.row() for v in verdicts]},
    )
    plots = report.plot(run_dir, results)
    notes = [
        f"Workload: {len(requests)} requests, prompt lengths uniform {args.input_range.replace(',', '-')}, "
        f"outputs uniform {args.output_range.replace(',', '-')} (forced: min = max tokens), seed {args.seed}; "
        f"{sum(r.output_tokens for r in requests)} output tokens in all. Greedy, fp32.",
        f"HF one-at-a-time ran {len(hf_single_requests)} of them; single-request decode compares the first "
        f"{len(single)} requests (engine at concurrency 1 vs the same HF runs). Engine: {build.engine_dir}.",
        "TTFT counts from when each system takes the request (engine: at submission, all at once). "
        f"CPU threads per system: {args.threads or 'default (all cores)'}. Load avg = 1-minute load when the "
        "run started (2 cores: above 2 means other processes competed).",
    ]
    page = report.markdown_document(
        "Engine benchmark",
        command,
        notes,
        results,
        [targets.section(verdicts)],
        [f"{run_dir.name}/{p.name}" for p in plots],
    )
    page_path = args.out / f"{run_dir.name}.md"
    page_path.write_text(page)
    print(report.format_table([report.summary_row(r) for r in results]))
    print()
    print(targets.table(verdicts))
    print(json.dumps({"page": str(page_path), "files": [str(f) for f in files + plots]}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_script(main)
