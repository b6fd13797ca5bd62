"""`llmpipe package CONFIG --engine-dir DIR`: an engine built by the user's own trtllm-build run becomes the
engine stage's output and is packaged into a Triton repository. The folders are shaped like trtllm-build's
output (tests/fake_trtllm_engine.py says from which upstream source); the tokenizer is the tiny HF
checkpoint's, loaded back with transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from pipeline.artifacts import read_manifest
from pipeline.backends.trtllm import env
from pipeline.cli.package import package as package_command
from pipeline.errors import ConfigError, MissingArtifactError, UnsupportedModelError
from pipeline.serving.repository.pbtxt import parse_model_config
from tests.fake_trtllm_engine import engine_config, write_build_config, write_engine_dir

H100 = env.Gpu(0, "NVIDIA H100 80GB HBM3", "9.0", 81559, 80000)


@pytest.fixture(autouse=True)
def _no_gpu_here(monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU query is the one thing that differs between this machine and a GPU host.
    monkeypatch.setattr(env, "gpus", lambda: env.Probe(None, "nvidia-smi not found"))


def package(config: Path, engine_dir: Path, *extra: str) -> Result:
    return CliRunner().invoke(package_command, [str(config), "--engine-dir", str(engine_dir), *extra])


def _parameters(repo: Path, model: str) -> dict[str, str]:
    parsed = parse_model_config(model, (repo / model / "config.pbtxt").read_text())
    return {key: value.string_value for key, value in parsed.parameters.items()}


def test_a_trtllm_build_output_is_packaged_with_the_checkpoints_tokenizer(
    tiny_llama_dir: Path, in_tmp_workdir: Path
) -> None:
    from transformers import AutoTokenizer

    config = write_build_config(in_tmp_workdir / "byo.yaml", tiny_llama_dir)
    built = write_engine_dir(in_tmp_workdir / "trtllm-out")
    result = package(config, built, "--compute-capability", "9.0")
    assert result.exit_code == 0, result.output

    engine, repo = in_tmp_workdir / "build/byo/engine", in_tmp_workdir / "build/byo/model_repo"
    for name in ("config.json", "rank0.engine"):
        assert os.stat(engine / name).st_ino == os.stat(built / name).st_ino  # linked, not copied
    facts = read_manifest(engine).facts  # type: ignore[union-attr]
    assert facts["imported_from"] == str(built.resolve())
    assert facts["tensorrt_llm_version"] == "1.1.0" and facts["release"] == "1.1.0"
    assert (facts["gpu_compute_capability"], facts["gpu_compute_capability_from"]) == (
        "9.0",
        "--compute-capability",
    )

    # The tensorrt_llm model opens the imported engine; the config's sections set its parameters.
    assert 'backend: "tensorrtllm"' in (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    params = _parameters(repo, "tensorrt_llm")
    assert Path(params["gpt_model_path"]) == engine.resolve()
    assert (Path(params["gpt_model_path"]) / "rank0.engine").is_file()
    assert params["max_tokens_in_paged_kv_cache"] == "16384"
    # Pre/postprocessing find the checkpoint's tokenizer where their tokenizer_dir points.
    reference = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for model in ("preprocessing", "postprocessing"):
        folder = repo / model / "1" / _parameters(repo, model)["tokenizer_dir"]
        assert (
            AutoTokenizer.from_pretrained(folder)("hello world").input_ids
            == reference("hello world").input_ids
        )


def test_a_second_run_reuses_the_import_and_a_rebuilt_engine_is_imported_again(
    tiny_llama_dir: Path, in_tmp_workdir: Path
) -> None:
    config = write_build_config(in_tmp_workdir / "byo.yaml", tiny_llama_dir)
    built = write_engine_dir(in_tmp_workdir / "trtllm-out")
    assert package(config, built, "--compute-capability", "9.0").exit_code == 0
    again = package(config, built, "--compute-capability", "9.0")
    assert "engine: reused" in again.output, again.output
    (built / "rank0.engine").write_bytes(b"ftrt rebuilt")  # in place, as Engine.save rewrites it
    rebuilt = package(config, built, "--compute-capability", "9.0")
    assert "engine: done" in rebuilt.output and "package: done" in rebuilt.output, rebuilt.output


@pytest.mark.parametrize(
    ("sections", "engine", "named"),
    [
        ({"parallel": {"tp_size": 2}}, {}, ["parallel.tp_size=2 but the engine has mapping.tp_size=1"]),
        (
            {},
            {"tp": 2, "max_seq_len": 2048, "max_num_tokens": 1024},
            [
                "parallel.tp_size=1 but the engine has mapping.tp_size=2",
                "engine.max_seq_len=1024 but the engine has build_config.max_seq_len=2048",
                "engine.max_num_tokens=512 but the engine has build_config.max_num_tokens=1024",
            ],
        ),
        ({"kv_cache": {"tokens_per_block": 32}}, {},
         ["kv_cache.tokens_per_block=32 but the engine has plugin_config.tokens_per_block=16"]),
        ({"quantization": {"mode": "int4_awq"}}, {},
         ["quantization.mode=int4_awq but the engine has quantization.quant_algo=None"]),
        ({}, {"max_draft_len": 4}, ["max_draft_len=0 but the engine has build_config.max_draft_len=4"]),
        # A speculative engine's max_seq_len carries the draft tokens on top of the config's.
        ({"speculative": {"mode": "draft_model", "draft_config": "d.yaml"}, "kv_cache": {"enable_block_reuse": True}},
         {"max_draft_len": 4},
         ["engine.max_seq_len + max_draft_len (1024 + 4)=1028 but the engine has build_config.max_seq_len=1024"]),
        ({"dtype": "bfloat16"}, {}, ["dtype=bfloat16 but the engine has pretrained_config.dtype=float16"]),
    ],
)  # fmt: skip
def test_a_config_that_does_not_describe_the_engine_is_refused_naming_both_sides(
    tiny_llama_dir: Path,
    in_tmp_workdir: Path,
    sections: dict[str, Any],
    engine: dict[str, Any],
    named: list[str],
) -> None:
    config = write_build_config(in_tmp_workdir / "byo.yaml", tiny_llama_dir, **sections)
    built = write_engine_dir(in_tmp_workdir / "trtllm-out", engine_config(**engine))
    result = package(config, built, "--compute-capability", "9.0")
    assert isinstance(result.exception, ConfigError), result.output
    for text in named:
        assert text in result.exception.message
    assert (
        not (in_tmp_workdir / "build/byo/engine").exists()
        and not (in_tmp_workdir / "build/byo/model_repo").exists()
    )


def _edit(config: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    *parents, last = dotted.split(".")
    node = config
    for key in parents:
        node = node[key]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return config


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        (("build_config.max_num_tokens", None), UnsupportedModelError, "has no build_config.max_num_tokens"),
        (("version", "0.18.0"), UnsupportedModelError, "version=0.18.0; llmpipe serves engines of TensorRT-LLM 1.0.0"),
        (("build_config.kv_cache_type", "CONTINUOUS"), ConfigError, "without a paged KV cache"),
        (("build_config.plugin_config.remove_input_padding", False), ConfigError, "without packed inputs"),
        (("pretrained_config.mapping.world_size", 4), UnsupportedModelError, "world_size=4 is not tp_size"),
    ],
)  # fmt: skip
def test_a_folder_trtllm_build_would_not_write_is_refused(
    tiny_llama_dir: Path, in_tmp_workdir: Path, edit: tuple[str, Any], error: type, match: str
) -> None:
    config = write_build_config(in_tmp_workdir / "byo.yaml", tiny_llama_dir)
    built = write_engine_dir(in_tmp_workdir / "trtllm-out", _edit(engine_config(), *edit))
    result = package(config, built, "--compute-capability", "9.0")
    assert isinstance(result.exception, error) and match in result.exception.message, result.output


def test_missing_rank_files_and_old_layouts_are_named(tiny_llama_dir: Path, in_tmp_workdir: Path) -> None:
    config = write_build_config(in_tmp_workdir / "byo.yaml", tiny_llama_dir, parallel={"tp_size": 2})
    built = write_engine_dir(in_tmp_workdir / "tp2", engine_config(tp=2))
    (built / "rank1.engine").unlink()
    result = package(config, built, "--compute-capability", "9.0")
    assert isinstance(result.exception, MissingArtifactError)
    assert "needs rank0.engine, rank1.engine; the folder holds rank0.engine" in result.exception.message

    legacy = in_tmp_workdir / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text(
        json.dumps({"builder_config": {"max_batch_size": 8}, "plugin_config": {}})
    )
    (legacy / "llama_float16_tp1_rank0.engine").write_bytes(b"old")
    result = package(config, legacy, "--compute-capability", "9.0")
    assert isinstance(result.exception, UnsupportedModelError) and "before TensorRT-LLM 0.8" in str(
        result.exception
    )


def test_the_gpu_architecture_comes_from_the_option_or_this_machines_gpu(
    tiny_llama_dir: Path, in_tmp_workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_build_config(in_tmp_workdir / "byo.yaml", tiny_llama_dir)
    built = write_engine_dir(in_tmp_workdir / "trtllm-out")
    no_gpu = package(config, built)
    assert isinstance(no_gpu.exception, ConfigError) and "--compute-capability" in (
        no_gpu.exception.hint or ""
    )
    assert isinstance(package(config, built, "--compute-capability", "sm90").exception, ConfigError)
    monkeypatch.setattr(env, "gpus", lambda: env.Probe([H100]))
    assert package(config, built).exit_code == 0
    facts = read_manifest(in_tmp_workdir / "build/byo/engine").facts  # type: ignore[union-attr]
    assert facts["gpu_compute_capability"] == "9.0" and "H100" in facts["gpu_compute_capability_from"]
    usage = CliRunner().invoke(package_command, [str(config), "--compute-capability", "9.0"])
    assert usage.exit_code == 2 and "--engine-dir" in usage.output


def test_dry_run_prints_the_import_not_a_build(tiny_llama_dir: Path, in_tmp_workdir: Path) -> None:
    config = write_build_config(in_tmp_workdir / "byo.yaml", tiny_llama_dir)
    built = write_engine_dir(in_tmp_workdir / "trtllm-out")
    result = package(config, built, "--dry-run")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # one stage may describe itself in several lines
    assert list(dict.fromkeys(line.split(":")[0].strip() for line in lines[1:])) == [
        "[1/3] fetch",
        "[2/3] engine",
        "[3/3] package",
    ]
    assert f"import the trtllm-build output {built.resolve()}" in result.output
    assert "trtllm-build --checkpoint_dir" not in result.output
    assert not (in_tmp_workdir / "build").exists()
