"""Which of llmpipe's architectures each TensorRT-LLM route takes, checked against the recorded upstream facts
(tests/contract/upstream/engine_model_classes.tsv, pytorch_backend_architectures.tsv, modelopt_export.tsv),
and how an architecture a route lacks is refused: at plan time (`--dry-run`) and in convert, in one line that
names it, the route's release and what it has, and the backend to use instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from pipeline.architectures import SUPPORTED_ARCHITECTURES
from pipeline.backends.trtllm.architectures import (
    MODEL_CLASS_FOR_ARCHITECTURE,
    PYTORCH_ARCHITECTURES,
    engine_model_class,
)
from pipeline.backends.trtllm.convert import convert as engine_convert
from pipeline.backends.trtllm.plan import plan as engine_plan
from pipeline.backends.trtllm_pytorch.architectures import require_pytorch_architecture
from pipeline.backends.trtllm_pytorch.convert import convert as pytorch_convert
from pipeline.backends.trtllm_pytorch.plan import plan as pytorch_plan
from pipeline.cli.main import cli
from pipeline.config.build_config import BuildConfig
from pipeline.errors import UnsupportedModelError
from pipeline.quantize.modelopt.export import (
    DECODER_TYPES,
    HF_EXPORT,
    TRTLLM_CHECKPOINT_ARCHITECTURES,
    TRTLLM_EXPORT,
    architecture,
)
from pipeline.quantize.modelopt.run import check_config
from tests.contract import upstream_facts
from tests.contract.upstream_facts import RELEASE

ENGINE = upstream_facts.engine_model_classes()
PYTORCH = upstream_facts.pytorch_backend_architectures()
MODELOPT = upstream_facts.modelopt_exports()
# A model shape every format's block size divides (the ModelOpt checks read config.json alone).
SHAPE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
         "vocab_size": 512, "num_hidden_layers": 2, "dtype": "bfloat16"}  # fmt: skip


def hf_checkpoint(folder: Path, arch: str) -> Path:
    """An HF checkpoint folder as far as the plan and the architecture checks read it: config.json (plus
    placeholder weights and tokenizer for the steps that look for them)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [arch], **SHAPE}))
    (folder / "model.safetensors").write_bytes(b"placeholder")
    (folder / "tokenizer.json").write_text("{}")
    return folder


def make_cfg(hf_dir: Path, backend: str, **sections: Any) -> BuildConfig:
    data = {"name": "arch", "backend": backend, "source": {"kind": "local", "path": str(hf_dir)}, **sections}
    return BuildConfig.model_validate(data)


def dry_run(tmp_path: Path, arch: str, backend: str, mode: str = "none") -> Any:
    hf_dir = hf_checkpoint(tmp_path / "hf", arch)
    config = {"name": "arch", "backend": backend, "source": {"kind": "local", "path": str(hf_dir)},
              "workdir": str(tmp_path / "build"), "quantization": {"mode": mode}}  # fmt: skip
    path = tmp_path / "arch.yaml"
    path.write_text(yaml.safe_dump(config))
    return CliRunner().invoke(cli, ["build", str(path), "--dry-run"])


def assert_one_line_refusal(result: Any, *parts: str) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert not any(line.startswith("Hint:") for line in result.output.splitlines()), result.output
    for part in parts:
        assert part in errors[0], errors[0]
    return errors[0]


# ---- the recorded facts cover llmpipe's architectures -------------------------------------------------------
@pytest.mark.parametrize("facts", [ENGINE, PYTORCH, MODELOPT], ids=["engine", "pytorch", "modelopt"])
def test_every_architecture_has_a_recorded_fact(facts: dict[str, Any]) -> None:
    assert set(facts) == set(SUPPORTED_ARCHITECTURES)


