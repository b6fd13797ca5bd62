"""The child side of pipeline.bench.isolation: `python -m pipeline.bench.peers.worker JOB OUT` loads one
peer with the job's loader, warms it up, runs each batch size and appends every finished run to OUT.

Imports only the standard library and the bench modules that need nothing else, so it runs on a peer's
own venv (where llmpipe and torch may not be installed); the loader brings in what the peer needs.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.bench.isolation import PeerJob, append_run
from pipeline.bench.load import RunResult
from pipeline.bench.peers import Peer
from pipeline.bench.requests import BenchRequest
from pipeline.errors import run_script


def load_peer(job: PeerJob) -> Peer:
    module_name, _, function = job.loader.partition(":")
    loader: Any = getattr(importlib.import_module(module_name), function)
    peer: Peer = loader(job)
    return peer


def load_suite_peer(job: PeerJob) -> Peer:
    """The peers `llmpipe bench --compare` loads in-process (HF, llama.cpp, CTranslate2), on llmpipe's venv."""
    from pipeline.bench import suite

    o = job.options
    if o.get("threads"):
        import torch

        torch.set_num_threads(o["threads"])  # the HF peer follows torch's process-wide setting
    from transformers import AutoTokenizer

    hf_dir = Path(o["hf_dir"])
    return suite.make_peer(
        job.family,
        job.precision,
        hf_dir,
        AutoTokenizer.from_pretrained(hf_dir),
        Path(o["cache_dir"]),
        o["max_batch_size"],
        Path(o["gguf"]) if o.get("gguf") else None,
        o.get("threads"),
    )


def measure(job: PeerJob, out: Path) -> None:
    print(f"peer {job.name}: loading", file=sys.stderr)
    peer = load_peer(job)
    try:
        if job.warmup:
            peer.run(job.warmup, 1)
        for size, requests in job.runs:
            append_run(out, _timed(peer, job, size, requests))
    finally:
        peer.close()


def _timed(peer: Peer, job: PeerJob, size: int, requests: Sequence[BenchRequest]) -> RunResult:
    from pipeline.bench import report

    load = report.load_1m()
    with report.ProgressBar(len(requests), f"{job.name} batch {size}", job.progress) as bar:
        result = peer.run(requests, size, on_record=bar)
    result.extra["load_1m"] = load
    return result


def main() -> int:
    job_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    measure(PeerJob.from_json(job_path.read_text()), out)
    return 0


if __name__ == "__main__":
    run_script(main)
