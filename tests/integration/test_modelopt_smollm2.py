"""The trtllm quantize step with the real ModelOpt on SmolLM2-135M (hidden 576, 9 heads of 64, 3 KV heads,
30 layers, tied embeddings, RoPE base 100000), on the default 32 calibration samples of up to 512 tokens, 8 to
a batch (AWQ takes ~2.5 minutes so on 2 cores, ~8 one at a time). Its own module, so the tiny-model tests'
one-thread fixture does not apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_modelopt_quantize import convert_and_quantize, make_cfg, numel, tensors

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("mode", "group_size"), [("fp8", 128), ("int4_awq", 64)])
def test_smollm2(smollm2_hf_dir: Path, tmp_path: Path, mode: str, group_size: int) -> None:
    cfg = make_cfg(smollm2_hf_dir, mode=mode, group_size=group_size, calibration={"batch_size": 8})
    out, facts = convert_and_quantize(cfg, smollm2_hf_dir, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == {"fp8": "FP8", "int4_awq": "W4A16_AWQ"}[mode]
    assert config["rotary_base"] == 100000.0  # from transformers 5's rope_parameters, not the 10000 default
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (576, 30, 3)
    names = tensors(out / "rank0.safetensors")
    qkv = [n for n in names if n.endswith("attention.qkv.weight")]
    assert len(qkv) == 30
    weight_dtype, per_byte = {"fp8": ("F8_E4M3", 1), "int4_awq": ("I8", 2)}[mode]
    dtype, shape = names[qkv[0]]
    assert (dtype, numel(shape)) == (weight_dtype, (9 + 2 * 3) * 64 * 576 // per_byte)
    assert (
        facts["calibration"]["samples"] == 32 and facts["quant_algo"] == config["quantization"]["quant_algo"]
    )
