"""The peer comparison (what `make bench` runs): llmpipe beside its peers on SmolLM2-135M, same prompts,
same output lengths, same machine, one run, with every speed target of benchmarks/harness/targets.py
marked met / missed / not measured, under the machine's ISA, bandwidth and matmul rates
(pipeline/bench/machine.py). A benchmark, not a test.

Workloads (greedy, outputs forced to their length):
  - throughput: the first --requests prompts of the shipped prompt set, --output-tokens each; single-stream
    figures use the first --single-requests of them one at a time, batched figures all of them at once;
  - TTFT: synthetic 256-token prompts (real text), outputs uniform in 64-192 tokens (mean 128, as the
    throughput rows): 2 warm-up requests, 4 at concurrency 1, then 96 others at concurrency 16;
  - scaling sweep (pipeline/bench/sweep.py, --no-sweep skips it): llmpipe fp32 in-process, with a plot.

Systems: llmpipe per precision (--precisions; in-process, and through Triton when its model repository
builds and serves: the ensemble's streamed text, its tokens counted as genai-perf counts them, taking
turns with the same requests in-process), HF transformers (one at a time, padded static
batch), llama.cpp f32/bf16/Q8_0/Q4_1 (llama-cpp-python; continuous batching through its low-level batch
API), CTranslate2 float32/int8 and OpenVINO GenAI fp32/bf16/int8/int4 (its ContinuousBatchingPipeline, on
its own venv: `make bench-deps`).
Each peer runs in a process of its own (pipeline/bench/isolation.py): one that crashes, fails to load or
passes --peer-timeout costs its own rows, and the page says how it ended.

    python scripts/bench_peers.py --out benchmarks/results
    python scripts/bench_peers.py --precisions fp32 --peers openvino-fp32 --output-tokens 16 --requests 4 \
        --single-requests 2 --no-serve --sweep-concurrency 1,2 --sweep-prompt-tokens 128   # a quick check
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# this checkout's pipeline, not an installed llmpipe, and benchmarks/harness, which is never installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.util.openmp import default_wait_policy  # noqa: E402

default_wait_policy(os.environ)  # before torch loads

from benchmarks.harness import targets  # noqa: E402
from pipeline.bench import machine, report, suite, sweep  # noqa: E402
from pipeline.bench.builds import Build, ensure_built  # noqa: E402
from pipeline.bench.clients.inprocess import InProcessTarget  # noqa: E402
from pipeline.bench.comparisons import measurements  # noqa: E402
from pipeline.bench.isolation import run_jobs  # noqa: E402
from pipeline.bench.load import RunResult, Target, run_closed_loop  # noqa: E402
from pipeline.bench.metrics import percentile, ttft  # noqa: E402
from pipeline.bench.peers import jobs as peer_jobs  # noqa: E402
from pipeline.bench.requests import BenchRequest  # noqa: E402
from pipeline.bench.workloads import LengthSpec, shipped_prompts, synthetic, tokenize  # noqa: E402
from pipeline.errors import PipelineError, run_script  # noqa: E402

# precision -> build config
BUILDS: dict[str, str] = {
    "fp32": "build_configs/smollm2-135m.yaml",
    "bf16": "build_configs/smollm2-135m-bf16.yaml",
    "int8": "build_configs/smollm2-135m-int8.yaml",
    "w8a8": "build_configs/smollm2-135m-int8-sq.yaml",
    "int4": "build_configs/smollm2-135m-int4.yaml",
}
BATCH = 16
TTFT_PROMPT_TOKENS = 256
# Varied output lengths let the closed loop's arrivals spread out as they do under real traffic; equal
# lengths would keep the 16 users in lock step, arriving (and queueing their prefills) together forever.
TTFT_OUTPUT_TOKENS = LengthSpec.between(64, 192)
TTFT_WARMUP = 2  # requests before any is measured: the first 256-token prefill pays for cold caches
TTFT_SINGLE = 4  # requests one at a time
# Requests 16 at a time: the p95 leaves out the first 16, so 80 remain (~4 above it) for a steadier tail
# than 32 gave (its p95 swung from 3.2x to 4.2x a single TTFT between runs of the same code).
TTFT_LOADED = 6 * BATCH


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--precisions", default="fp32,bf16,int8,w8a8,int4")
    parser.add_argument(
        "--peers",
        default="hf,llamacpp,ct2,openvino",
        help="as `llmpipe bench --compare`, plus openvino[-fp32|-bf16|-int8|-int4]",
    )
    parser.add_argument(
        "--peer-timeout", type=float, default=1800, help="seconds before a peer's process is killed"
    )
    parser.add_argument(
        "--openvino-python",
        type=Path,
        default=peer_jobs.OPENVINO_PYTHON,
        help="the OpenVINO GenAI venv's python",
    )
    parser.add_argument("--no-sweep", action="store_true", help="skip the scaling sweep")
    parser.add_argument("--sweep-concurrency", default=",".join(map(str, sweep.CONCURRENCIES)))
    parser.add_argument("--sweep-prompt-tokens", default=",".join(map(str, sweep.PROMPT_TOKENS)))
    parser.add_argument("--sweep-output-tokens", type=int, default=sweep.OUTPUT_TOKENS)
    parser.add_argument(
        "--sweep-max-tokens",
        type=int,
        default=sweep.MAX_WAVE_TOKENS,
        help="prompt tokens one point may prefill",
    )
    parser.add_argument("--requests", type=int, default=BATCH, help="requests per batched run")
    parser.add_argument("--single-requests", type=int, default=4, help="requests run one at a time")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--no-serve", action="store_true", help="skip the Triton runs")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for every system alike (default: each one's own, all cores)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=Path("build/peers"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def _closed(
    target: Target,
    requests: list[BenchRequest],
    concurrency: int,
    extra: Mapping[str, object],
    progress: bool,
) -> RunResult:
    load = report.load_1m()
    with report.ProgressBar(len(requests), f"{target.name} c={concurrency}", progress) as bar:
        result = run_closed_loop(target, requests, concurrency, on_record=bar)
    result.extra.update(extra, load_1m=load)
    return result


def _measure_ours(
    targets: list[tuple[Target, str]],
    precision: str,
    wl: dict[str, list[BenchRequest]],
    problems: list[str],
    progress: bool,
) -> list[RunResult]:
    """Each (target, path) warmed up, then the single requests on each in turn, then the batch on each in
    turn: a run and the one it is compared with are seconds apart, not minutes, so a slow spell of this
    shared machine lands on both (the same runs minutes apart differed by up to 15 % here). Each target gets
    the same requests, so each finds the same prompts in its KV block cache. A target that raises is reported
    and dropped; the others' rows stay."""
    for target, _ in targets:
        run_closed_loop(target, wl["warmup"], len(wl["warmup"]))
    runs: dict[tuple[str, int], RunResult] = {}
    live = list(targets)
    loads = ((wl["single"], 1), (wl["batch"], BATCH))
    for requests, concurrency in loads:
        for target, path in list(live):
            extra = {"engine": "llmpipe", "precision": precision, "path": path}
            try:
                runs[path, concurrency] = _closed(target, requests, concurrency, extra, progress)
            except Exception as err:  # noqa: BLE001 - a failing server must not cost the in-process rows
                _problem(problems, f"{target.name} c={concurrency}", err)
                live.remove((target, path))
    return [runs[path, c] for _, path in targets for _, c in loads if (path, c) in runs]


