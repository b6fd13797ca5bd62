"""Soak the served tiny model with mixed traffic (unary, streaming, cancelled streams, bad requests) and check
zero wrong answers, zero leaked KV blocks, RSS growth of tritonserver + stubs <= 10%, server healthy at the end.
`burst()` is the stress half: 48 ensemble streams and 200 /generate requests at once (tests/integration/
test_stress.py repeats it).

    python scripts/soak.py --minutes 20        # `make soak`; tests/integration/test_soak.py runs ~20 s of it
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.util.openmp import default_wait_policy  # noqa: E402

default_wait_policy(os.environ)  # before torch loads

from pipeline.errors import ServingError  # noqa: E402
from pipeline.serving.client import GenerationOptions, GrpcClient, HttpClient  # noqa: E402
from pipeline.serving.server.health import group_processes  # noqa: E402
from pipeline.serving.server.launcher import TritonServer  # noqa: E402

PROMPTS = [f"Soak prompt {i}: " + "word " * i for i in range(6)]
MAX_TOKENS = 16
KINDS = ("unary", "stream", "cancel", "bad")


def expected_texts(engine_dir: Path, max_tokens: int = MAX_TOKENS) -> dict[str, str]:
    from pipeline.runtime.core.sampling_params import SamplingParams
    from pipeline.runtime.engine.llm_engine import LLMEngine
    from pipeline.serving.triton_models.tokenization import PromptEncoder

    encoder = PromptEncoder.from_dir(engine_dir / "tokenizer")
    done = LLMEngine.from_engine_dir(engine_dir).generate(
        [encoder.encode_prompt(p) for p in PROMPTS],
        [SamplingParams(max_tokens=max_tokens, temperature=0.0, end_id=encoder.end_id) for _ in PROMPTS],
    )
    return {
        p: encoder.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
        for p, r in zip(PROMPTS, done, strict=True)
    }


def group_rss_bytes(pgid: int) -> int:
    """RSS of tritonserver and every stub it started (they share its process group)."""
    return sum(process.rss_bytes for process in group_processes(pgid))


def kv_used(server: TritonServer) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("nv_trt_llm_kv_cache_block_metrics{") and 'kv_cache_block_type="used"' in line:
                return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("no KV block gauge on the metrics endpoint")


def _one(kind: str, prompt: str, server: TritonServer, expected: dict[str, str]) -> str:
    """'ok', 'rejected' (a bad request refused as intended), or 'wrong: ...'."""
    options = GenerationOptions(max_tokens=MAX_TOKENS)
    if kind == "unary":
        text = HttpClient(server.http_url).generate(prompt, options).text
    elif kind == "stream":
        with GrpcClient(server.grpc_url, "tensorrt_llm_bls") as client:
            text = client.generate(prompt, GenerationOptions(max_tokens=MAX_TOKENS, stream=True)).text
    elif kind == "cancel":
        with GrpcClient(server.grpc_url) as client:
            chunks = list(
                client.stream(prompt, GenerationOptions(max_tokens=400, stream=True), cancel_after=2)
            )
        return "ok" if len(chunks) == 2 else f"wrong: cancel got {len(chunks)} chunks"
    else:
        try:
            HttpClient(server.http_url).generate(prompt, GenerationOptions(max_tokens=0))
        except ServingError as err:
            return "rejected" if "HTTP 400" in str(err) and "max_tokens'=0" in str(err) else f"wrong: {err}"
        return "wrong: a bad request was accepted"
    return "ok" if text == expected[prompt] else f"wrong: {text!r} != {expected[prompt]!r}"


def soak(
    server: TritonServer, expected: dict[str, str], duration_s: float, workers: int = 4
) -> dict[str, Any]:
    assert server.process is not None
    counts = {kind: {"tried": 0, "ok": 0, "rejected": 0, "wrong": 0} for kind in KINDS}
    failures: list[str] = []
    lock = threading.Lock()
    schedule = itertools.count()
    warm_until = time.monotonic() + min(5.0, duration_s / 6)
    rss: dict[str, int] = {}
    deadline = time.monotonic() + duration_s

    def worker() -> None:
        while time.monotonic() < deadline:
            n = next(schedule)
            kind, prompt = KINDS[n % len(KINDS)], PROMPTS[n % len(PROMPTS)]
            try:
                outcome = _one(kind, prompt, server, expected)
            except Exception as err:  # an error where an answer was due counts as wrong
                outcome = f"wrong: {type(err).__name__}: {err}"
            with lock:
                counts[kind]["tried"] += 1
                counts[kind][outcome.split(":")[0]] += 1
                if outcome.startswith("wrong"):
                    failures.append(f"{kind}: {outcome}")

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for thread in threads:
        thread.start()
    while time.monotonic() < warm_until:
        time.sleep(0.1)
    rss["before"] = group_rss_bytes(server.process.pid)  # after warm-up: lazy imports and arenas are in
    for thread in threads:
        thread.join()
    settle = time.monotonic() + 20
    while kv_used(server) != 0 and time.monotonic() < settle:
        time.sleep(0.1)
    rss["after"] = group_rss_bytes(server.process.pid)
    return {
        "duration_s": duration_s,
        "counts": counts,
        "wrong": sum(c["wrong"] for c in counts.values()),
        "leaked_kv_blocks": kv_used(server),
        "rss_before_mb": rss["before"] / 2**20,
        "rss_after_mb": rss["after"] / 2**20,
        "rss_growth": rss["after"] / rss["before"] - 1,
        "healthy": server.is_ready(),
        "failures": failures[:10],
    }


def burst(
    server: TritonServer, expected: dict[str, str], streams: int = 48, unary: int = 200
) -> dict[str, Any]:
    """One burst of the mix that used to crash a Python stub: `streams` gRPC ensemble streams and `unary`
    /generate requests alternating between the ensemble and tensorrt_llm_bls, all at once."""
    outcomes: list[str] = []
    lock = threading.Lock()

    def request(n: int) -> None:
        prompt = PROMPTS[n % len(PROMPTS)]
        try:
            if n < streams:
                with GrpcClient(server.grpc_url) as client:
                    text = client.generate(prompt, GenerationOptions(max_tokens=MAX_TOKENS, stream=True)).text
            else:
                model = ("ensemble", "tensorrt_llm_bls")[n % 2]
                client = HttpClient(server.http_url, model)
                text = client.generate(prompt, GenerationOptions(max_tokens=MAX_TOKENS)).text
            outcome = "ok" if text == expected[prompt] else f"wrong: {text!r} != {expected[prompt]!r}"
        except Exception as err:  # an error where an answer was due counts as wrong
            outcome = f"wrong: {type(err).__name__}: {err}"
        with lock:
            outcomes.append(outcome)

    return _run_burst(request, streams + unary, outcomes)


def subset_burst(
    server: TritonServer, expected: dict[str, str], streams: int = 48, max_tokens: int = MAX_TOKENS
) -> dict[str, Any]:
    """`streams` gRPC streams at once, alternating ensemble and tensorrt_llm_bls, each asking for log-probs
    but for the text_output output alone: every response carries outputs the request did not ask for, the
    case Triton 2.51's Python stub used to free without the GIL. `expected`: expected_texts(..., max_tokens)."""
    from pipeline.serving.client import collect

    options = GenerationOptions(max_tokens=max_tokens, stream=True, return_log_probs=True)
    outcomes: list[str] = []
    lock = threading.Lock()

    def request(n: int) -> None:
        prompt = PROMPTS[n % len(PROMPTS)]
        try:
            with GrpcClient(server.grpc_url, ("ensemble", "tensorrt_llm_bls")[n % 2]) as client:
                completion = collect(client.stream(prompt, options, outputs=["text_output"]))
            want = expected[prompt]
            outcome = "ok" if completion.text == want else f"wrong: {completion.text!r} != {want!r}"
        except Exception as err:  # an error where an answer was due counts as wrong
            outcome = f"wrong: {type(err).__name__}: {err}"
        with lock:
            outcomes.append(outcome)

    return _run_burst(request, streams, outcomes)


