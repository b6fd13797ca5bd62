"""AIPerf (NVIDIA's benchmark client, `aiperf` on PyPI) against llmpipe's OpenAI-compatible API: serve a
build with `llmpipe serve`, run `aiperf profile` at each concurrency, and write a results page with the
commands, the versions and the tables AIPerf printed. What `make bench-aiperf` runs.

AIPerf runs from a venv of its own (`make bench-aiperf` makes it): pip would resolve it beside llmpipe's
numpy<2, but it brings ~70 packages (a pytest plugin among them) and would downgrade huggingface_hub
(2.x to 1.x), rich, psutil and pillow in the project's venv.

Workload: AIPerf's synthetic prompts (--input-tokens each, before the chat template), --output-tokens
forced with the API's `min_tokens` extension, streamed chat completions; AIPerf counts tokens from the
server's `usage` (--use-server-token-count), so input lengths include the chat template.

    python -m benchmarks.harness.aiperf --out benchmarks/results
    python -m benchmarks.harness.aiperf --concurrency 1 --requests 4 --output-tokens 16   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, MissingArtifactError, ServingError, run_script

AIPERF = Path("build/bench-venvs/aiperf/bin/aiperf")
ARTIFACTS = Path("build/aiperf")  # AIPerf's own exports of the last run, one folder per concurrency
CONFIG = "build_configs/smollm2-135m.yaml"
READY_TIMEOUT_S = 600
# the block of AIPerf's console export that holds the latency and throughput metrics
LLM_METRICS_TITLE = "NVIDIA AIPerf | LLM Metrics"


@dataclass(frozen=True)
class Profile:
    concurrency: int
    command: list[str]
    console_table: str  # the LLM Metrics table as AIPerf printed it
    metrics: dict[str, Any]  # profile_export_aiperf.json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--aiperf", type=Path, default=AIPERF, help="the aiperf executable")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated")
    parser.add_argument(
        "--requests", default="16,48", help="requests per concurrency (one value, or one per concurrency)"
    )
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--warmup-requests", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return parser.parse_args(argv)


def aiperf_command(
    aiperf: Path,
    model: str,
    url: str,
    tokenizer: Path,
    concurrency: int,
    num_requests: int,
    args: argparse.Namespace,
    artifacts: Path,
) -> list[str]:
    return [
        str(aiperf),
        "profile",
        "--model",
        model,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        str(tokenizer),
        "--use-server-token-count",
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(num_requests),
        "--warmup-request-count",
        str(args.warmup_requests),
        "--prompt-input-tokens-mean",
        str(args.input_tokens),
        "--prompt-input-tokens-stddev",
        "0",
        "--prompt-output-tokens-mean",
        str(args.output_tokens),
        "--prompt-output-tokens-stddev",
        "0",
        "--extra-inputs",
        f"min_tokens:{args.output_tokens}",
        "--random-seed",
        str(args.seed),
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--output-artifact-dir",
        str(artifacts),
    ]


def llm_metrics_table(console: str) -> str:
    """The LLM Metrics table (title line through its bottom border) of AIPerf's console export."""
    lines = console.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == LLM_METRICS_TITLE), None)
    if start is None:
        raise ValueError(f"no {LLM_METRICS_TITLE!r} table in AIPerf's console output")
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("└"))
    return "\n".join(line.rstrip() for line in lines[start : end + 1])


def summary_row(profile: Profile) -> dict[str, Any]:
    m = profile.metrics

    def stat(key: str, field: str = "avg") -> float | None:
        value = m.get(key, {}).get(field)
        return None if value is None else float(value)

    count = stat("request_count")
    return {
        "concurrency": profile.concurrency,
        "requests": None if count is None else round(count),
        "errors": sum(int(e.get("count", 0)) for e in m.get("error_summary") or []),
        "output_tok_s": stat("output_token_throughput"),
        "req_s": stat("request_throughput"),
        "ttft_avg_ms": stat("time_to_first_token"),
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p99_ms": stat("time_to_first_token", "p99"),
        "itl_avg_ms": stat("inter_token_latency"),
        "latency_avg_ms": stat("request_latency"),
        "isl": stat("input_sequence_length"),
        "osl": stat("output_sequence_length"),
    }


