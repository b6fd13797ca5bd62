"""The OpenVINO GenAI peer for real: a tiny random Llama exported by optimum-intel and run by
ContinuousBatchingPipeline, in a worker on OpenVINO's own venv (made by `make bench-deps`), through the
same isolation `make bench` uses. Outputs are forced to their length, so random weights do."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipeline.bench.comparisons import measurements
from pipeline.bench.isolation import run_isolated
from pipeline.bench.peers import jobs
from pipeline.bench.requests import BenchRequest

REPO_ROOT = Path(__file__).resolve().parents[2]
OPENVINO_PYTHON = REPO_ROOT / jobs.OPENVINO_PYTHON


@pytest.mark.slow
def test_openvino_peer_streams_forced_lengths_in_its_own_venv(tiny_llama_dir: Path, tmp_path: Path) -> None:
    if not OPENVINO_PYTHON.is_file():
        pytest.skip(f"no OpenVINO venv at {OPENVINO_PYTHON} (make bench-deps)")
    requests = tuple(
        BenchRequest(index=i, output_tokens=5 + i, input_ids=tuple(range(10, 20 + 3 * i))) for i in range(4)
    )
    options = {"hf_dir": str(tiny_llama_dir), "cache_dir": str(tmp_path), "max_batch_size": 4, "threads": 2}
    planned, problems = jobs.plan(
        "openvino-fp32", ((1, requests[:2]), (4, requests)), (), options, OPENVINO_PYTHON
    )
    assert problems == []
    job, python = planned[0]
    outcome = run_isolated(job, python, timeout_s=600)
    assert outcome.failure is None
    single, batched = outcome.results
    assert (single.system, single.mode, single.concurrency, batched.concurrency) == (
        "openvino-fp32",
        "closed",
        1,
        4,
    )
    for result, expected in ((single, requests[:2]), (batched, requests)):
        assert [r.error for r in result.records] == [None] * len(expected)
        by_index = {r.index: r for r in result.records}
        assert [by_index[r.index].num_output_tokens for r in expected] == [r.output_tokens for r in expected]
    # 4 in flight at once: they overlap in time rather than run one after the other
    starts, ends = [r.start for r in batched.records], [r.end for r in batched.records]
    assert max(starts) < min(ends)
    keys = measurements(outcome.results)
    assert keys["openvino.fp32.c4_tok_s"] > 0 and keys["openvino.fp32.single_decode_tok_s"] > 0
    exports = list(tmp_path.glob("openvino-*-weight-format-fp32/openvino_model.xml"))
    assert len(exports) == 1  # kept for the next run to reuse


@pytest.mark.slow
def test_openvino_bf16_runs_where_the_cpu_has_bf16_and_says_why_not_elsewhere(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    if not OPENVINO_PYTHON.is_file():
        pytest.skip(f"no OpenVINO venv at {OPENVINO_PYTHON} (make bench-deps)")
    capabilities = subprocess.run(
        [
            str(OPENVINO_PYTHON),
            "-c",
            "import openvino; print(*openvino.Core().get_property('CPU', 'OPTIMIZATION_CAPABILITIES'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    requests = (BenchRequest(index=0, output_tokens=3, input_ids=tuple(range(10, 20))),)
    options = {"hf_dir": str(tiny_llama_dir), "cache_dir": str(tmp_path), "max_batch_size": 1, "threads": 2}
    planned, problems = jobs.plan("openvino-bf16", ((1, requests),), (), options, OPENVINO_PYTHON)
    assert problems == []
    job, python = planned[0]
    outcome = run_isolated(job, python, timeout_s=600)
    if "BF16" in capabilities:
        assert outcome.failure is None
        assert [r.num_output_tokens for r in outcome.results[0].records] == [3]
    else:
        assert outcome.failure is not None
        assert "no bf16 inference on this CPU" in outcome.failure and "AVX512_BF16 or AMX" in outcome.failure
        assert outcome.results == []
        assert not list(tmp_path.glob("openvino-*"))  # refused before exporting anything
