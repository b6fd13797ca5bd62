"""`llmpipe validate` on the TensorRT-LLM backends, whose engines need a GPU: on any machine it measures the
ModelOpt-quantized model of the quantize stage in simulated quantization (tiny random Llama, real ModelOpt,
no TensorRT-LLM), with the same metrics and gates as a torch build."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli.main import cli
from pipeline.quantize.modelopt.state import SIMULATION_DIR, STATE_FILE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAST_VALIDATION = {"num_samples": 3, "max_new_tokens": 12}
FAST_CALIBRATION = {"num_samples": 4, "max_seq_length": 64}


def _config(folder: Path, source: Path, backend: str, **quantization: Any) -> Path:
    name = f"tiny-{backend}-{quantization.get('mode', 'none')}".replace("_", "-")
    data = {
        "name": name,
        "source": {"kind": "local", "path": str(source)},
        "backend": backend,
        "workdir": str(folder / "build" / name),
        "engine": {"max_batch_size": 8, "max_input_len": 512, "max_seq_len": 1024, "max_num_tokens": 512},
        "quantization": {"calibration": FAST_CALIBRATION, **quantization},
        "validation": FAST_VALIDATION,
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _invoke(*argv: str) -> Any:
    return CliRunner().invoke(cli, list(argv))


@pytest.mark.parametrize(("backend", "until"), [("trtllm", "quantize"), ("trtllm_pytorch", "engine")])
def test_a_gpu_format_is_validated_in_simulation(
    tiny_llama_dir: Path, tmp_path: Path, backend: str, until: str
) -> None:
    config = _config(tmp_path, tiny_llama_dir, backend, mode="fp8")
    built = _invoke("build", str(config), "--until", until)
    assert built.exit_code == 0, built.stderr
    workdir = tmp_path / "build" / yaml.safe_load(config.read_text())["name"]
    if backend == "trtllm_pytorch":  # the state validation reads stays out of what is served
        assert (workdir / "quantized" / SIMULATION_DIR / STATE_FILE).is_file()
        assert not list((workdir / "engine").rglob(STATE_FILE))
    result = _invoke("validate", str(config), "--set", "validation.thresholds.min_output_match=0")
    report = json.loads((workdir / "validation" / "validation.json").read_text())
    assert report["target"].startswith("ModelOpt simulated quantization"), report["target"]
    assert report["compute_dtype"] == "float32" and report["profile"] == "fp8 (ModelOpt simulation)"
    metrics = {row["metric"]: row["value"] for row in report["gates"]}
    # quantized, so not the reference itself; close to it, so not broken
    assert 0 < metrics["mean_kl"] < 0.5, metrics
    assert metrics["greedy_agreement"] > 0.5, metrics
    assert result.exit_code in (0, 1), result.stderr  # the verdict is the gates'; the run itself works


def test_a_format_tensorrt_llm_makes_itself_is_refused_with_the_way_to_validate_it(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    # int8 weight-only is converted by TensorRT-LLM's own from_hugging_face: nothing here can simulate it
    config = _config(tmp_path, tiny_llama_dir, "trtllm", mode="int8_wo")
    result = _invoke("validate", str(config))
    assert result.exit_code != 0
    assert "quantization.mode=int8_wo" in result.stderr and "--endpoint" in result.stderr, result.stderr


def test_nvfp4_which_modelopt_simulates_only_on_cuda_is_refused_in_one_line(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    config = _config(tmp_path, tiny_llama_dir, "trtllm", mode="nvfp4")
    result = _invoke("validate", str(config))
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit | None)  # no traceback
    assert "quantization.mode=nvfp4" in result.stderr and "--endpoint" in result.stderr, result.stderr


# SmolLM2-135M measured in simulation (pipeline/validate/thresholds.py): each passes its format's defaults
# and fails the weight-only int8 bounds the formats had before they were measured.
MEASURED = {
    "fp8": (0.900, 0.876, 0.035, 1.15, 1.5),
    "int8_sq": (0.893, 0.797, 0.123, 15.1, 7.1),
    "int4_awq": (0.809, 0.719, 0.222, 26.0, -3.0),
    "w4a8_awq": (0.795, 0.688, 0.265, 32.6, 8.0),
}


@pytest.mark.parametrize("mode", sorted(MEASURED))
def test_the_measured_formats_pass_their_simulated_defaults(mode: str) -> None:
    from pipeline.config.build_config import ValidationThresholds
    from pipeline.validate.thresholds import resolve_gates

    values = dict(zip(("greedy_agreement", "top1_agreement", "mean_kl", "ppl_delta_pct", "rougeL_drop"),
                      MEASURED[mode], strict=True))  # fmt: skip
    simulated = resolve_gates(ValidationThresholds(), mode, "auto", "float32", simulated=True)
    assert all(g.passes(values[g.metric]) for g in simulated if g.metric in values)
    assert all(g.source == f"default ({mode} (ModelOpt simulation))" for g in simulated)
    engine = resolve_gates(ValidationThresholds(), mode, "auto", "float32")
    assert not all(g.passes(values[g.metric]) for g in engine if g.metric in values)