def _ttft_runs(
    target: Target, requests: list[BenchRequest], progress: bool
) -> tuple[list[RunResult], dict[str, float]]:
    """TTFT on 256-token prompts, in-process (the target is about the scheduler: chunked context must keep
    new requests from starving): TTFT_SINGLE requests one at a time, then TTFT_LOADED others 16 at a time.
    The target's c=16 p95 is the steady state: it leaves out the first 16 requests, which arrive together
    at the start (a burst whose last prefill waits for the 15 before it, ~15x a single TTFT on any FCFS
    engine), so it shows how a request fares when it joins 15 running ones. The p95 over every request is kept too."""
    extra = {"engine": "llmpipe", "precision": "fp32", "path": "inprocess", "workload": "prompt256"}
    # Each phase gets its own prompts: with KV block reuse on, a repeated prompt would skip its prefill.
    single_end = TTFT_WARMUP + TTFT_SINGLE
    warm, single, loaded = requests[:TTFT_WARMUP], requests[TTFT_WARMUP:single_end], requests[single_end:]
    run_closed_loop(target, warm, 1)
    c1 = _closed(target, single, 1, extra, progress)
    c16 = _closed(target, loaded, BATCH, extra, progress)
    for run in (c1, c16):
        run.system = f"{target.name} prompt256"
    m1, m16 = c1.metrics(), c16.metrics()
    steady = [r for r in c16.records[BATCH:] if r.ok]
    keys = {}
    if m1.ttft_s and m16.ttft_s:
        keys = {
            "llmpipe.fp32.ttft_mean_c1_prompt256_s": m1.ttft_s.mean,
            "llmpipe.fp32.ttft_p95_c16_with_burst_prompt256_s": m16.ttft_s.p95,
        }
        ttfts = [t for t in (ttft(r) for r in steady) if t is not None]
        if ttfts:
            keys["llmpipe.fp32.ttft_p95_c16_prompt256_s"] = percentile(ttfts, 95)
    return [c1, c16], keys