def _run_burst(request: Any, count: int, outcomes: list[str]) -> dict[str, Any]:
    started = time.monotonic()
    threads = [threading.Thread(target=request, args=(n,), daemon=True) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    failures = [o for o in outcomes if o != "ok"]
    return {
        "requests": count,
        "answered": len(outcomes),
        "wrong": len(failures) + (count - len(outcomes)),
        "seconds": time.monotonic() - started,
        "failures": failures[:10],
    }


def passed(report: dict[str, Any]) -> bool:
    return (
        report["wrong"] == 0
        and report["leaked_kv_blocks"] == 0
        and report["rss_growth"] <= 0.10
        and report["healthy"]
        and all(c["tried"] > 0 for c in report["counts"].values())
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(argv)
    from pipeline.serving.repository.render import render_model_repository
    from pipeline.serving.server.command import ServerOptions
    from pipeline.sources.tiny import make_tiny_checkpoint
    from tests.serving_helpers import build_tiny_engine, tiny_config

    with tempfile.TemporaryDirectory(prefix="llmpipe-soak-") as tmp:
        root = Path(tmp)
        make_tiny_checkpoint(root / "hf", arch="llama", seed=0)
        engine_dir = build_tiny_engine(root / "hf", root)
        render_model_repository(tiny_config(root / "hf"), engine_dir, root / "model_repo")
        expected = expected_texts(engine_dir)
        options = ServerOptions(
            root / "model_repo", http_port=0, grpc_port=0, metrics_port=0, exit_timeout_s=20
        )
        with TritonServer(options, ready_timeout_s=240) as server:
            report = soak(server, expected, args.minutes * 60, args.workers)
    print(json.dumps(report, indent=2))
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