# ---- engine route (backend: trtllm) ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_the_engine_route_maps_each_architecture_as_tensorrt_llm_1_1_0_does(arch: str) -> None:
    expected = ENGINE[arch]
    assert MODEL_CLASS_FOR_ARCHITECTURE.get(arch) == expected
    if expected is None:
        with pytest.raises(UnsupportedModelError, match=f"architecture {arch} has no model class"):
            engine_model_class(arch)
    else:
        assert engine_model_class(arch) == expected


@pytest.mark.parametrize("arch", [a for a in SUPPORTED_ARCHITECTURES if ENGINE[a]])
def test_the_engine_plan_names_the_model_class(arch: str, tmp_path: Path) -> None:
    hf_dir = hf_checkpoint(tmp_path / "hf", arch)
    text = "\n".join(engine_plan(make_cfg(hf_dir, "trtllm"), tmp_path / "build", "convert"))
    assert f"{ENGINE[arch]}.from_hugging_face('{hf_dir}'" in text


@pytest.mark.parametrize("arch", [a for a in SUPPORTED_ARCHITECTURES if not ENGINE[a]])
def test_dry_run_refuses_an_architecture_the_engine_route_lacks(arch: str, tmp_path: Path) -> None:
    line = assert_one_line_refusal(
        dry_run(tmp_path, arch, "trtllm"),
        f"architecture {arch} has no model class in TensorRT-LLM {RELEASE}'s engine route",
        ", ".join(MODEL_CLASS_FOR_ARCHITECTURE),
        "backend: torch",
    )
    assert ("backend: trtllm_pytorch" in line) == PYTORCH[arch]
    assert not (tmp_path / "build").exists()


def test_engine_convert_refuses_before_it_needs_tensorrt_llm(tmp_path: Path) -> None:
    hf_dir = hf_checkpoint(tmp_path / "hf", "Olmo2ForCausalLM")
    out = tmp_path / "ckpt"
    out.mkdir()
    for mode in ("none", "fp8"):  # convert's own route and ModelOpt's
        with pytest.raises(UnsupportedModelError, match="Olmo2ForCausalLM has no model class"):
            engine_convert(make_cfg(hf_dir, "trtllm", quantization={"mode": mode}), hf_dir, out)
    assert not any(out.iterdir())


@pytest.mark.parametrize(
    ("arch", "model_class"),
    [("Qwen3ForCausalLM", "QWenForCausalLM"), ("Qwen3MoeForCausalLM", "QWenForCausalLM"),
     ("MixtralForCausalLM", "LLaMAForCausalLM"), ("GraniteForCausalLM", "LLaMAForCausalLM")],
)  # fmt: skip
def test_engine_convert_calls_the_recorded_class(
    arch: str, model_class: str, trtllm: Any, tmp_path: Path
) -> None:
    assert ENGINE[arch] == model_class
    hf_dir = hf_checkpoint(tmp_path / "hf", arch)
    facts = engine_convert(make_cfg(hf_dir, "trtllm"), hf_dir, tmp_path / "ckpt")
    assert facts["trtllm_model_class"] == model_class
    assert [name for name, _ in trtllm.CALLS][0] == f"{model_class}.from_hugging_face"


# ---- PyTorch route (backend: trtllm_pytorch) --------------------------------------------------------------------
@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_the_pytorch_route_takes_what_tensorrt_llm_1_1_0_registers(arch: str) -> None:
    assert (arch in PYTORCH_ARCHITECTURES) == PYTORCH[arch]
    if PYTORCH[arch]:
        assert require_pytorch_architecture(arch) == arch
    else:
        with pytest.raises(UnsupportedModelError, match=f"architecture {arch} is not a model"):
            require_pytorch_architecture(arch)


@pytest.mark.parametrize("arch", [a for a in SUPPORTED_ARCHITECTURES if not PYTORCH[a]])
def test_dry_run_refuses_an_architecture_the_pytorch_backend_lacks(arch: str, tmp_path: Path) -> None:
    line = assert_one_line_refusal(
        dry_run(tmp_path, arch, "trtllm_pytorch"),
        f"backend trtllm_pytorch: architecture {arch} is not a model of TensorRT-LLM {RELEASE}'s PyTorch backend",
        ", ".join(PYTORCH_ARCHITECTURES),
        "backend: torch",
    )
    assert ("backend: trtllm " in line or line.endswith("backend: trtllm")) == bool(ENGINE[arch])


