"""Which process measures each peer of `make bench`: llmpipe's interpreter for the peers it loads itself,
OpenVINO GenAI's own venv for OpenVINO, and a line instead of a job when that venv is missing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.bench.isolation import PeerJob
from pipeline.bench.peers import jobs
from pipeline.bench.requests import BenchRequest
from pipeline.errors import ConfigError

REQUESTS = (BenchRequest(index=0, output_tokens=4, input_ids=(1, 2)),)
RUNS = ((1, REQUESTS), (16, REQUESTS))


def test_openvino_runs_on_its_venv_and_the_others_on_ours(tmp_path: Path) -> None:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.touch()
    planned, problems = jobs.plan("hf,openvino-int8", RUNS, REQUESTS, {"threads": 2}, python, progress=False)
    assert problems == []
    assert [(job.name, job.loader, interpreter) for job, interpreter in planned] == [
        ("hf-fp32", jobs.SUITE_LOADER, sys.executable),
        ("openvino-int8", jobs.OPENVINO_LOADER, str(python)),
    ]
    job = planned[1][0]
    assert (job.runs, job.warmup, job.options) == (RUNS, REQUESTS, {"threads": 2})
    assert PeerJob.from_json(job.to_json()) == job


def test_every_openvino_precision_is_planned_and_a_missing_venv_is_reported(tmp_path: Path) -> None:
    planned, problems = jobs.plan("openvino,ct2-int8", RUNS, (), {}, tmp_path / "none" / "python")
    assert [job.name for job, _ in planned] == ["ct2-int8"]
    assert len(problems) == 4
    assert problems[0].startswith("peer openvino-fp32: no OpenVINO venv at ")
    assert "make bench-deps" in problems[0]


def test_an_unknown_peer_names_the_option_and_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        jobs.plan("openvino-fp8", RUNS, (), {})
    assert err.value.message == "--peers: unknown peer 'openvino-fp8'"
    assert err.value.hint is not None and "openvino (fp32|bf16|int8|int4)" in err.value.hint