SUMMARY_COLUMNS = (
    ("concurrency", "concurrency"),
    ("requests", "requests"),
    ("errors", "errors"),
    ("output_tok_s", "output tok/s"),
    ("req_s", "req/s"),
    ("ttft_avg_ms", "TTFT avg ms"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("itl_avg_ms", "ITL avg ms"),
    ("latency_avg_ms", "latency avg ms"),
    ("isl", "ISL"),
    ("osl", "OSL"),
)


def _wait_ready(url: str, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ServingError(f"llmpipe serve exited with {server.returncode}", hint=f"its log: {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise ServingError(
        f"the OpenAI API at {url} was not ready after {READY_TIMEOUT_S} s", hint=f"its log: {log}"
    )


def _stop(server: subprocess.Popen[bytes]) -> None:
    """As Ctrl-C stops `llmpipe serve` (it stops tritonserver and the API first); killed if it hangs."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def server_incidents(log: str) -> list[str]:
    """The lines of `llmpipe serve`'s log that say tritonserver or a model's stub died, or was restarted."""
    return [
        line.strip() for line in log.splitlines() if line.startswith(("error:", "restarting tritonserver"))
    ]


def profile_all(args: argparse.Namespace, workdir: Path = ARTIFACTS) -> tuple[list[Profile], str, list[str]]:
    """Serve the build, run AIPerf at each concurrency; (profiles, the served model's name, what the
    server's log says went wrong while serving)."""
    from pipeline.bench.builds import ensure_built
    from pipeline.bench.suite import parse_int_list
    from pipeline.serving.server.launcher import free_port

    concurrencies = parse_int_list(args.concurrency, "--concurrency")
    counts = parse_int_list(args.requests, "--requests")
    if len(counts) not in (1, len(concurrencies)):
        raise ConfigError(
            f"--requests: give one count, or one per --concurrency value, got {args.requests!r}"
        )
    counts = counts * len(concurrencies) if len(counts) == 1 else counts
    build = ensure_built(args.config, until="package")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "pipeline", "serve", args.config, "--openai-port", str(port)]
    serve += ["--http-port", "0", "--grpc-port", "0", "--metrics-port", str(free_port())]
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "serve.log"
    with log.open("wb") as out:
        server = subprocess.Popen(serve, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, server, log)
        profiles = []
        for concurrency, num_requests in zip(concurrencies, counts, strict=True):
            artifacts = workdir / f"c{concurrency}"
            shutil.rmtree(artifacts, ignore_errors=True)
            command = aiperf_command(
                args.aiperf, build.cfg.name, url, build.hf_dir, concurrency, num_requests, args, artifacts
            )
            print(f"$ {shlex.join(command)}", file=sys.stderr)
            subprocess.run(command, check=True, stdout=sys.stderr)
            profiles.append(
                Profile(
                    concurrency,
                    command,
                    llm_metrics_table((artifacts / "profile_export_console.txt").read_text()),
                    json.loads((artifacts / "profile_export_aiperf.json").read_text()),
                )
            )
    finally:
        _stop(server)
    return profiles, build.cfg.name, server_incidents(log.read_text(errors="replace"))


def versions(aiperf: Path) -> dict[str, str]:
    import platform

    import pipeline

    found = subprocess.run([str(aiperf), "--version"], capture_output=True, text=True, check=True)
    return {
        "aiperf": found.stdout.strip().splitlines()[-1],
        "llmpipe": pipeline.__version__,
        "python": platform.python_version(),
    }


def page(
    args: argparse.Namespace,
    model: str,
    profiles: list[Profile],
    facts: dict[str, str],
    incidents: list[str],
) -> str:
    from pipeline.bench import report

    command = "python -m benchmarks.harness.aiperf " + shlex.join(sys.argv[1:])
    lines = [
        f"# AIPerf against llmpipe's OpenAI-compatible API ({model})",
        "",
        f"Command: `{command}` (`make bench-aiperf`)",
        "",
        f"Versions: AIPerf {facts['aiperf']} (its own venv), llmpipe {facts['llmpipe']}, Python "
        f"{facts['python']}; served by `llmpipe serve {args.config}` (Triton on CPU, the API over the "
        f"tensorrt_llm_bls model), on {report.machine_tag()}; 1-minute load average at the end "
        f"{report.load_1m()} ({os.cpu_count()} cores: above that, other processes competed).",
        "",
        f"Workload: AIPerf's synthetic prompts of {args.input_tokens} tokens (ISL below counts the chat "
        f"template too: AIPerf used the server's usage counts), {args.output_tokens} output tokens forced with "
        f"`min_tokens`, streamed /v1/chat/completions, {args.warmup_requests} warm-up requests per run.",
        "",
        report.markdown_table([summary_row(p) for p in profiles], SUMMARY_COLUMNS),
    ]
    if incidents:
        lines += [
            "",
            "The server's log while AIPerf ran (`llmpipe serve` restarts a tritonserver that dies):",
            "",
        ]
        lines += [f"- `{line}`" for line in incidents]
    for p in profiles:
        lines += ["", f"## Concurrency {p.concurrency}", "", f"`{shlex.join(p.command)}`", ""]
        lines += ["```", p.console_table, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.aiperf.is_file():
        raise MissingArtifactError(
            f"no aiperf at {args.aiperf}", hint="make bench-aiperf (it makes AIPerf's venv)"
        )
    profiles, model, incidents = profile_all(args)
    from pipeline.bench import report

    path = args.out / f"{time.strftime('%Y-%m-%d')}-{report.machine_tag()}-aiperf.md"
    path.write_text(page(args, model, profiles, versions(args.aiperf), incidents))
    print(report.format_table([summary_row(p) for p in profiles], SUMMARY_COLUMNS))
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_script(main)
