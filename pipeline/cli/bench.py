"""`llmpipe bench`: load a Triton endpoint or the in-process engine, measure TTFT/ITL/TPOT/throughput,
optionally beside peer engines on the same requests."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from pipeline.cli.options import CONTEXT, overrides_option
from pipeline.errors import ConfigError, MissingArtifactError, ServingError

if TYPE_CHECKING:
    from pipeline.bench.peers import Peer

_URL = re.compile(r"^([a-z]+://)?[\w.-]+:\d+(/v1)?/?$")
_OPENAI_URL = re.compile(r"/v1/?$")


@click.command("bench", context_settings=CONTEXT)
@click.argument("target", metavar="CONFIG|URL")
@click.option(
    "--in-process",
    is_flag=True,
    help="Drive the CONFIG's engine directly (no server): the same requests without the serving path, so "
    "a served run of the same workload beside it shows the serving overhead.",
)
@click.option(
    "--log-probs",
    is_flag=True,
    help="Ask for each token's log-probability, in-process or from the ensemble (whose streamed responses "
    "are then counted exactly by them). A log-probability needs the whole vocabulary's logits, a greedy "
    "token alone does not, so the engine does more work per token. Without it each streamed response's "
    "text is tokenized on its own as it arrives, as genai-perf counts a response (one under "
    "serving.stream_interval holds several tokens).",
)
@click.option(
    "--protocol",
    type=click.Choice(["grpc", "http", "openai"]),
    default="grpc",
    show_default=True,
    help="How to talk to the Triton server started for CONFIG (a URL's scheme decides for a URL). openai: "
    "stream /v1/completions (chat workloads: /v1/chat/completions) from the OpenAI-compatible API of a "
    "running `llmpipe serve` (CONFIG: its serving.host and serving.openai_port; a http://HOST:PORT/v1 URL "
    "picks it too); needs --no-min-tokens-equal-max unless that API takes a min_tokens extension.",
)
@click.option(
    "--model",
    "model_name",
    type=click.Choice(["ensemble", "tensorrt_llm"]),
    default="ensemble",
    show_default=True,
    help="ensemble: text in/out (what users call); tensorrt_llm: token ids, no tokenizer.",
)
@click.option(
    "--concurrency",
    default="1,4,16",
    show_default=True,
    metavar="N[,N...]",
    help="Closed loop: this many requests in flight; a list sweeps.",
)
@click.option(
    "--rate", metavar="R[,R...]", help="Open loop instead: Poisson arrivals at R requests/s (a list sweeps)."
)
@click.option("--max-concurrency", type=click.IntRange(min=1), help="Open loop: cap on requests in flight.")
@click.option(
    "--requests",
    "num_requests",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Measured requests per run.",
)
@click.option(
    "--warmup",
    "num_warmup",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Warm-up requests before each run (not measured; distinct prompts).",
)
@click.option(
    "--duration",
    "max_duration_s",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Stop sending new requests after this long (per run).",
)
@click.option(
    "--dataset",
    metavar="FILE|builtin",
    help='JSONL with {"prompt"|"input_ids", "output_tokens"} per line, or a built-in workload: "builtin" '
    '(the shipped prompts), "code-edit" (edit a function: answers copy the prompt), "summarize" (one-sentence '
    "summaries of short articles). Default: synthetic lengths (--input-mean/--output-mean).",
)
@click.option("--input-mean", type=click.IntRange(min=1), help="Synthetic prompt length mean [128].")
@click.option("--input-stdev", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option(
    "--output-mean",
    type=click.IntRange(min=1),
    help="Output length mean [64]; with --dataset, replaces each line's output_tokens.",
)
@click.option("--output-stdev", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option(
    "--min-tokens-equal-max/--no-min-tokens-equal-max",
    default=True,
    show_default=True,
    help="Force every output to its intended length (min_tokens = max_tokens; EOS ignored).",
)
@click.option(
    "--speculation",
    metavar="MODE[,MODE...]",
    help="With --in-process: run each speculative mode in turn (none, ngram, draft_model; the config's "
    "speculative settings) and report decode tok/s, acceptance rate and accepted tokens per step of each. "
    "Default: the config's speculative.mode (--set speculative.mode=ngram works too).",
)
@click.option(
    "--compare",
    default="",
    metavar="PEERS",
    help="Also run peers on the same requests: hf, llamacpp[-f32|-q8_0|-q4_1], ct2[-float32|-int8]. "
    "Install them with `make bench-deps`.",
)
@click.option(
    "--hf-model",
    type=click.Path(file_okay=False, path_type=Path),
    help="HF checkpoint: the tokenizer and the peers' model. Default with CONFIG: its fetched checkpoint.",
)
@click.option(
    "--gguf",
    type=click.Path(dir_okay=False, path_type=Path),
    help="GGUF for the llama.cpp peers (f32/bf16/Q8_0 are made from it). Default: the config's GGUF source.",
)
@click.option(
    "--precision",
    type=click.Choice(["fp32", "bf16", "int8", "w8a8", "int4"]),
    help="Precision of the target, for its measurement keys and the ratio table. Default with CONFIG: from "
    "quantization.mode.",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("build/peers"),
    show_default=True,
    help="Where converted peer models are kept between runs.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Results folder [build/bench/<time>].",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the workload and the arrivals.")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots (matplotlib not needed then).")
@click.option("--no-progress", is_flag=True, help="No progress bar (for logs).")
@click.option(
    "--chat-template",
    is_flag=True,
    help="Send text prompts as one user turn of the tokenizer's chat template (apply_chat_template), to "
    "every target alike.",
)
@overrides_option("engine.max_batch_size=8")
def bench(
    target: str,
    in_process: bool,
    log_probs: bool,
    protocol: str,
    model_name: str,
    concurrency: str,
    rate: str | None,
    max_concurrency: int | None,
    num_requests: int,
    num_warmup: int,
    max_duration_s: float | None,
    dataset: str | None,
    input_mean: int | None,
    input_stdev: float,
    output_mean: int | None,
    output_stdev: float,
    min_tokens_equal_max: bool,
    speculation: str | None,
    compare: str,
    hf_model: Path | None,
    gguf: Path | None,
    precision: str | None,
    cache_dir: Path,
    out_dir: Path | None,
    seed: int,
    no_plots: bool,
    no_progress: bool,
    chat_template: bool,
    overrides: tuple[str, ...],
) -> None:
    """Benchmark serving: TTFT, ITL, TPOT, e2e latency (mean/p50/p90/p95/p99), output tokens/s, requests/s.

    CONFIG|URL is a build config (a tritonserver is started on its model repository for the run, or with
    --in-process its engine is loaded here) or a running Triton endpoint: host:port or grpc://host:port
    (gRPC streaming), http://host:port (HTTP server-sent events, /v2/models/ensemble/generate_stream), or
    an OpenAI-compatible API: http://host:port/v1 (or --protocol openai).
    Writes results.json, results.csv and plots (throughput and TTFT/ITL percentiles vs concurrency, latency
    CDF) to --out, and prints the table plus the ratios the run measured side by side (llmpipe against
    the --compare peers, prompt lookup against none in a --speculation sweep).

    \b
    Examples:
      llmpipe bench build_configs/smollm2-135m.yaml --in-process --concurrency 1,4,16 --requests 32
      llmpipe bench build_configs/smollm2-135m.yaml --concurrency 16 --dataset builtin --output-mean 128
      llmpipe bench build_configs/smollm2-135m.yaml --in-process --log-probs --concurrency 16 \\
          --dataset builtin --output-mean 128
      llmpipe bench localhost:8001 --hf-model build/smollm2-135m/hf --rate 0.5,1,2 --requests 40
      llmpipe bench http://127.0.0.1:8000 --hf-model build/smollm2-135m/hf --concurrency 4
      llmpipe bench http://127.0.0.1:9000/v1 --hf-model build/smollm2-135m/hf --no-min-tokens-equal-max
      llmpipe bench build_configs/smollm2-135m.yaml --in-process --concurrency 1,16 --compare hf,llamacpp,ct2
      llmpipe bench build_configs/smollm2-135m.yaml --in-process --dataset code-edit --concurrency 1 \\
          --speculation none,ngram --set speculative.max_draft_len=6
    """
    from pipeline.bench import builds, suite
    from pipeline.bench.workloads import LengthSpec, make_workload

    plan = suite.Plan(
        concurrencies=suite.parse_int_list(concurrency, "--concurrency"),
        rates=suite.parse_float_list(rate, "--rate") if rate else [],
        max_concurrency=max_concurrency,
        max_duration_s=max_duration_s,
        seed=seed,
        progress=not no_progress,
    )
    peers = suite.parse_compare(compare) if compare else []
    if peers and plan.rates:
        raise click.UsageError("peers are measured closed-loop: use --concurrency with --compare, not --rate")
    is_url = _URL.match(target) is not None and not Path(target).is_file()
    if is_url and in_process:
        raise click.UsageError("--in-process needs a CONFIG (the engine to load), not a URL")
    if is_url and _OPENAI_URL.search(target):
        protocol = "openai"
    if protocol == "openai" and in_process:
        raise click.UsageError("--protocol openai measures a running server: drop --in-process")
    if protocol == "openai" and model_name != "ensemble":
        raise click.UsageError("the OpenAI API takes text: --model tensorrt_llm does not apply to it")
    if log_probs and (protocol == "openai" or model_name != "ensemble") and not in_process:
        raise click.UsageError(
            "--log-probs applies to --in-process runs and to the Triton ensemble (the OpenAI front-end "
            "returns no log-probs; the tensorrt_llm model's token ids count themselves)"
        )
    modes = tuple(m.strip() for m in (speculation or "").split(",") if m.strip())
    if log_probs and modes:
        raise click.UsageError("--log-probs and --speculation: run them separately")
    if modes and not in_process:
        raise click.UsageError(
            "--speculation needs --in-process: a served engine speculates as its model repository was "
            "packaged (package one config per mode and bench each)"
        )
    cfg = None if is_url else _load_config(target, overrides)
    hf_dir = hf_model or (builds.fetched_checkpoint(cfg) if cfg is not None else None)
    if hf_dir is None:
        raise ConfigError(
            "a URL target needs --hf-model DIR (the checkpoint's tokenizer shapes the workload)"
        )
    tokenizer = _tokenizer(hf_dir)
    requests, warmup = make_workload(
        dataset,
        num_requests,
        num_warmup,
        LengthSpec(input_mean, input_stdev) if input_mean is not None else None,
        LengthSpec(output_mean, output_stdev) if output_mean is not None else None,
        seed,
        tokenizer,
        chat_template=chat_template,
    )
    if precision is None and cfg is not None:
        precision = builds.precision_of(cfg)
    endpoint = target if is_url else None
    if protocol == "openai" and cfg is not None:
        endpoint = _openai_endpoint(cfg)
    ours = suite.OursSpec(
        endpoint=endpoint,
        cfg=cfg,
        in_process=in_process,
        protocol=protocol,
        model_name=model_name,
        min_tokens_equal_max=min_tokens_equal_max,
        precision=precision,
        end_id=tokenizer.eos_token_id,
        speculation=modes,
        workload=_workload_name(dataset),
        log_probs=log_probs,
        tokenizer=tokenizer,
    )
    results = suite.run_llmpipe(ours, requests, warmup, plan)
    if peers:
        gguf_path = gguf or (builds.gguf_source(cfg) if cfg is not None else None)

        def load_peer(family: str, peer_precision: str) -> Peer:
            return suite.make_peer(
                family, peer_precision, hf_dir, tokenizer, cache_dir, max(plan.concurrencies), gguf_path
            )

        results += suite.run_peers(peers, requests, warmup, plan.concurrencies, plan, load_peer)
    meta = {
        "target": target,
        "in_process": in_process,
        "log_probs": log_probs,
        "protocol": protocol,
        "model": model_name,
        "workload": dataset or "synthetic",
        "num_requests": num_requests,
        "num_warmup": num_warmup,
        "min_tokens_equal_max": min_tokens_equal_max,
        "speculation": list(modes),
        "seed": seed,
        "hf_model": str(hf_dir),
    }
    out_dir = out_dir or Path("build") / "bench" / time.strftime("%Y%m%d-%H%M%S")
    text, files = suite.finish(results, out_dir, meta, plots=not no_plots)
    click.echo(text)
    click.echo(f"\nwrote {', '.join(str(f) for f in files)}", err=True)
    _raise_if_failed(results)


def _openai_endpoint(cfg: Any) -> str:
    """The OpenAI API that `llmpipe serve CONFIG` runs: serving.host and serving.openai_port."""
    port = cfg.serving.openai_port
    if port is None:
        raise ConfigError(
            f"{cfg.name} runs no OpenAI API (serving.openai_port is null)",
            hint="pass the API's URL instead, e.g. http://127.0.0.1:9000/v1",
        )
    host = "127.0.0.1" if cfg.serving.host in ("0.0.0.0", "::", "") else cfg.serving.host
    return f"http://{host}:{port}/v1"


def _workload_name(dataset: str | None) -> str:
    from pipeline.bench.workloads import BUILTIN_WORKLOADS

    if dataset is None:
        return "synthetic"
    return dataset if dataset in BUILTIN_WORKLOADS else Path(dataset).stem


def _load_config(path: str, overrides: tuple[str, ...]) -> Any:
    from pipeline.config.build_config import load_build_config

    if not Path(path).is_file():
        raise ConfigError(
            f"{path!r} is neither a build config file nor a host:port URL",
            hint="e.g. llmpipe bench build_configs/smollm2-135m.yaml, or llmpipe bench localhost:8001",
        )
    return load_build_config(path, overrides)


def _tokenizer(hf_dir: Path) -> Any:
    from transformers import AutoTokenizer

    if not (hf_dir / "tokenizer.json").is_file() and not (hf_dir / "tokenizer_config.json").is_file():
        raise MissingArtifactError(
            f"no tokenizer in {hf_dir}", hint="pass --hf-model DIR with an HF tokenizer"
        )
    return AutoTokenizer.from_pretrained(hf_dir)


def _raise_if_failed(results: list[Any]) -> None:
    failed = [rec for r in results for rec in r.records if not rec.ok]
    if failed:
        total = sum(len(r.records) for r in results)
        raise ServingError(
            f"{len(failed)} of {total} requests failed; first error: {failed[0].error}",
            hint="the table above counts them under 'err'; results.json holds each error",
        )
