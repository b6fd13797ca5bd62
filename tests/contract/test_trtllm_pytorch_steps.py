"""The trtllm_pytorch backend's stages on the tiny model, its `--dry-run` and its `doctor` rows.

None of its build steps needs TensorRT-LLM or a GPU (nothing is compiled; ModelOpt runs on the CPU), so
fetch -> convert -> quantize -> engine run here for real; what TensorRT-LLM then reads (the LLM API
arguments) is checked against the recorded interface by test_trtllm_pytorch_args.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from pipeline.backends.trtllm import env
from pipeline.backends.trtllm_pytorch.build import build
from pipeline.backends.trtllm_pytorch.checkpoint import HF_QUANT_CONFIG
from pipeline.backends.trtllm_pytorch.llm_args import LLM_API_ARGS_FILE, TRTLLM_SERVE_OPTIONS_FILE
from pipeline.cli.doctor import collect_report, format_table
from pipeline.cli.main import cli
from pipeline.config.build_config import BuildConfig, load_build_config
from pipeline.errors import MissingArtifactError
from pipeline.stages.chain import run_chain, stages_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CONFIG = REPO_ROOT / "build_configs" / "smollm2-135m-trtllm-pytorch-fp8.yaml"


def make_cfg(hf_dir: Path, workdir: Path, **sections: Any) -> BuildConfig:
    data = {
        "name": "tiny-pt", "backend": "trtllm_pytorch", "source": {"kind": "local", "path": str(hf_dir)},
        "workdir": str(workdir), "engine": {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128,
                                            "max_num_tokens": 128},
        **sections,
    }  # fmt: skip
    return BuildConfig.model_validate(data)


def test_fetch_to_engine_carries_the_checkpoint_and_writes_the_arguments(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    cfg = make_cfg(tiny_llama_dir, tmp_path / "work", scheduler={"policy": "max_utilization"})
    results = run_chain(cfg, stages_until("engine"))
    convert, engine = results["convert"], results["engine"]
    assert convert.manifest.facts["architecture"] == "LlamaForCausalLM"
    assert convert.manifest.facts["weight_files"] == ["model.safetensors"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(convert.manifest.facts["tokenizer_files"])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (engine.dir / name).read_bytes() == (tiny_llama_dir / name).read_bytes()
    args = yaml.safe_load((engine.dir / LLM_API_ARGS_FILE).read_text())
    facts = engine.manifest.facts
    assert args == facts["llm_api_args"]
    assert args["model"] == str(engine.dir.resolve())
    assert args["scheduler_config"] == {"capacity_scheduler_policy": "MAX_UTILIZATION"}
    assert (args["max_batch_size"], args["max_seq_len"], args["max_num_tokens"]) == (4, 128, 128)
    options = yaml.safe_load((engine.dir / TRTLLM_SERVE_OPTIONS_FILE).read_text())
    assert options == {k: v for k, v in args.items() if k != "model"}
    assert facts["trtllm_serve_argv"][:3] == ["trtllm-serve", "serve", args["model"]]
    assert facts["trtllm_serve_argv"][-1] == str(engine.dir.resolve() / TRTLLM_SERVE_OPTIONS_FILE)
    assert (facts["release"], facts["container"], facts["compiled"]) == (
        "1.1.0", "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3", False
    )  # fmt: skip
    assert (facts["quant_algo"], facts["kv_cache_quant_algo"]) == (None, None)
    # A second run reuses every stage: the arguments are keyed on the config sections they come from.
    assert all(r.reused for r in run_chain(cfg, stages_until("engine")).values())


def test_an_fp8_kv_cache_without_calibration_still_reaches_the_arguments(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    cfg = make_cfg(tiny_llama_dir, tmp_path, quantization={"kv_cache_dtype": "fp8"})
    (tmp_path / "ckpt").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "ckpt" / name).write_bytes((tiny_llama_dir / name).read_bytes())
    out = tmp_path / "out"
    out.mkdir()
    facts = build(cfg, tmp_path / "ckpt", out)
    assert facts["llm_api_args"]["kv_cache_config"]["dtype"] == "fp8"
    assert facts["kv_cache_quant_algo"] == "FP8"


def test_the_engine_step_refuses_a_checkpoint_in_another_format(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("config.json", "model.safetensors"):
        (ckpt / name).write_bytes((tiny_llama_dir / name).read_bytes())
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(
        MissingArtifactError, match="holds quant_algo None .* quantization.mode=fp8 needs FP8"
    ):
        build(make_cfg(tiny_llama_dir, tmp_path, quantization={"mode": "fp8"}), ckpt, out)
    (ckpt / HF_QUANT_CONFIG).write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    with pytest.raises(MissingArtifactError, match="holds quant_algo NVFP4"):
        build(make_cfg(tiny_llama_dir, tmp_path, quantization={"mode": "fp8"}), ckpt, out)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(MissingArtifactError, match="is not an HF checkpoint: it has no weights"):
        build(make_cfg(tiny_llama_dir, tmp_path), ckpt, out)
    assert not (out / LLM_API_ARGS_FILE).exists()


def test_fp8_is_a_modelopt_unified_checkpoint_the_engine_accepts(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    cfg = make_cfg(
        tiny_llama_dir, tmp_path / "work", quantization={"mode": "fp8", "calibration": {"num_samples": 2}}
    )
    results = run_chain(cfg, stages_until("engine"))
    quantized = results["quantize"]
    assert (quantized.manifest.facts["quant_algo"], quantized.manifest.facts["kv_cache_quant_algo"]) == (
        "FP8",
        None,
    )
    config = json.loads((quantized.dir / HF_QUANT_CONFIG).read_text())
    assert config["quantization"]["quant_algo"] == "FP8"
    assert results["engine"].manifest.facts["quant_algo"] == "FP8"


def test_dry_run_of_the_shipped_config_names_route_release_container_and_arguments(
    in_tmp_workdir: Path,
) -> None:
    result = CliRunner().invoke(cli, ["build", str(SHIPPED_CONFIG), "--dry-run"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "plan for smollm2-135m-trtllm-pytorch-fp8 (trtllm_pytorch backend):" in out
    assert "route trtllm_pytorch: the PyTorch backend through the LLM API" in out
    assert "TensorRT-LLM 1.1.0 (nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3)" in out
    assert "as it is (no conversion: the PyTorch backend loads HF checkpoints)" in out
    assert "ModelOpt on CPU: calibrate" in out and "for quant_algo FP8" in out
    engine = str(in_tmp_workdir / "build" / "smollm2-135m-trtllm-pytorch-fp8" / "engine")
    assert f"LLM API arguments: model={engine}, dtype=bfloat16," in out
    assert "runs on 1 GPU(s) of SM89+ (weights fp8" in out
    assert f"trtllm-serve serve {engine} --backend pytorch" in out
    assert not (in_tmp_workdir / "build").exists()


def test_dry_run_of_the_engine_route_names_its_release_too(in_tmp_workdir: Path) -> None:
    result = CliRunner().invoke(cli, ["engine", str(SHIPPED_CONFIG), "--dry-run", "--set", "backend=trtllm"])
    assert result.exit_code == 0, result.output
    assert "trtllm-build" in result.output and "TensorRT-LLM 1.1.0" in result.output


def test_the_shipped_config_loads_as_written() -> None:
    cfg = load_build_config(SHIPPED_CONFIG)
    assert (cfg.backend, cfg.quantization.mode, cfg.source.kind) == ("trtllm_pytorch", "fp8", "gguf")


def test_doctor_names_both_routes_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    report = collect_report()
    routes = report["routes"]
    assert routes["trtllm"]["release"] == routes["trtllm_pytorch"]["release"] == "1.1.0"
    assert (
        "the removed route" in routes["trtllm"]["why"]
        and "the current route" in routes["trtllm_pytorch"]["why"]
    )
    backend = report["backends"]["trtllm_pytorch"]
    assert backend["available"] is False and backend["builds_here"] is True
    assert "TensorRT-LLM is not installed" in backend["reason"]
    table = format_table(report)
    assert "(builds here all the same: nothing is compiled)" in table
    assert re.search(r"\nroute trtllm_pytorch +the PyTorch backend through the LLM API", table)
    assert re.search(r"\nroute trtllm +TensorRT engines built by trtllm-build.*the removed route", table)


@pytest.mark.parametrize(
    ("gpu", "modes", "kv"),
    [
        ("9.0", ["none", "int4_awq", "w4a8_awq", "fp8"], ["auto", "fp8"]),
        ("10.0", ["none", "fp8", "nvfp4"], ["auto", "fp8"]),
        ("8.0", ["none", "int4_awq"], ["auto", "fp8"]),
    ],
)
def test_doctor_lists_the_formats_the_gpus_run(
    monkeypatch: pytest.MonkeyPatch, gpu: str, modes: list[str], kv: list[str]
) -> None:
    monkeypatch.setattr(env, "gpus", lambda: env.Probe([env.Gpu(0, "GPU", gpu, 81920, 80000)]))
    monkeypatch.setattr(env, "tensorrt_llm_version", lambda: env.Probe("1.1.0"))
    backend = collect_report()["backends"]["trtllm_pytorch"]
    assert (backend["available"], backend["quant_modes"], backend["kv_cache_dtypes"]) == (True, modes, kv)
    monkeypatch.setattr(env, "tensorrt_llm_version", lambda: env.Probe("1.2.1"))
    backend = collect_report()["backends"]["trtllm_pytorch"]
    assert backend["available"] is False
    assert backend["reason"] == (
        "TensorRT-LLM 1.2.1 is installed; this route is written for 1.1.0 "
        "(nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3)"
    )
