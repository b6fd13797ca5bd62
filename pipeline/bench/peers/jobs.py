"""Which process measures each peer of `make bench`: the loader its worker calls and the interpreter the
worker runs on (llmpipe's own for HF, llama.cpp and CTranslate2; OpenVINO GenAI's venv for it)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.bench import suite
from pipeline.bench.isolation import PeerJob
from pipeline.bench.peers import openvino
from pipeline.bench.requests import BenchRequest

# the peers `--peers` can name: those `llmpipe bench --compare` loads, and OpenVINO GenAI
FAMILIES: dict[str, tuple[str, ...]] = {**suite.PEER_FAMILIES, "openvino": tuple(openvino.PRECISIONS)}
SUITE_LOADER = "pipeline.bench.peers.worker:load_suite_peer"
OPENVINO_LOADER = "pipeline.bench.peers.openvino:load"
OPENVINO_PYTHON = Path("build/bench-venvs/openvino/bin/python")  # made by `make bench-deps`


def plan(
    peers: str,
    runs: tuple[tuple[int, tuple[BenchRequest, ...]], ...],
    warmup: Sequence[BenchRequest],
    options: Mapping[str, Any],
    openvino_python: Path = OPENVINO_PYTHON,
    progress: bool = True,
) -> tuple[list[tuple[PeerJob, str]], list[str]]:
    """(job, interpreter) per peer named in `peers` (as --peers), and a line for each that cannot run."""
    jobs: list[tuple[PeerJob, str]] = []
    problems: list[str] = []
    for family, precision in suite.parse_compare(peers, FAMILIES, "--peers"):
        python, loader = sys.executable, SUITE_LOADER
        if family == "openvino":
            python, loader = str(openvino_python), OPENVINO_LOADER
            if not openvino_python.is_file():
                problems.append(
                    f"peer {family}-{precision}: no OpenVINO venv at {openvino_python} (make bench-deps)"
                )
                continue
        job = PeerJob(family, precision, loader, runs, tuple(warmup), dict(options), progress)
        jobs.append((job, python))
    return jobs, problems
