"""The llmapi model repository (serving.interface=llmapi) against upstream's llmapi Triton model as recorded in
tests/contract/upstream/llmapi_*.txt: config.pbtxt declares exactly upstream's tensors, model.yaml only
upstream's keys; and the build config refuses llmapi on the TensorRT engine route."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from tritonclient.grpc import model_config_pb2

from pipeline.config.build_config import build_config_from_dict
from pipeline.errors import ConfigError
from pipeline.serving.repository.pbtxt import parse_model_config
from pipeline.serving.repository.render import render_model_repository
from tests.serving_helpers import tiny_config

UPSTREAM = Path(__file__).resolve().parents[1] / "contract" / "upstream"
CITATION = re.compile(
    r"^# NVIDIA/TensorRT-LLM:triton_backend/all_models/llmapi/tensorrt_llm/\S+@[0-9a-f]{40} \(read with .+\)$"
)
Tensor = tuple[str, str, str, tuple[int, ...], bool]  # kind, name, data_type, dims, optional


def _rows(name: str) -> list[list[str]]:
    lines = (UPSTREAM / name).read_text(encoding="utf-8").splitlines()
    assert CITATION.match(lines[0]), lines[0]
    return [
        line.split(" ", 1 if name.endswith("yaml.txt") else -1) for line in lines if not line.startswith("#")
    ]


def recorded_tensors() -> set[Tensor]:
    rows = [row for row in _rows("llmapi_config_pbtxt.txt") if row[0] in ("input", "output")]
    return {
        (kind, name, dtype, tuple(int(d) for d in dims.strip("[]").split(",")), flag == "optional")
        for kind, name, dtype, dims, flag in rows
    }


def tensors(config: Any) -> set[Tensor]:
    def dtype(tensor: Any) -> str:
        return str(model_config_pb2.DataType.Name(tensor.data_type))

    return {("input", t.name, dtype(t), tuple(t.dims), t.optional) for t in config.input} | {
        ("output", t.name, dtype(t), tuple(t.dims), False) for t in config.output
    }


def differences(config: Any) -> tuple[set[Tensor], set[Tensor]]:
    """(tensors upstream does not declare, upstream's tensors we lack)."""
    ours, upstream = tensors(config), recorded_tensors()
    return ours - upstream, upstream - ours


def _render(hf_dir: Path, engine_dir: Path, out: Path, decoupled: bool = True) -> Path:
    cfg = tiny_config(hf_dir, decoupled=decoupled, serving={"interface": "llmapi"})
    facts = render_model_repository(cfg, engine_dir, out)
    assert facts["models"] == ["tensorrt_llm"] and facts["interface"] == "llmapi"
    return out


@pytest.fixture(scope="module")
def repo(tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _render(tiny_llama_dir, tiny_engine_dir, tmp_path_factory.mktemp("llmapi") / "model_repo")


def _config(repo: Path) -> Any:
    return parse_model_config("tensorrt_llm", (repo / "tensorrt_llm" / "config.pbtxt").read_text())


def test_config_pbtxt_declares_exactly_upstreams_tensors(repo: Path) -> None:
    config = _config(repo)
    extra, missing = differences(config)
    assert extra == set(), f"not in upstream's llmapi config.pbtxt: {sorted(extra)}"
    assert missing == set(), f"upstream's llmapi config.pbtxt has, ours lacks: {sorted(missing)}"
    meta = {row[1]: row[2] for row in _rows("llmapi_config_pbtxt.txt") if row[0] == "model"}
    assert (config.name, config.backend) == (meta["name"], meta["backend"])
    # As upstream: batching and the transaction policy come from model.yaml, not from config.pbtxt.
    assert config.max_batch_size == 0 and not config.HasField("model_transaction_policy")


def test_the_comparison_catches_an_added_and_a_missing_tensor(repo: Path) -> None:
    config = _config(repo)
    config.input.append(model_config_pb2.ModelInput(name="max_tokens", data_type=model_config_pb2.TYPE_INT32))
    del config.output[-1]
    config.input[0].data_type = model_config_pb2.TYPE_INT32  # text_input with another type
    extra, missing = differences(config)
    assert {t[1] for t in extra} == {"max_tokens", "text_input"}
    assert {t[1] for t in missing} == {"text_input", "total_draft_tokens"}
    config.input[1].dims[:] = [2]  # image_url with other dims
    assert "image_url" in {t[1] for t in differences(config)[0]}


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@pytest.mark.parametrize("decoupled", [True, False])
def test_model_yaml_carries_only_upstreams_keys(
    repo: Path, tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path: Path, decoupled: bool
) -> None:
    rendered = repo if decoupled else _render(tiny_llama_dir, tiny_engine_dir, tmp_path, decoupled=False)
    version = rendered / "tensorrt_llm" / "1"
    model_yaml = _flat(yaml.safe_load((version / "model.yaml").read_text()))
    upstream_keys = {row[0] for row in _rows("llmapi_model_yaml.txt")}
    assert set(model_yaml) - upstream_keys == set()
    assert (
        model_yaml["triton_config.decoupled"] is decoupled and model_yaml["triton_config.max_batch_size"] == 0
    )
    assert model_yaml["backend"] == "pytorch" and model_yaml["tensor_parallel_size"] == 1
    assert (version / model_yaml["model"] / "config.json").is_file()  # the engine, relative to model.yaml
    assert (version / model_yaml["model"] / "tokenizer" / "tokenizer.json").is_file()


def test_the_repository_holds_the_one_llmapi_model(repo: Path) -> None:
    assert sorted(p.name for p in repo.iterdir()) == ["tensorrt_llm"]
    assert "LlmApiModel as TritonPythonModel" in (repo / "tensorrt_llm" / "1" / "model.py").read_text()
    params = {k: v.string_value for k, v in _config(repo).parameters.items()}
    # the engine's settings, as for the inflight_batcher_llm model; the engine path lives in model.yaml
    assert params["max_tokens_in_paged_kv_cache"] == "16384" and "gpt_model_path" not in params
    assert params["exclude_input_in_output"] == "false" and params["skip_special_tokens"] == "true"


def test_the_interface_defaults_to_inflight_batcher_llm_and_llmapi_needs_the_torch_backend(
    tiny_llama_dir: Path,
) -> None:
    assert tiny_config(tiny_llama_dir).serving.interface == "inflight_batcher_llm"
    data = tiny_config(tiny_llama_dir).model_dump(mode="json")
    data.update(backend="trtllm", serving={**data["serving"], "interface": "llmapi"})
    with pytest.raises(
        ConfigError, match=r"serving.interface=llmapi .* backend=trtllm .*inflight_batcher_llm"
    ):
        build_config_from_dict(data)
    data["serving"]["interface"] = "inflight_batcher_llm"
    assert build_config_from_dict(data).backend == "trtllm"