def _serve(build: Build) -> Any:
    from pipeline.serving.server.command import ServerOptions
    from pipeline.serving.server.launcher import TritonServer

    assert build.model_repo is not None
    return TritonServer(
        ServerOptions(model_repository=build.model_repo, http_port=0, grpc_port=0, metrics_port=0)
    )


def _problem(problems: list[str], what: str, err: BaseException) -> None:
    detail = err.message if isinstance(err, PipelineError) else f"{type(err).__name__}: {err}"
    problems.append(f"{what}: {detail}")
    print(f"!! {what}: {detail}", file=sys.stderr)
    if not isinstance(err, PipelineError):
        traceback.print_exc(file=sys.stderr)


def run_ours(
    args: argparse.Namespace,
    precisions: list[str],
    wl: dict[str, list[BenchRequest]],
    tokenizer: Any,
    problems: list[str],
    weights: dict[str, int],
) -> tuple[list[RunResult], dict[str, float]]:
    """Each precision in-process and served, taking turns; `weights` gets each engine's bytes read per
    decode step."""
    eos_id = tokenizer.eos_token_id
    results: list[RunResult] = []
    keys: dict[str, float] = {}
    for precision in precisions:
        try:
            build = ensure_built(BUILDS[precision], until="engine")
            assert build.engine_dir is not None
            weights[precision] = machine.weight_bytes(build.engine_dir)
            engine = InProcessTarget.from_engine_dir(
                build.engine_dir, end_id=eos_id, name=f"llmpipe-{precision}"
            )
        except Exception as err:  # noqa: BLE001 - one precision failing must not cost the others' numbers
            _problem(problems, f"llmpipe {precision} engine", err)
            continue
        try:
            with contextlib.ExitStack() as stack:
                targets: list[tuple[Target, str]] = [(engine, "inprocess")]
                if not args.no_serve:
                    served = _served(precision, problems, tokenizer, stack)
                    targets += [(served, "triton")] if served is not None else []
                results += _measure_ours(targets, precision, wl, problems, not args.no_progress)
            if precision == "fp32":
                ttft, keys = _ttft_runs(engine, wl["prompt256"], not args.no_progress)
                results += ttft
        finally:
            engine.close()
    return results, keys


