"""A trtllm_pytorch model repository in a REAL tritonserver (Triton 2.51's Python backend), its loader 1/model.py
pointed at the stand-in of the llmapi model.py NVIDIA's image ships (tests/stand_in_llmapi_model): Triton's
stub imports the loader, which runs the stand-in with its helpers, in the model's version folder, so the
checkpoint model.yaml names relatively opens; model.yaml's triton_config reaches Triton through
auto_complete_config. Without the model.py, loading fails with the loader's one line."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from pipeline.backends.trtllm_pytorch.package import UPSTREAM_MODEL_ENV
from pipeline.errors import ServingError
from pipeline.serving.server.command import ServerOptions
from pipeline.serving.server.launcher import TritonServer
from tests.serving_helpers import require_tritonserver
from tests.trtllm_pytorch_builds import STAND_IN_LLMAPI_MODEL, build, write_config

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def repo(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_tritonserver()
    return build(write_config(tmp_path_factory.mktemp("pt-triton") / "tiny-pt.yaml", tiny_llama_dir))[0]


def _server(repo: Path) -> TritonServer:
    return TritonServer(ServerOptions(repo, http_port=0, grpc_port=0, metrics_port=0), ready_timeout_s=120)


def _get(url: str, body: dict[str, object] | None = None) -> dict[str, object]:
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=30) as reply:
        return dict(json.loads(reply.read()))


def test_triton_runs_the_images_llmapi_model_through_the_loader(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(UPSTREAM_MODEL_ENV, str(STAND_IN_LLMAPI_MODEL))
    version = repo / "tensorrt_llm" / "1"
    with _server(repo) as server:
        base = f"http://{server.http_url}/v2/models/tensorrt_llm"
        config = _get(f"{base}/config")
        # model.yaml's triton_config, handed over by the stand-in's auto_complete_config (as upstream's).
        assert config["model_transaction_policy"] == {"decoupled": True}
        assert config.get("max_batch_size", 0) == 0
        answer = _get(f"{base}/generate", {"text_input": "Hello"})
    seen = json.loads(str(answer["text_output"]))
    assert seen["cwd"] == str(version.resolve())
    assert seen["helpers"] == "tests/stand_in_llmapi_model/helpers.py"
    assert seen["model"] == str((version / "checkpoint").resolve()) and seen["model_has_config"] is True


def test_a_server_without_the_llmapi_model_fails_with_the_loaders_line(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(UPSTREAM_MODEL_ENV, str(tmp_path))
    with pytest.raises(ServingError) as failed, _server(repo):
        pass
    assert f"{tmp_path / 'model.py'} not found: this repository runs TensorRT-LLM's llmapi model" in str(
        failed.value
    )
