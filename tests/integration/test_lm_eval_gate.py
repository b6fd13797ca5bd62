"""`llmpipe validate --openai-endpoint`: lm-evaluation-harness (its own venv, `make eval-deps`) scores the
served SmolLM2-135M-Instruct through the OpenAI API (a generation task through local-chat-completions, a
multiple-choice task through local-completions with echo and log-probs on token-id prompts) and its hf
model on the same checkpoint; the gate passes when every score agrees within lm-eval's stderr."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli.main import cli
from pipeline.errors import MissingArtifactError
from pipeline.validate.lm_eval_run import lm_eval_python
from tests.fixtures_models import REPO_ROOT
from tests.serving_helpers import require_tritonserver

EVAL_VENV = REPO_ROOT / ".cache" / "eval-venv"


@pytest.fixture(scope="module")
def eval_venv() -> Path:
    try:
        lm_eval_python(str(EVAL_VENV))
    except MissingArtifactError as err:
        pytest.skip(f"{err} ({err.hint}; `make test-slow` does)")
    return EVAL_VENV


@pytest.fixture(scope="module")
def served_smollm2(
    smollm2_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, str]]:
    """(config, OpenAI base URL) of SmolLM2-135M-Instruct built fp32 and served by tritonserver."""
    from pipeline.serving.openai import BackgroundFrontEnd, OpenAIServerOptions
    from pipeline.serving.server.command import ServerOptions
    from pipeline.serving.server.launcher import TritonServer, free_port

    require_tritonserver()
    folder = tmp_path_factory.mktemp("lm-eval")
    data = {
        "name": "smollm2-lm-eval",
        "source": {"kind": "local", "path": str(smollm2_hf_dir)},
        "workdir": str(folder / "build"),
        "engine": {"max_batch_size": 8, "max_input_len": 1024, "max_seq_len": 2048, "max_num_tokens": 512},
        "kv_cache": {"tokens_per_block": 32, "max_tokens": 32768, "enable_block_reuse": True},
        "scheduler": {"enable_chunked_context": True},
    }
    config = folder / "smollm2-lm-eval.yaml"
    config.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(cli, ["build", str(config)])
    assert result.exit_code == 0, result.output
    options = ServerOptions(folder / "build" / "model_repo", http_port=0, grpc_port=0, metrics_port=0)
    with TritonServer(options, ready_timeout_s=240) as server:
        front_options = OpenAIServerOptions(options.model_repository, server.grpc_url, port=free_port())
        with BackgroundFrontEnd(front_options) as front:
            yield config, f"{front.url}/v1"


@pytest.mark.slow
@pytest.mark.triton
def test_lm_eval_scores_of_the_endpoint_equal_hf(eval_venv: Path, served_smollm2: tuple[Path, str]) -> None:
    config, url = served_smollm2
    start = time.monotonic()
    result = CliRunner().invoke(
        cli,
        ["validate", str(config), "--openai-endpoint", url, "--set", f"validation.lm_eval.venv={eval_venv}"],
    )
    seconds = time.monotonic() - start
    assert result.exit_code == 0, result.output
    report = json.loads((config.parent / "build" / "validation-lm-eval" / "lm_eval.json").read_text())
    rows = {(r["task"], r["metric"]): r for r in report["rows"]}
    assert {("llmpipe_qa", "exact_match"), ("llmpipe_choice", "acc"), ("llmpipe_choice", "acc_norm")} <= set(
        rows
    )
    assert all(r["status"] == "pass" for r in rows.values())
    # a real model gets most of the easy choices right: the scores are not both zero by accident
    assert rows[("llmpipe_choice", "acc")]["endpoint"] > 0.5
    print(f"lm-eval gate: {seconds:.0f} s in all, per run {report['seconds']}")