@pytest.mark.parametrize("arch", [a for a in SUPPORTED_ARCHITECTURES if PYTORCH[a]])
def test_the_pytorch_plan_takes_a_registered_architecture(arch: str, tmp_path: Path) -> None:
    hf_dir = hf_checkpoint(tmp_path / "hf", arch)
    assert pytorch_plan(make_cfg(hf_dir, "trtllm_pytorch"), tmp_path / "build", "convert")


def test_pytorch_convert_refuses_before_linking_anything(tmp_path: Path) -> None:
    hf_dir = hf_checkpoint(tmp_path / "hf", "SmolLM3ForCausalLM")
    out = tmp_path / "out"
    with pytest.raises(UnsupportedModelError, match="SmolLM3ForCausalLM is not a model"):
        pytorch_convert(make_cfg(hf_dir, "trtllm_pytorch"), hf_dir, out)
    assert not out.exists() or not any(out.iterdir())


# ---- ModelOpt export ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_modelopt_decoder_types_and_exports_are_the_recorded_ones(arch: str) -> None:
    fact = MODELOPT[arch]
    assert DECODER_TYPES.get(arch) == fact.decoder_type
    hf_config = {"architectures": [arch], **SHAPE}
    assert (arch in TRTLLM_CHECKPOINT_ARCHITECTURES) == fact.trtllm_checkpoint
    if fact.trtllm_checkpoint:
        assert architecture(hf_config, TRTLLM_EXPORT) == arch
    else:
        with pytest.raises(
            UnsupportedModelError, match=f"TensorRT-LLM checkpoint of architecture {arch} here"
        ):
            architecture(hf_config, TRTLLM_EXPORT)
    assert fact.unified_hf
    assert architecture(hf_config, HF_EXPORT) == arch


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_the_recorded_decoder_types_are_the_installed_modelopts(arch: str) -> None:
    model_utils = pytest.importorskip("modelopt.torch.export.model_utils")
    model = type(arch, (), {})()  # get_model_type reads the class name only
    assert model_utils.get_model_type(model) == MODELOPT[arch].decoder_type


@pytest.mark.parametrize(
    "arch", [a for a in SUPPORTED_ARCHITECTURES if ENGINE[a] and not MODELOPT[a].trtllm_checkpoint]
)
def test_dry_run_refuses_a_calibrated_engine_format_modelopt_cannot_export(arch: str, tmp_path: Path) -> None:
    line = assert_one_line_refusal(
        dry_run(tmp_path, arch, "trtllm", mode="fp8"),
        f"ModelOpt cannot export a TensorRT-LLM checkpoint of architecture {arch} here",
        ", ".join(TRTLLM_CHECKPOINT_ARCHITECTURES),
        "backend: trtllm_pytorch",
        "int4_wo",
    )
    assert "\n" not in line


def test_a_convert_mode_needs_no_modelopt_export(tmp_path: Path) -> None:
    hf_dir = hf_checkpoint(tmp_path / "hf", "Gemma3ForCausalLM")
    text = "\n".join(
        engine_plan(make_cfg(hf_dir, "trtllm", quantization={"mode": "int8_wo"}), tmp_path / "b")
    )
    assert "GemmaForCausalLM.from_hugging_face(" in text


@pytest.mark.parametrize("arch", [a for a in SUPPORTED_ARCHITECTURES if PYTORCH[a]])
def test_the_pytorch_routes_quantize_checks_the_unified_export_only(arch: str, tmp_path: Path) -> None:
    hf_config = {"architectures": [arch], **SHAPE}
    check_config(make_cfg(tmp_path, "trtllm_pytorch", quantization={"mode": "fp8"}), hf_config, HF_EXPORT)
