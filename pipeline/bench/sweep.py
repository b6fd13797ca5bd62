"""The scaling sweep: llmpipe's throughput and TTFT over a grid of concurrency x prompt length, so the
cost of more work (more users, longer prompts) shows as curves rather than two points.

Each point is one wave: `concurrency` users each send one request of `prompt_tokens` tokens and a short
forced output. Prefill is compute-bound on CPU (a 2048-token prompt took ~9 s to its first token for
SmolLM2 fp32 on 2 shared cores), so points whose wave would prefill more than a budget are left out, and
named: the default grid then prefills ~0.2 M tokens rather than ~0.5 M. Block reuse is off for the
sweep's engine: the prompts are windows of one small corpus and would otherwise hit the prefix cache,
which is not the cost being measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.bench import report
from pipeline.bench.load import RunResult, Target, run_closed_loop
from pipeline.bench.metrics import RunMetrics
from pipeline.bench.requests import BenchRequest
from pipeline.bench.workloads import LengthSpec, Tokenizer, synthetic, tokenize

CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64)
PROMPT_TOKENS = (128, 512, 1024, 2048)
OUTPUT_TOKENS = 16
MIN_REQUESTS = 2  # per point, so a concurrency-1 point is not a single sample
MAX_WAVE_TOKENS = 32768  # prompt tokens one point may prefill


@dataclass(frozen=True)
class SweepPoint:
    concurrency: int
    prompt_tokens: int
    num_requests: int

    @property
    def workload(self) -> str:
        """The measurement key part of this point's runs."""
        return f"sweep-p{self.prompt_tokens}"


def plan(
    concurrencies: Sequence[int] = CONCURRENCIES,
    prompt_tokens: Sequence[int] = PROMPT_TOKENS,
    min_requests: int = MIN_REQUESTS,
    max_wave_tokens: int | None = MAX_WAVE_TOKENS,
) -> tuple[list[SweepPoint], list[SweepPoint]]:
    """(points to run, points left out for prefilling more than `max_wave_tokens`): the grid, prompt
    length by prompt length, concurrency rising within each."""
    if not concurrencies or not prompt_tokens:
        raise ValueError("a sweep needs at least one concurrency and one prompt length")
    if min(*concurrencies, *prompt_tokens, min_requests) < 1:
        raise ValueError("sweep concurrencies, prompt lengths and requests must be >= 1")
    grid = [
        SweepPoint(c, p, max(c, min_requests))
        for p in sorted(set(prompt_tokens))
        for c in sorted(set(concurrencies))
    ]
    if max_wave_tokens is None:
        return grid, []
    fits = [p for p in grid if p.num_requests * p.prompt_tokens <= max_wave_tokens]
    return fits, [p for p in grid if p not in fits]


def build_overrides(points: Sequence[SweepPoint], output_tokens: int) -> list[str]:
    """Build-config overrides for an engine that admits every point: its batch, prompt and sequence limits."""
    longest = max(p.prompt_tokens for p in points)
    return [
        f"engine.max_batch_size={max(p.concurrency for p in points)}",
        f"engine.max_input_len={longest}",
        f"engine.max_seq_len={longest + output_tokens}",
    ]


def requests_for(
    point: SweepPoint, output_tokens: int, tokenizer: Tokenizer, seed: int = 0
) -> list[BenchRequest]:
    return tokenize(
        synthetic(
            point.num_requests,
            LengthSpec(point.prompt_tokens),
            LengthSpec(output_tokens),
            seed=seed,
            tokenizer=tokenizer,
        ),
        tokenizer,
    )


def run(
    target: Target,
    points: Sequence[SweepPoint],
    output_tokens: int,
    tokenizer: Tokenizer,
    extra: dict[str, object],
    seed: int = 0,
    progress: bool = True,
) -> list[RunResult]:
    """One closed-loop wave per point, after a warm-up request of the shortest prompt length."""
    run_closed_loop(target, requests_for(points[0], output_tokens, tokenizer, seed)[:1], 1)
    results = []
    for point in points:
        requests = requests_for(point, output_tokens, tokenizer, seed)
        load = report.load_1m()
        label = f"{target.name} sweep c={point.concurrency} prompt={point.prompt_tokens}"
        with report.ProgressBar(len(requests), label, progress) as bar:
            result = run_closed_loop(target, requests, point.concurrency, on_record=bar)
        result.system = f"{target.name} {point.workload}"
        result.extra.update(extra, workload=point.workload, prompt_tokens=point.prompt_tokens, load_1m=load)
        results.append(result)
    return results


