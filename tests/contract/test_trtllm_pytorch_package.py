"""The trtllm_pytorch backend's model repository: `llmpipe build` of the tiny model through package, its
config.pbtxt and model.yaml against upstream's recorded llmapi model (tests/contract/upstream/llmapi_*.txt) and
TensorRT-LLM 1.1.0's recorded LLM API fields, the checkpoint inside it, the trtllm-serve launch files, and the
loader 1/model.py run against a stand-in of the llmapi model.py NVIDIA's image ships
(tests/stand_in_llmapi_model), through tests/stub_pb_utils.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from pipeline.backends.trtllm_pytorch.llm_args import LLM_API_ARGS_FILE, TRTLLM_SERVE_OPTIONS_FILE
from pipeline.backends.trtllm_pytorch.package import UPSTREAM_MODEL_ENV
from pipeline.backends.trtllm_pytorch.upstream import interface
from pipeline.cli.main import cli
from pipeline.serving.repository.pbtxt import parse_model_config
from tests import stub_pb_utils as pb
from tests.integration.test_llmapi_contract import _flat, _rows, differences
from tests.trtllm_pytorch_builds import STAND_IN_LLMAPI_MODEL as STAND_IN
from tests.trtllm_pytorch_builds import build, write_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CONFIG = REPO_ROOT / "build_configs" / "smollm2-135m-trtllm-pytorch-fp8.yaml"


@pytest.fixture(scope="module")
def built(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return build(write_config(tmp_path_factory.mktemp("pt") / "tiny-pt.yaml", tiny_llama_dir))


@pytest.fixture(scope="module")
def repo(built: tuple[Path, str]) -> Path:
    return built[0]


def test_build_packages_the_checkpoint_behind_the_llmapi_model_and_says_how_to_serve_it(
    built: tuple[Path, str], tiny_llama_dir: Path
) -> None:
    repo, output = built
    version = repo / "tensorrt_llm" / "1"
    assert sorted(p.name for p in repo.iterdir()) == [
        "manifest.json", "tensorrt_llm", "trtllm_serve.sh", TRTLLM_SERVE_OPTIONS_FILE,
    ]  # fmt: skip
    assert sorted(p.name for p in version.iterdir()) == ["checkpoint", "model.py", "model.yaml"]
    engine = repo.parent / "engine"
    checkpoint = version / "checkpoint"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (checkpoint / name).read_bytes() == (tiny_llama_dir / name).read_bytes()
        assert os.stat(checkpoint / name).st_ino == os.stat(engine / name).st_ino  # a hard link
    # The engine folder's argument files name that folder: the repository carries its own.
    assert (
        not (checkpoint / LLM_API_ARGS_FILE).exists()
        and not (checkpoint / TRTLLM_SERVE_OPTIONS_FILE).exists()
    )
    document = yaml.safe_load((version / "model.yaml").read_text())
    engine_args = yaml.safe_load((engine / LLM_API_ARGS_FILE).read_text())
    assert document.pop("triton_config") == {"max_batch_size": 0, "decoupled": True}
    assert document.pop("backend") == "pytorch"
    assert document == {**engine_args, "model": "checkpoint"}  # the engine's arguments, on the copy here
    facts = json.loads((repo / "manifest.json").read_text())["facts"]
    assert (facts["backend"], facts["interface"], facts["models"]) == (
        "trtllm_pytorch",
        "llmapi",
        ["tensorrt_llm"],
    )
    assert facts["engine"] == "tensorrt_llm/1/checkpoint"
    assert f"serve it with Triton: llmpipe serve {repo}" in output
    assert (
        f"or with TensorRT-LLM's own OpenAI-compatible server (trtllm-serve): {repo / 'trtllm_serve.sh'}"
        in output
    )


def test_config_pbtxt_declares_upstreams_tensors_and_no_parameters(repo: Path) -> None:
    config = parse_model_config("tensorrt_llm", (repo / "tensorrt_llm" / "config.pbtxt").read_text())
    extra, missing = differences(config)
    assert extra == set() and missing == set(), (sorted(extra), sorted(missing))
    meta = {row[1]: row[2] for row in _rows("llmapi_config_pbtxt.txt") if row[0] == "model"}
    assert (config.name, config.backend) == (meta["name"], meta["backend"])
    # Upstream's file sets no parameters, no max_batch_size and no transaction policy: model.yaml does.
    assert not config.parameters and config.max_batch_size == 0
    assert not config.HasField("model_transaction_policy")


def _unrecorded(document: dict[str, Any]) -> list[str]:
    """Dotted keys of a model.yaml that neither upstream's model.yaml nor TensorRT-LLM 1.1.0's recorded LLM
    API classes have."""
    recorded = {row[0] for row in _rows("llmapi_model_yaml.txt")}
    classes = interface().classes
    unknown = []
    for key in _flat(document):
        if key in recorded:
            continue
        *path, name = key.split(".")
        cls: str | None = "model.yaml"  # TorchLlmArgs plus triton_config
        for part in path:
            field = classes.get(cls or "", {}).get(part)
            cls = field.target if field is not None else None
        if name not in classes.get(cls or "", {}):
            unknown.append(key)
    return unknown


def test_model_yaml_keys_are_in_the_recorded_lists(repo: Path) -> None:
    document = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert _unrecorded(document) == []
    assert _unrecorded({**document, "kv_cache_config": {"dtype": "fp8", "tokens_per_page": 1}}) == [
        "kv_cache_config.tokens_per_page"
    ]
    assert _unrecorded({**document, "triton_config": {"decoupled": True, "instances": 2}}) == [
        "triton_config.instances"
    ]


def test_trtllm_serve_script_runs_trtllm_serve_on_the_relocated_checkpoint(
    repo: Path, tmp_path: Path
) -> None:
    moved = tmp_path / "moved" / "repo"
    # The repository is relocatable: the script and its YAML name paths inside it.
    shutil.copytree(repo, moved)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "trtllm-serve"  # records where and how it was started
    stand_in.write_text(f'#!/bin/sh\npwd > {tmp_path}/cwd\nprintf "%s\\n" "$@" > {tmp_path}/argv\n')
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    subprocess.run([str(moved / "trtllm_serve.sh"), "--port", "9001"], env=env, check=True, cwd=tmp_path)
    assert (tmp_path / "cwd").read_text().strip() == str(moved)
    assert (tmp_path / "argv").read_text().splitlines() == [
        "serve", "tensorrt_llm/1/checkpoint", "--backend", "pytorch", "--host", "127.0.0.1", "--port", "8000",
        "--extra_llm_api_options", TRTLLM_SERVE_OPTIONS_FILE, "--port", "9001",
    ]  # fmt: skip
    assert (moved / "tensorrt_llm/1/checkpoint/config.json").is_file()
    options = yaml.safe_load((moved / TRTLLM_SERVE_OPTIONS_FILE).read_text())
    model_yaml = yaml.safe_load((moved / "tensorrt_llm/1/model.yaml").read_text())
    assert options == {k: v for k, v in model_yaml.items() if k not in ("model", "backend", "triton_config")}


# ---- the loader, 1/model.py -------------------------------------------------------------------------------
@pytest.fixture
def load_model_py(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Loads a repository's tensorrt_llm/1/model.py as Triton's stub does (module `model`, its folder as
    get_model_dir()), with tests/stub_pb_utils.py as triton_python_backend_utils; undoes what the loader
    changes in this process (working directory, sys.path, imported modules)."""
    pb.install()
    monkeypatch.chdir(Path.cwd())  # restored afterwards: the loader changes directory
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)

    def load(version: Path) -> ModuleType:
        monkeypatch.setattr(pb, "model_dir", str(version))
        spec = importlib.util.spec_from_file_location("model", version / "model.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_the_loader_runs_the_images_llmapi_model_on_the_checkpoint(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, load_model_py: Any
) -> None:
    moved = tmp_path / "elsewhere"
    shutil.copytree(repo, moved)
    version = (moved / "tensorrt_llm" / "1").resolve()
    monkeypatch.setenv(UPSTREAM_MODEL_ENV, str(STAND_IN))
    loader = load_model_py(version)
    model_cls = loader.TritonPythonModel
    assert sys.modules[model_cls.__module__].__file__ == str(STAND_IN / "model.py")  # upstream's class
    assert sys.modules["helpers"].__file__ == str(STAND_IN / "helpers.py")

    class AutoComplete:  # what Triton hands auto_complete_config
        def set_model_transaction_policy(self, policy: dict[str, bool]) -> None:
            self.policy = policy

        def set_max_batch_size(self, size: int) -> None:
            self.max_batch_size = size

    completed = model_cls.auto_complete_config(AutoComplete())
    assert (completed.policy, completed.max_batch_size) == ({"decoupled": True}, 0)
    model = model_cls()
    model.initialize({"model_config": "{}"})
    assert model.seen["cwd"] == str(version)
    assert model.seen["helpers"] == "tests/stand_in_llmapi_model/helpers.py"
    assert model.seen["model"] == str(version / "checkpoint") and model.seen["model_has_config"] is True
    assert "tensor_parallel_size" in model.seen["llm_args"] and "triton_config" not in model.seen["llm_args"]


