"""The build config: every shipped file validates; each common mistake gives its one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli.main import cli
from pipeline.config.build_config import BuildConfig, load_build_config
from pipeline.errors import ConfigError
from pipeline.serving.repository.engine_parameters import engine_parameters
from tests.conftest import REPO_ROOT

SHIPPED = sorted((REPO_ROOT / "build_configs").glob("*.yaml"))


def test_shipped_configs_exist() -> None:
    names = {p.name for p in SHIPPED}
    assert {"smollm2-135m.yaml", "tiny-llama.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path) -> None:
    cfg = load_build_config(path)
    assert cfg.name == path.stem


BASE = {"name": "t", "source": {"kind": "local", "path": "/models/x"}}

# (override as a nested patch, text the one-line error must contain)
INVALID = [
    (
        {"engine": {"max_input_len": 4096, "max_seq_len": 2048}},
        "engine.max_input_len=4096 exceeds engine.max_seq_len=2048",
    ),
    (
        {"kv_cache": {"max_tokens": 1000}, "engine": {"max_seq_len": 2048}},
        "kv_cache.max_tokens=1000 cannot hold one sequence",
    ),
    (
        {"kv_cache": {"use_paged_context_fmha": False, "enable_block_reuse": True}},
        "kv_cache.enable_block_reuse=true needs kv_cache.use_paged_context_fmha=true",
    ),
    (
        {"kv_cache": {"use_paged_context_fmha": False}, "scheduler": {"enable_chunked_context": True}},
        "scheduler.enable_chunked_context=true needs",
    ),
    ({"quantization": {"mode": "fp8"}}, "quantization.mode=fp8 is not available on backend=torch"),
    (
        {"quantization": {"kv_cache_dtype": "fp8"}},
        "quantization.kv_cache_dtype=fp8 is not available on backend=torch",
    ),
    ({"parallel": {"tp_size": 2}}, "parallel.tp_size=2 pp_size=1: the torch backend runs on one device"),
    (
        {"serving": {"decoupled": False, "streaming": True}},
        "serving.streaming=true needs serving.decoupled=true",
    ),
    (
        {"engine": {"max_num_tokens": 256, "max_input_len": 1024}},
        "engine.max_num_tokens=256 < engine.max_input_len=1024",
    ),
    (
        {
            "engine": {"max_num_tokens": 8, "max_batch_size": 16, "max_input_len": 8},
            "scheduler": {"enable_chunked_context": True},
        },
        "engine.max_num_tokens=8 < engine.max_batch_size=16",
    ),
    ({"source": {"kind": "hub", "repo_id": "org/model", "path": None}}, "has no source.revision"),
    ({"source": {"kind": "hub", "path": None}}, "source.kind=hub needs source.repo_id"),
    (
        {"quantization": {"mode": "int4_wo", "group_size": 100}},
        "quantization.group_size=100 for mode=int4_wo must be one of 32, 64, 128",
    ),
    ({"speculative": {"mode": "draft_model"}}, "speculative.mode=draft_model needs speculative.draft_config"),
    ({"speculative": {"mode": "medusa"}}, "speculative.mode=medusa is a TensorRT-LLM mode"),
    ({"engine": {"max_beam_width": 4}}, "engine.max_beam_width=4: the torch backend has no beam search"),
    (
        {"serving": {"triton_max_batch_size": 64}},
        "serving.triton_max_batch_size=64 exceeds engine.max_batch_size=16",
    ),
    ({"serving": {"http_port": 8001}}, "serving ports must differ"),
    (
        {"backend": "trtllm", "serving": {"stream_interval": 4}},
        "serving.stream_interval=4: backend=trtllm serves through tensorrtllm_backend's C++ tensorrt_llm model",
    ),
    (
        {"serving": {"stream_interval": 0}},
        "serving.stream_interval: Input should be greater than or equal to 1",
    ),
    ({"engine": {"max_batch_sise": 4}}, "engine.max_batch_sise: unknown field"),
    ({"quantization": {"mode": "int3"}}, "quantization.mode: Input should be"),
    (
        {"kv_cache": {"free_memory_fraction": 1.5}},
        "kv_cache.free_memory_fraction: Input should be less than or equal to 1",
    ),
    ({"name": "bad name!"}, "name: String should match pattern"),
]


def _merge(base: dict, patch: dict) -> dict:
    out = dict(base)
    for key, value in patch.items():
        out[key] = (
            _merge(out.get(key, {}), value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


@pytest.mark.parametrize(("patch", "expected"), INVALID, ids=[e[1][:40] for e in INVALID])
def test_invalid_config_gives_one_line_error(tmp_path: Path, patch: dict, expected: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_merge(BASE, patch)))
    result = CliRunner().invoke(cli, ["config", "validate", str(path)])
    assert result.exit_code == 1
    assert expected in result.output
    assert "Traceback" not in result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.strip()]
    assert line.startswith("invalid ")


def test_trtllm_accepts_what_torch_refuses(tmp_path: Path) -> None:
    cfg = BuildConfig.model_validate(
        _merge(
            BASE,
            {
                "backend": "trtllm",
                "quantization": {"mode": "fp8", "kv_cache_dtype": "fp8"},
                "parallel": {"tp_size": 2},
            },
        )
    )
    assert cfg.quantization.quant_algo == "FP8" and cfg.quantization.kv_cache_quant_algo == "FP8"
    assert cfg.parallel.world_size == 2


def test_free_memory_fraction_defaults_to_the_backends_own() -> None:
    # torch: 0.2 of free RAM on CPU; trtllm: tensorrtllm_backend's default 0.9 (docs/model_config.md)
    torch_cfg = BuildConfig.model_validate(BASE)
    trtllm_cfg = BuildConfig.model_validate({**BASE, "backend": "trtllm"})
    assert (torch_cfg.kv_cache.free_memory_fraction, trtllm_cfg.kv_cache.free_memory_fraction) == (0.2, 0.9)
    # everything that renders or hashes the config sees the resolved value
    assert engine_parameters(torch_cfg)["kv_cache_free_gpu_mem_fraction"] == "0.2"
    assert engine_parameters(trtllm_cfg)["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert torch_cfg.model_dump()["kv_cache"]["free_memory_fraction"] == 0.2
    explicit = BuildConfig.model_validate(
        {**BASE, "backend": "trtllm", "kv_cache": {"free_memory_fraction": 0.5}}
    )
    assert explicit.kv_free_memory_fraction == 0.5


def test_torch_draft_model_needs_no_block_reuse() -> None:
    # TensorRT-LLM's draft-target flow needs KV block reuse; the torch engine's own draft model does not.
    spec = {"mode": "draft_model", "draft_config": "draft.yaml"}
    assert BuildConfig.model_validate({**BASE, "speculative": spec}).kv_cache.enable_block_reuse is False


def test_overrides_are_typed_and_validated(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(BASE))
    cfg = load_build_config(path, ["engine.max_batch_size=8", "kv_cache.enable_block_reuse=true"])
    assert cfg.engine.max_batch_size == 8 and cfg.kv_cache.enable_block_reuse is True
    with pytest.raises(ConfigError, match="engine.max_batch_size"):
        load_build_config(path, ["engine.max_batch_size=zero"])
    with pytest.raises(ConfigError, match="not KEY=VALUE"):
        load_build_config(path, ["engine.max_batch_size"])


def test_relative_source_path_is_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "c.yaml"
    path.write_text(yaml.safe_dump({"source": {"kind": "local", "path": "../models/m"}}))
    cfg = load_build_config(path)
    assert cfg.name == "c"
    assert cfg.source.path == str((tmp_path / "models" / "m").resolve())


def test_bad_yaml_and_missing_file_are_one_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("engine: [1, 2\n")
    runner = CliRunner()
    result = runner.invoke(cli, ["config", "validate", str(path), str(tmp_path / "absent.yaml")])
    assert result.exit_code == 1
    assert "not valid YAML" in result.output and "does not exist" in result.output
    assert "Traceback" not in result.output


def test_config_hash_tracks_only_named_sections() -> None:
    a = BuildConfig.model_validate(BASE)
    b = BuildConfig.model_validate(_merge(BASE, {"serving": {"http_port": 9100}}))
    assert a.config_hash("source", "engine") == b.config_hash("source", "engine")
    assert a.config_hash("serving") != b.config_hash("serving")


def test_config_show_prints_every_default(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(BASE))
    result = CliRunner().invoke(cli, ["config", "show", str(path), "--set", "engine.max_batch_size=4"])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.output)
    assert shown["engine"]["max_batch_size"] == 4
    assert shown["scheduler"]["policy"] == "guaranteed_no_evict"


def test_every_field_has_a_description() -> None:
    def walk(model: type) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{model.__name__}.{name}")
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BuildConfig.__mro__[1]):
                missing += walk(annotation)
        return missing

    assert walk(BuildConfig) == []
