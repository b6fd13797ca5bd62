"""One benchmark: run a target over a concurrency sweep or request rates, run the peers on the
same requests, then write the table, results.json/CSV and plots. The `bench` command and the scripts
in scripts/ are thin wrappers around this."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.bench import report
from pipeline.bench.comparisons import (
    PEER_COMPARISONS,
    SPECULATION_COMPARISONS,
    compare,
    measurements,
)
from pipeline.bench.load import RunResult, Target, run_closed_loop, run_open_loop
from pipeline.bench.peers import Peer, source_identity
from pipeline.bench.requests import BenchRequest
from pipeline.errors import ConfigError
from pipeline.runtime.engine.engine_args import SPECULATIVE_MODES, EngineArgs, SpeculationArgs

# The workload tag of llmpipe runs that ask for each token's log-prob (`--log-probs`): they do more work.
LOG_PROBS_WORKLOAD = "logprobs"
# --compare names -> (peer family, precisions)
PEER_FAMILIES: dict[str, tuple[str, ...]] = {
    "hf": ("fp32",),
    "llamacpp": ("f32", "bf16", "q8_0", "q4_1"),
    "ct2": ("float32", "int8"),
}


@dataclass
class Plan:
    concurrencies: list[int] = field(default_factory=lambda: [1, 4, 16])
    rates: list[float] = field(default_factory=list)  # open loop when non-empty
    max_concurrency: int | None = None  # open-loop cap
    max_duration_s: float | None = None
    seed: int = 0
    progress: bool = True


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"{what} must be integers >= 1, got {text!r}")
    return values


def parse_float_list(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"{what} must be numbers > 0, got {text!r}")
    return values


def parse_compare(
    text: str, families: Mapping[str, Sequence[str]] = PEER_FAMILIES, option: str = "--compare"
) -> list[tuple[str, str]]:
    """'hf,llamacpp-q8_0,ct2' -> [(hf, fp32), (llamacpp, q8_0), (ct2, float32), (ct2, int8)]."""
    picked: list[tuple[str, str]] = []
    for item in (v.strip().lower() for v in text.split(",") if v.strip()):
        family, _, precision = item.partition("-")
        if family not in families or (precision and precision not in families[family]):
            choices = ", ".join(f"{f} ({'|'.join(p)})" for f, p in families.items())
            raise ConfigError(
                f"{option}: unknown peer {item!r}", hint=f"choose from {choices}; e.g. llamacpp-q8_0"
            )
        for p in (precision,) if precision else families[family]:
            if (family, p) not in picked:
                picked.append((family, p))
    return picked


def _bar(plan: Plan, total: int, label: str) -> report.ProgressBar:
    return report.ProgressBar(total, label, enabled=plan.progress)


def run_target(
    target: Target,
    requests: Sequence[BenchRequest],
    warmup: Sequence[BenchRequest],
    plan: Plan,
    extra: dict[str, object],
) -> list[RunResult]:
    """The sweep (closed loop) or the rates (open loop) for one target."""
    results = []
    if plan.rates:
        for rate in plan.rates:
            extra = {**extra, "load_1m": report.load_1m()}
            with _bar(plan, len(requests), f"{target.name} rate {rate:g}/s") as bar:
                result = run_open_loop(
                    target,
                    requests,
                    rate,
                    seed=plan.seed,
                    warmup=warmup,
                    max_concurrency=plan.max_concurrency,
                    max_duration_s=plan.max_duration_s,
                    on_record=bar,
                )
            results.append(_tagged(result, extra))
        return results
    for concurrency in plan.concurrencies:
        extra = {**extra, "load_1m": report.load_1m()}
        with _bar(plan, len(requests), f"{target.name} c={concurrency}") as bar:
            result = run_closed_loop(
                target,
                requests,
                concurrency,
                warmup=warmup,
                max_duration_s=plan.max_duration_s,
                on_record=bar,
            )
        results.append(_tagged(result, extra))
    return results


def _tagged(result: RunResult, extra: dict[str, object]) -> RunResult:
    result.extra.update(extra)
    return result


def run_peer(
    peer: Peer,
    requests: Sequence[BenchRequest],
    warmup: Sequence[BenchRequest],
    batch_sizes: Sequence[int],
    plan: Plan,
) -> list[RunResult]:
    if warmup:
        peer.run(warmup, 1)
    results = []
    for size in batch_sizes:
        load = report.load_1m()
        with _bar(plan, len(requests), f"{peer.name} batch {size}") as bar:
            results.append(_tagged(peer.run(requests, size, on_record=bar), {"load_1m": load}))
    return results


def make_peer(
    family: str,
    precision: str,
    hf_dir: Path,
    tokenizer: Any,
    cache_dir: Path,
    max_batch_size: int,
    gguf: Path | None,
    num_threads: int | None = None,
) -> Peer:
    """Load one peer, converting the model for it on first use (cached under `cache_dir`, keyed by the
    source file's identity so a rebuilt checkpoint is converted again). `num_threads` None = each peer's
    default (all cores); HF follows torch's process-wide setting."""
    if family == "hf":
        from pipeline.bench.peers.hf import HFPeer

        return HFPeer(hf_dir)
    if family == "llamacpp":
        from pipeline.bench.peers.llamacpp import LlamaCppPeer, make_gguf_variant

        if gguf is None:
            raise ConfigError("the llama.cpp peers need a GGUF file", hint="pass --gguf FILE")
        stem = gguf.stem.rsplit(".", 1)[0]
        same = gguf.stem.upper().endswith(precision.upper())
        path = (
            gguf
            if same
            else make_gguf_variant(
                gguf, cache_dir / f"{stem}-{source_identity(gguf)}.{precision}.gguf", precision
            )
        )
        return LlamaCppPeer(path, precision, max_batch_size=max_batch_size, num_threads=num_threads)
    from pipeline.bench.peers.ctranslate2 import CTranslate2Peer, convert

    weights = sorted(hf_dir.glob("*.safetensors"))
    model_dir = convert(hf_dir, cache_dir / f"ct2-{source_identity(*weights)}-{precision}", precision)
    return CTranslate2Peer(model_dir, precision, tokenizer, num_threads=num_threads)


def run_peers(
    peers: Sequence[tuple[str, str]],
    requests: Sequence[BenchRequest],
    warmup: Sequence[BenchRequest],
    batch_sizes: Sequence[int],
    plan: Plan,
    loader: Callable[[str, str], Peer],
) -> list[RunResult]:
    """Each peer in turn, loaded, measured and released, so two never compete for the cores."""
    results = []
    for family, precision in peers:
        print(f"peer {family}-{precision}: loading", file=sys.stderr)
        peer = loader(family, precision)
        try:
            results += run_peer(peer, requests, warmup, batch_sizes, plan)
        finally:
            peer.close()
    return results


def finish(
    results: Sequence[RunResult],
    out_dir: Path,
    meta: dict[str, Any],
    plots: bool = True,
) -> tuple[str, list[Path]]:
    """Print-ready text (the runs table, then the side-by-side ratios this run measured both sides of)
    and the files written."""
    rows = [report.summary_row(r) for r in results]
    found = measurements(results)
    ratios = [r for r in compare((*PEER_COMPARISONS, *SPECULATION_COMPARISONS), found) if r.value is not None]
    files = report.write_results(out_dir, results, meta, found, {"ratios": [r.row() for r in ratios]})
    if plots:
        files += report.plot(out_dir, results)
    text = report.format_table(rows, report.columns_for(rows))
    if ratios:
        text += "\n\n" + report.ratio_table(ratios)
    return text, files


@dataclass(frozen=True)
class OursSpec:
    """Which llmpipe deployment to measure: an endpoint URL, or a build config served or loaded here."""

    endpoint: str | None  # a running Triton (host:port, grpc://, http://), or OpenAI API (http://h:p/v1)
    cfg: Any  # pipeline.config.build_config.BuildConfig when a config was given
    in_process: bool
    protocol: str  # grpc | http, for a server started here; openai: the endpoint is an OpenAI API
    model_name: str  # ensemble | tensorrt_llm
    min_tokens_equal_max: bool
    precision: str | None
    end_id: int | None
    # in-process: speculative modes to run one after the other (none | ngram | draft_model), each with the
    # config's speculative settings; empty = the config's own mode only
    speculation: tuple[str, ...] = ()
    workload: str | None = None  # the workload's name, for the measurement keys of a speculation sweep
    # ask for each token's log-prob (in-process, or from the ensemble, whose tokens are then counted by them)
    log_probs: bool = False
    tokenizer: Any | None = None  # tokenizes the ensemble's streamed responses to count their tokens


def speculation_args(cfg: Any, mode: str) -> SpeculationArgs:
    """The speculation that runs `mode` with the config's speculative settings, whatever the engine was
    built with."""
    from pipeline.bench.builds import stage_output
    from pipeline.config.workdir import draft_engine_dir

    if mode not in SPECULATIVE_MODES:
        raise ConfigError(
            f"speculative mode {mode!r} cannot run in-process",
            hint=f"choose from {', '.join(SPECULATIVE_MODES)} (lookahead/medusa/eagle are TensorRT-LLM modes)",
        )
    if mode == "none":
        return SpeculationArgs(mode="none")
    spec = cfg.speculative
    if mode == "ngram":
        return SpeculationArgs(
            mode="ngram",
            max_draft_len=spec.max_draft_len,
            adaptive=spec.adaptive,
            ngram_min_match=spec.ngram.min_match,
            ngram_max_match=spec.ngram.max_match,
        )
    if not spec.draft_config:
        raise ConfigError(
            "speculative mode draft_model needs speculative.draft_config (the draft engine's build config)",
            hint="--set speculative.draft_config=build_configs/<draft>.yaml",
        )
    # A finished engine stage (its manifest), not just a config.json: stage_output checks that.
    draft, _ = draft_engine_dir(cfg, require_built=False)
    return SpeculationArgs(
        mode="draft_model",
        max_draft_len=spec.max_draft_len,
        adaptive=spec.adaptive,
        draft_engine_dir=stage_output(draft, "engine"),
    )


def run_llmpipe(
    spec: OursSpec, requests: Sequence[BenchRequest], warmup: Sequence[BenchRequest], plan: Plan
) -> list[RunResult]:
    """Measure llmpipe: in-process, at an endpoint, or through a tritonserver started on the config's model
    repository for the duration of the runs."""
    from pipeline.bench.builds import packaged_repository, stage_output
    from pipeline.bench.clients.triton import EnsembleCounting, triton_target

    extra: dict[str, object] = {"engine": "llmpipe", "path": "inprocess" if spec.in_process else "triton"}
    if spec.precision:
        extra["precision"] = spec.precision
    label = f"llmpipe-{spec.precision or 'engine'}"
    if spec.log_probs:
        extra["workload"] = LOG_PROBS_WORKLOAD
        label += f"-{LOG_PROBS_WORKLOAD}"
    counting = EnsembleCounting(spec.log_probs, spec.tokenizer)
    if spec.in_process:
        from pipeline.bench.clients.inprocess import InProcessTarget

        results = []
        for mode in spec.speculation or (spec.cfg.speculative.mode,):
            run_extra = (
                {**extra, "speculation": mode, "workload": spec.workload} if spec.speculation else extra
            )
            engine = InProcessTarget.from_engine_dir(
                stage_output(spec.cfg, "engine"),
                engine_args=EngineArgs(
                    stream_interval=spec.cfg.serving.stream_interval,
                    speculation=speculation_args(spec.cfg, mode),
                ),
                name=f"{label}-{mode}" if spec.speculation else label,
                end_id=spec.end_id,
                min_tokens_equal_max=spec.min_tokens_equal_max,
                log_probs=spec.log_probs,
            )
            try:
                results += run_target(engine, requests, warmup, plan, run_extra)
            finally:
                engine.close()
        return results
    if spec.protocol == "openai":
        from pipeline.bench.clients.openai import OpenAITarget

        if spec.endpoint is None:
            raise ConfigError("--protocol openai needs the API's URL (a running `llmpipe serve`)")
        api = OpenAITarget(spec.endpoint, spec.min_tokens_equal_max, name=f"{label}-openai")
        try:
            return run_target(api, requests, warmup, plan, {**extra, "path": "openai"})
        finally:
            api.close()
    if spec.endpoint is not None:
        client = triton_target(
            spec.endpoint, spec.model_name, spec.min_tokens_equal_max, f"{label}-triton", counting
        )
        try:
            return run_target(client, requests, warmup, plan, extra)
        finally:
            client.close()
    from pipeline.serving.server.command import ServerOptions
    from pipeline.serving.server.launcher import TritonServer

    repo = packaged_repository(spec.cfg)
    print(f"starting tritonserver on {repo} ...", file=sys.stderr)
    with TritonServer(
        ServerOptions(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0)
    ) as server:
        url = f"http://{server.http_url}" if spec.protocol == "http" else f"grpc://{server.grpc_url}"
        client = triton_target(url, spec.model_name, spec.min_tokens_equal_max, f"{label}-triton", counting)
        try:
            return run_target(client, requests, warmup, plan, extra)
        finally:
            client.close()