@pytest.mark.parametrize("where", ["empty folder", "unset"])
def test_the_loader_fails_with_one_clear_line_where_the_image_lacks_the_model(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, load_model_py: Any, where: str
) -> None:
    if where == "unset":
        monkeypatch.delenv(UPSTREAM_MODEL_ENV, raising=False)
        expected = "/app/all_models/llmapi/tensorrt_llm/1/model.py"
    else:
        monkeypatch.setenv(UPSTREAM_MODEL_ENV, str(tmp_path))
        expected = str(tmp_path / "model.py")
    with pytest.raises(ImportError) as raised:
        load_model_py(repo / "tensorrt_llm" / "1")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"{expected} not found: this repository runs TensorRT-LLM's llmapi model")
    assert "serve it in nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3 (TensorRT-LLM 1.1.0)" in message
    assert f"or set {UPSTREAM_MODEL_ENV} to a folder holding" in message


# ---- quantized builds, the plan ---------------------------------------------------------------------------
def test_an_fp8_build_packages_the_modelopt_checkpoint(tiny_llama_dir: Path, tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "tiny-fp8.yaml",
        tiny_llama_dir,
        quantization={"mode": "fp8", "calibration": {"num_samples": 2}},
    )
    repo, _ = build(config)
    checkpoint = repo / "tensorrt_llm" / "1" / "checkpoint"
    quant = json.loads((checkpoint / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "FP8"
    document = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert document["model"] == "checkpoint" and _unrecorded(document) == []


def test_dry_run_of_the_shipped_config_plans_the_repository_and_both_ways_to_serve_it(
    in_tmp_workdir: Path,
) -> None:
    result = CliRunner().invoke(cli, ["build", str(SHIPPED_CONFIG), "--dry-run"])
    assert result.exit_code == 0, result.output
    repo = "build/smollm2-135m-trtllm-pytorch-fp8/model_repo"
    assert (
        f"[5/5] package: render model repository (llmapi) -> {repo}: tensorrt_llm (tensorrt_llm: TensorRT-LLM's "
        "llmapi model.py from the serving image (/app/all_models/llmapi/tensorrt_llm/1, or "
        f"${UPSTREAM_MODEL_ENV}) on the checkpoint linked into tensorrt_llm/1/checkpoint, decoupled true)"
    ) in result.output
    assert f"[5/5] package: serve it with Triton: llmpipe serve {repo}\n" in result.output
    assert f"(trtllm-serve): {repo}/trtllm_serve.sh\n" in result.output
    assert not (in_tmp_workdir / "build").exists()