def _served(
    precision: str, problems: list[str], tokenizer: Any, stack: contextlib.ExitStack
) -> Target | None:
    """A client of the precision's model repository under tritonserver, both closed by `stack`; None (and the
    reason in `problems`) when it does not build or serve."""
    from pipeline.bench.clients.triton import EnsembleCounting, triton_target

    try:
        build = ensure_built(BUILDS[precision], until="package")
        server = stack.enter_context(_serve(build))
        client = triton_target(
            f"grpc://{server.grpc_url}",
            name=f"llmpipe-{precision}-triton",
            counting=EnsembleCounting(tokenizer=tokenizer),
        )
    except Exception as err:  # noqa: BLE001 - report the serving failure, keep the in-process numbers
        _problem(problems, f"llmpipe {precision} through Triton", err)
        return None
    stack.callback(client.close)
    return client


def run_peers(
    args: argparse.Namespace, wl: dict[str, list[BenchRequest]], hf_dir: Path, gguf: Path, problems: list[str]
) -> list[RunResult]:
    """Each peer in a process of its own, one after the other; a crash or timeout costs its rows only."""
    paths = {"hf_dir": hf_dir, "cache_dir": args.cache_dir, "gguf": gguf}
    options = {
        **{k: str(v.resolve()) for k, v in paths.items()},
        "max_batch_size": BATCH,
        "threads": args.threads,
    }
    runs = ((1, tuple(wl["single"])), (BATCH, tuple(wl["batch"])))
    jobs, unable = peer_jobs.plan(
        args.peers, runs, wl["warmup"], options, args.openvino_python, not args.no_progress
    )
    problems += unable
    results: list[RunResult] = []
    for outcome in run_jobs(jobs, args.peer_timeout):
        results += outcome.results
        if outcome.failure:
            problems.append(f"peer {outcome.failure}")
            print(f"!! peer {outcome.failure}", file=sys.stderr)
    return results


def run_sweep(args: argparse.Namespace, tokenizer: Any) -> tuple[list[RunResult], list[sweep.SweepPoint]]:
    """The sweep's runs, and the points left out for their prefill budget."""
    points, left_out = sweep.plan(
        suite.parse_int_list(args.sweep_concurrency, "--sweep-concurrency"),
        suite.parse_int_list(args.sweep_prompt_tokens, "--sweep-prompt-tokens"),
        max_wave_tokens=args.sweep_max_tokens,
    )
    results = sweep.run_built(
        BUILDS["fp32"], [], points, args.sweep_output_tokens, tokenizer, args.seed, not args.no_progress
    )
    return results, left_out


def _burst_note(keys: dict[str, float]) -> list[str]:
    single = keys.get("llmpipe.fp32.ttft_mean_c1_prompt256_s")
    with_burst = keys.get("llmpipe.fp32.ttft_p95_c16_with_burst_prompt256_s")
    if not single or with_burst is None:
        return []
    return [
        "The TTFT target's c=16 p95 leaves out the first 16 requests, which all arrive at the start; over every "
        f"request, that burst included, the p95 is {with_burst:.2f} s, {with_burst / single:.2f}x the "
        f"single-request TTFT ({single:.2f} s)."
    ]


def workloads(args: argparse.Namespace, tokenizer: Any) -> dict[str, list[BenchRequest]]:
    # SmolLM2-Instruct: every prompt is one user turn of its chat template, on every system (the served
    # ensemble is asked to apply it), so the in-process, served and peer rows prefill the same ids.
    batch = tokenize(shipped_prompts(output_tokens=args.output_tokens)[: args.requests], tokenizer, True)
    return {
        "batch": batch,
        "single": batch[: args.single_requests],
        "warmup": tokenize(
            synthetic(2, LengthSpec(64), LengthSpec(8), seed=args.seed + 1, tokenizer=tokenizer), tokenizer
        ),
        "prompt256": tokenize(
            synthetic(
                TTFT_WARMUP + TTFT_SINGLE + TTFT_LOADED,
                LengthSpec(TTFT_PROMPT_TOKENS),
                TTFT_OUTPUT_TOKENS,
                seed=args.seed,
                tokenizer=tokenizer,
            ),
            tokenizer,
        ),
    }