def run_built(
    config: str,
    overrides: Sequence[str],
    points: Sequence[SweepPoint],
    output_tokens: int,
    tokenizer: Tokenizer,
    seed: int = 0,
    progress: bool = True,
) -> list[RunResult]:
    """The sweep on an engine of `config` built (once, then reused) to admit its largest point, named
    `<name>-sweep`, loaded in-process without block reuse."""
    from pipeline.bench.builds import ensure_built
    from pipeline.bench.clients.inprocess import InProcessTarget
    from pipeline.config.build_config import load_build_config
    from pipeline.runtime.engine.engine_args import EngineArgs

    cfg = load_build_config(config, list(overrides))
    limits = build_overrides(points, output_tokens)
    build = ensure_built(config, [*overrides, f"name={cfg.name}-sweep", *limits], until="engine")
    assert build.engine_dir is not None
    engine = InProcessTarget.from_engine_dir(
        build.engine_dir,
        engine_args=EngineArgs(enable_block_reuse=False, stream_interval=cfg.serving.stream_interval),
        end_id=tokenizer.eos_token_id,
        name=f"llmpipe-{build.precision}",
    )
    extra: dict[str, object] = {"engine": "llmpipe", "precision": build.precision, "path": "inprocess"}
    try:
        return run(engine, points, output_tokens, tokenizer, extra, seed, progress)
    finally:
        engine.close()


def _row(result: RunResult) -> dict[str, Any]:
    m: RunMetrics = result.metrics()
    ttft = m.ttft_s
    return {
        "prompt_tokens": result.extra["prompt_tokens"],
        "concurrency": result.concurrency,
        "ok": m.num_completed,
        "err": m.num_errors,
        "out_tok_s": m.output_tok_s,
        "total_tok_s": (m.total_input_tokens + m.total_output_tokens) / m.duration_s
        if m.duration_s
        else None,
        "ttft_mean_ms": None if ttft is None else ttft.mean * 1000,
        "ttft_p95_ms": None if ttft is None else ttft.p95 * 1000,
        "e2e_mean_s": None if m.e2e_s is None else m.e2e_s.mean,
        "load_1m": result.extra.get("load_1m"),
    }


COLUMNS = (
    ("prompt_tokens", "prompt tokens"),
    ("concurrency", "concurrency"),
    ("ok", "requests"),
    ("err", "errors"),
    ("out_tok_s", "output tok/s"),
    ("total_tok_s", "prompt+output tok/s"),
    ("ttft_mean_ms", "TTFT mean ms"),
    ("ttft_p95_ms", "TTFT p95 ms"),
    ("e2e_mean_s", "e2e mean s"),
    ("load_1m", "load avg"),
)


def section(
    results: Sequence[RunResult],
    output_tokens: int,
    plot_link: str | None,
    left_out: Sequence[SweepPoint] = (),
) -> str:
    """The sweep as a block of a results page: what ran, the table, the points left out, the plot."""
    lines = [
        f"Scaling sweep (llmpipe in-process, one wave per point: `concurrency` requests of synthetic "
        f"prompts, {output_tokens} output tokens each, forced; block reuse off):",
        "",
        report.markdown_table([_row(r) for r in results], COLUMNS),
    ]
    if left_out:
        named = ", ".join(f"c={p.concurrency} x {p.prompt_tokens}" for p in left_out)
        lines += ["", f"Left out (a wave over the prefill budget, --sweep-max-tokens): {named}."]
    if plot_link:
        lines += ["", f"![sweep]({plot_link})"]
    return "\n".join(lines)


def plot(path: Path, results: Sequence[RunResult]) -> Path:
    """Output tok/s, prompt+output tok/s and mean TTFT against concurrency, one line per prompt length."""
    plt = report.pyplot()
    rows = [_row(r) for r in results]
    lengths = sorted({row["prompt_tokens"] for row in rows})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = (
        ("out_tok_s", "output tokens/s", "Output throughput"),
        ("total_tok_s", "prompt+output tokens/s", "Work done per second"),
        ("ttft_mean_ms", "TTFT mean (ms)", "Time to first token"),
    )
    for ax, (key, ylabel, title) in zip(axes, panels, strict=True):
        for length in lengths:
            points = sorted((r["concurrency"], r[key]) for r in rows if r["prompt_tokens"] == length)
            points = [(c, v) for c, v in points if v is not None]
            ax.plot([c for c, _ in points], [v for _, v in points], marker="o", label=f"prompt {length}")
        report.finish_axes(ax, "concurrency", ylabel, title)
        report.concurrency_axis(ax, results)
        if key == "ttft_mean_ms":
            ax.set_yscale("log")
    path.parent.mkdir(parents=True, exist_ok=True)
    return report.save_figure(fig, path)
