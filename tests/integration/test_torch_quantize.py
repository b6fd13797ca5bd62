"""The torch backend's quantize step through the real CLI: packed weights, scheme in config, engine runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from pipeline.cli.main import cli
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.quant.linear import QuantLinear
from tests.serving_helpers import cli_build_and_validate

LINEARS = ("attention.qkv", "attention.dense", "mlp.gate_up", "mlp.proj")


def _build(tmp: Path, hf_dir: Path, mode: str) -> Path:
    config = tmp / f"{mode}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": mode,
                "source": {"kind": "local", "path": str(hf_dir)},
                "workdir": str(tmp / mode),
                "quantization": {"mode": mode, "group_size": 32},
                "engine": {
                    "max_batch_size": 4,
                    "max_input_len": 64,
                    "max_seq_len": 128,
                    "max_num_tokens": 128,
                },
                "kv_cache": {"tokens_per_block": 16, "max_tokens": 1024},
            }
        )
    )
    result = CliRunner().invoke(cli, ["build", str(config), "--until", "engine"])
    assert result.exit_code == 0, result.output
    return tmp / mode


@pytest.mark.parametrize(("mode", "algo"), [("int8_wo", "W8A16"), ("int4_wo", "W4A16")])
def test_quantized_engine_is_packed_and_close_to_fp32(
    tmp_path: Path, tiny_llama_dir: Path, mode: str, algo: str
) -> None:
    work = _build(tmp_path, tiny_llama_dir, mode)
    config = json.loads((work / "engine" / "config.json").read_text())
    assert config["pretrained_config"]["quantization"]["quant_algo"] == algo
    packed = load_file(str(work / "engine" / "rank0.safetensors"))
    dense = load_file(str(work / "checkpoint" / "rank0.safetensors"))
    scheme, group = ("int8", None) if mode == "int8_wo" else ("int4", 32)
    for layer in range(config["pretrained_config"]["num_hidden_layers"]):
        for name in LINEARS:
            prefix = f"transformer.layers.{layer}.{name}"
            assert f"{prefix}.weight" not in packed
            parts = {k.rsplit(".", 1)[1]: v for k, v in packed.items() if k.startswith(prefix + ".")}
            restored = QuantLinear.from_packed(parts, scheme, group).dequantize()
            original = dense[f"{prefix}.weight"]
            # round-to-nearest: error at most half a quantization step of the row (int8) / group (int4)
            step = (
                (original.abs().amax(dim=1, keepdim=True) / 127)
                if scheme == "int8"
                else (
                    (
                        original.reshape(original.shape[0], -1, 32).amax(-1)
                        - original.reshape(original.shape[0], -1, 32).amin(-1)
                    )
                    / 15
                ).repeat_interleave(32, dim=1)
            )
            assert torch.all((restored - original).abs() <= step / 2 + 1e-6)
    assert "lm_head.weight" in packed, "lm_head stays dense unless quantization.quantize_lm_head"

    engine = LLMEngine.from_engine_dir(work / "engine")
    (request,) = engine.generate([[1, 5, 9, 22, 40]], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(request.output_token_ids) == 8


def test_unsupported_torch_mode_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump({"source": {"kind": "local", "path": "/x"}, "quantization": {"mode": "w4a8_awq"}})
    )
    result = CliRunner().invoke(cli, ["config", "validate", str(config)])
    assert (
        result.exit_code == 1
        and "quantization.mode=w4a8_awq is not available on backend=torch" in result.output
    )


def test_int8_sq_engine_smooths_then_runs_w8a8(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """SmoothQuant through the real CLI: calibrated on the shipped set, the scales folded (norm weights
    changed), int8 weights per row of the smoothed layers, and an engine whose layers round their activations
    to int8 per token, predicting what the float model predicts on most positions."""
    work = _build(tmp_path, tiny_llama_dir, "int8_sq")
    config = json.loads((work / "engine" / "config.json").read_text())
    assert config["pretrained_config"]["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
    facts = json.loads((work / "quantized" / "manifest.json").read_text())["facts"]["smoothquant"]
    assert facts["alpha"] == 0.5 and facts["calibration"]["tokens"] > 0
    for name in LINEARS:
        assert facts["activation_peak_to_mean_after"][name] < facts["activation_peak_to_mean_before"][name]
    packed = load_file(str(work / "engine" / "rank0.safetensors"))
    dense = load_file(str(work / "checkpoint" / "rank0.safetensors"))
    norm = "transformer.layers.0.input_layernorm.weight"
    assert not torch.allclose(packed[norm], dense[norm])  # the qkv scales were folded into it
    assert packed["transformer.layers.0.attention.qkv.qweight"].dtype == torch.int8

    fp32 = _build(tmp_path, tiny_llama_dir, "none")
    tokens = torch.randint(3, 1000, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = []
    for engine_dir in (fp32 / "engine", work / "engine"):
        runner = LLMEngine.from_engine_dir(engine_dir).runner
        quantized = [
            lin
            for layer in runner.model.weights.layers
            for lin in (layer.qkv, layer.dense, layer.gate_up, layer.proj)
            if isinstance(lin, QuantLinear)
        ]
        assert [lin.scheme for lin in quantized] == (["w8a8"] * 8 if engine_dir == work / "engine" else [])
        logits.append(runner.score(tokens, list(range(-(-len(tokens) // runner.tokens_per_block)))))
    agreement = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
    assert agreement >= 0.8, agreement  # measured 0.92


@pytest.mark.slow
def test_smollm2_int8_sq_passes_validate(smollm2_hf_dir: Path, tmp_path: Path) -> None:
    """The real model through `llmpipe build` and `llmpipe validate` with int8_sq's default gates."""
    report = cli_build_and_validate(smollm2_hf_dir, tmp_path, "smollm2-int8-sq", {"mode": "int8_sq"})
    assert report["passed"] and report["quantization"]["mode"] == "int8_sq"