def _notes(args: argparse.Namespace, wl: dict[str, list[BenchRequest]], wall_s: float) -> list[str]:
    batch = wl["batch"]
    return [
        f"Workload: {len(batch)} shipped prompts ({min(r.num_input_tokens for r in batch)}-"
        f"{max(r.num_input_tokens for r in batch)} tokens), {args.output_tokens} output tokens each (forced), greedy. "
        f"Single-stream rows: the first {len(wl['single'])} prompts one at a time; c=16 / batch 16 rows: all "
        f"{len(batch)} at once; llmpipe's in-process and Triton runs of a precision took turns. "
        f"prompt256 rows: synthetic {TTFT_PROMPT_TOKENS}-token prompts, "
        f"{TTFT_OUTPUT_TOKENS.low}-{TTFT_OUTPUT_TOKENS.high} output tokens (uniform), after {TTFT_WARMUP} warm-up requests "
        f"{TTFT_SINGLE} one at a time and {TTFT_LOADED} others 16 at a time. 'decode tok/s per request' = "
        "1 / mean TPOT. Load avg = 1-minute load when the run "
        "started (2 cores: above 2 means other processes competed). Every peer ran in a process of its own.",
        f"Wall time {wall_s} s. CPU threads per system: {args.threads or 'default (all cores)'}.",
    ]


def _sweep_section(
    args: argparse.Namespace, run_dir: Path, swept: list[RunResult], left_out: list[sweep.SweepPoint]
) -> list[str]:
    if not swept:
        return []
    png = sweep.plot(run_dir / "sweep.png", swept)
    return [sweep.section(swept, args.sweep_output_tokens, f"{run_dir.name}/{png.name}", left_out)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python scripts/bench_peers.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    precisions = [p for p in args.precisions.split(",") if p]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        # the tritonserver started below, and its Python stubs, inherit this: same threads as in-process
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    # first, while nothing else of ours is loaded
    facts = machine.measure(args.threads or os.cpu_count() or 1)
    base = ensure_built(BUILDS["fp32"], until="fetch")  # the tokenizer and the peers' checkpoint
    from transformers import AutoTokenizer

    from pipeline.stages.fetch import gguf_file

    tokenizer = AutoTokenizer.from_pretrained(base.hf_dir)
    wl = workloads(args, tokenizer)
    problems: list[str] = []
    weights: dict[str, int] = {}
    started = time.monotonic()
    results, keys = run_ours(args, precisions, wl, tokenizer, problems, weights)
    results += run_peers(args, wl, base.hf_dir, gguf_file(base.cfg), problems)
    swept, left_out = ([], []) if args.no_sweep else run_sweep(args, tokenizer)
    run_dir = args.out / f"{time.strftime('%Y-%m-%d')}-{report.machine_tag()}"
    wall_s = round(time.monotonic() - started, 1)
    meta = {"command": command, "problems": problems, "wall_s": wall_s}
    meta.update(machine=facts.row(), weight_bytes=weights)
    found = {**measurements(results), **keys, **machine.limit_measurements(facts, weights)}
    verdicts = targets.check(targets.PEER_TARGETS, found)
    extra = {"targets": [v.row() for v in verdicts], "sweep": [report.summary_row(r) for r in swept]}
    report.write_results(run_dir, results, meta, found, extra)
    plots = report.plot(run_dir, results)
    sections = [targets.section(verdicts), *_sweep_section(args, run_dir, swept, left_out)]
    notes = [
        machine.header(facts, weights, targets.bandwidth_verdicts(verdicts)),
        "",
        *_notes(args, wl, wall_s),
        *_burst_note(keys),
        *(f"- Not measured: {p}" for p in problems),
    ]
    page = report.markdown_document(
        "llmpipe vs peers", command, notes, results, sections, [f"{run_dir.name}/{p.name}" for p in plots]
    )
    page_path = args.out / f"{run_dir.name}.md"
    page_path.write_text(page)
    rows = [report.summary_row(r) for r in results]
    print(report.format_table(rows, report.columns_for(rows)) + "\n\n" + targets.table(verdicts))
    print(f"\nwrote {page_path} and {run_dir}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_script(main)
