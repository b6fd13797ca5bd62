"""The trtllm quantize step with the real NVIDIA ModelOpt on the CPU, without TensorRT-LLM: fetch's HF checkpoint
-> convert (tokenizer only) -> quantize (ModelOpt calibration + TensorRT-LLM checkpoint export).

The exported checkpoints are checked against TensorRT-LLM's checkpoint format
(NVIDIA/TensorRT-LLM:docs/source/legacy/architecture/checkpoint.md@10c1d594d3078c5e9f425373bc15763e87084a07):
config.json's `architecture`, `dtype`, `mapping` (world_size/tp_size/pp_size) and `quantization`
(`quant_algo`, `kv_cache_quant_algo`, `group_size`, `pre_quant_scale` for AWQ), and one rank{r}.safetensors
per rank with `transformer.layers.{i}.attention.qkv|dense`, `mlp.fc|gate|proj` linears, their FP8
`weights_scaling_factor` / `activation_scaling_factor`, AWQ `weights_scaling_factor` /
`prequant_scaling_factor`, and `attention.kv_cache_scaling_factor` for a quantized KV cache. The tensor
dtypes are the formats' own: FP8 weights F8_E4M3, int8 weights I8, int4 weights two to an int8 byte, NVFP4
weights two to a uint8 byte with an F8_E4M3 scale per 16 values.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors import safe_open

from pipeline.backends.trtllm.convert import convert
from pipeline.backends.trtllm.quantize import data_files, quantize
from pipeline.cli.main import cli
from pipeline.config.build_config import BuildConfig
from pipeline.errors import ConfigError
from pipeline.quantize.calibration import load_records
from pipeline.quantize.modelopt.export import export_unified_hf_checkpoint
from pipeline.quantize.modelopt.formats import quant_config
from pipeline.quantize.modelopt.library import (
    NVFP4_ON_CPU,
    ModelOptLog,
    import_modelopt,
    modelopt_version,
    release,
)
from pipeline.quantize.modelopt.loop import forward_loop, load_float_model
from pipeline.quantize.modelopt.state import STATE_FILE, load_simulated_model, save_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # nvidia-modelopt: `make install` installs it

# Few, short samples: the formats and files are what is tested, not the calibration's quality.
CALIBRATION = {"num_samples": 4, "max_seq_length": 64}
# The tiny llama (tests/fixtures_models.py): hidden 64, 4 heads of 16 (2 KV heads), intermediate 128.
TINY_LINEARS = {  # TensorRT-LLM name -> (out_features, in_features)
    "attention.qkv": (128, 64),
    "attention.dense": (64, 64),
    "mlp.fc": (128, 64),
    "mlp.gate": (128, 64),
    "mlp.proj": (64, 128),
}


def make_cfg(hf_dir: Path, **quantization: Any) -> BuildConfig:
    quantization.setdefault("calibration", CALIBRATION)
    parallel = quantization.pop("parallel", {})
    return BuildConfig.model_validate({
        "name": "mo", "backend": "trtllm", "source": {"kind": "local", "path": str(hf_dir)},
        "quantization": quantization, "parallel": parallel,
    })  # fmt: skip


def convert_and_quantize(cfg: BuildConfig, hf_dir: Path, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    ckpt, out = tmp_path / "checkpoint", tmp_path / "quantized"
    ckpt.mkdir(parents=True)
    out.mkdir()
    convert(cfg, hf_dir, ckpt)
    facts = quantize(cfg, ckpt, out, hf_dir=hf_dir)
    assert "tensorrt_llm" not in sys.modules  # the whole route runs without TensorRT-LLM
    return out, facts


def tensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of one rank file, read from its header."""
    with safe_open(str(path), "pt") as handle:
        slices = {name: handle.get_slice(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
        return {name: (s.get_dtype(), list(s.get_shape())) for name, s in slices.items()}


def numel(shape: list[int]) -> int:
    return int(torch.tensor(shape).prod()) if shape else 1


# Per format: the weight dtype, how many weight elements a byte-packed tensor holds per (out, in), and the
# scaling factors each linear carries (name -> dtype, element count as a function of out and in).
FORMATS: dict[str, dict[str, Any]] = {
    "fp8": {
        "weight": ("F8_E4M3", 1),
        "scales": {
            "weights_scaling_factor": ("F32", lambda o, i: 1),
            "activation_scaling_factor": ("F32", lambda o, i: 1),
        },
    },
    "int8_sq": {
        "weight": ("I8", 1),
        "scales": {
            "weights_scaling_factor": ("F32", lambda o, i: o),  # per output channel
            "activation_scaling_factor": ("F32", lambda o, i: 1),
            "prequant_scaling_factor": ("F16", lambda o, i: i),  # SmoothQuant's per input channel smoothing
        },
    },
    "int4_awq": {
        "weight": ("I8", 2),
        "scales": {
            "weights_scaling_factor": ("F32", lambda o, i: o * i // 32),  # per group of 32 inputs
            "prequant_scaling_factor": ("F16", lambda o, i: i),
        },
    },
    "w4a8_awq": {
        "weight": ("I8", 2),
        "scales": {
            "weights_scaling_factor": ("F32", lambda o, i: o * i // 64),
            "weights_scaling_factor_2": ("F32", lambda o, i: 1),
            "activation_scaling_factor": ("F32", lambda o, i: 1),
            "prequant_scaling_factor": ("F16", lambda o, i: i),
        },
    },
    "nvfp4": {
        "weight": ("U8", 2),
        "scales": {
            "weights_scaling_factor": ("F8_E4M3", lambda o, i: o * i // 16),
            "weights_scaling_factor_2": ("F32", lambda o, i: 1),
            "activation_scaling_factor": ("F32", lambda o, i: 1),
        },
    },
}
CASES = [  # (mode, group_size, kv_cache_dtype, expected quantization section)
    ("fp8", 128, "fp8", {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}),
    ("int8_sq", 128, "int8", {"quant_algo": "W8A8_SQ_PER_CHANNEL", "kv_cache_quant_algo": "INT8"}),
    ("int4_awq", 32, "auto", {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None, "group_size": 32,
                              "pre_quant_scale": True, "has_zero_point": False}),
    ("w4a8_awq", 64, "auto", {"quant_algo": "W4A8_AWQ", "kv_cache_quant_algo": None, "group_size": 64,
                              "pre_quant_scale": True}),
    ("nvfp4", 128, "auto", {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16}),
]  # fmt: skip


@pytest.mark.parametrize(("mode", "group_size", "kv", "expected"), CASES, ids=[c[0] for c in CASES])
def test_each_format_exports_a_tensorrt_llm_checkpoint(
    tiny_llama_dir: Path, tmp_path: Path, mode: str, group_size: int, kv: str, expected: dict[str, Any]
) -> None:
    if mode == "nvfp4" and release(modelopt_version() or "0.0") < NVFP4_ON_CPU:
        pytest.skip(f"nvidia-modelopt {modelopt_version()} quantizes NVFP4 on CUDA only")
    cfg = make_cfg(tiny_llama_dir, mode=mode, group_size=group_size, kv_cache_dtype=kv)
    out, facts = convert_and_quantize(cfg, tiny_llama_dir, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "LlamaForCausalLM" and config["dtype"] == "float16"  # auto: fp32 -> fp16
    assert config["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert expected.items() <= config["quantization"].items()
    assert config["quantization"]["exclude_modules"] == ["lm_head"]
    assert (config["rotary_base"], config["rotary_scaling"]) == (10000.0, None)
    names = tensors(out / "rank0.safetensors")
    weight_dtype, per_byte = FORMATS[mode]["weight"]
    for layer in range(2):
        for linear, (o, i) in TINY_LINEARS.items():
            prefix = f"transformer.layers.{layer}.{linear}"
            dtype, shape = names[f"{prefix}.weight"]
            assert (dtype, numel(shape)) == (weight_dtype, o * i // per_byte), prefix
            for scale, (scale_dtype, count) in FORMATS[mode]["scales"].items():
                assert (names[f"{prefix}.{scale}"][0], numel(names[f"{prefix}.{scale}"][1])) == (
                    scale_dtype, count(o, i)), f"{prefix}.{scale}"  # fmt: skip
        kv_scale = f"transformer.layers.{layer}.attention.kv_cache_scaling_factor"
        assert (names.get(kv_scale) == ("F32", [1])) == (kv != "auto")
        assert names[f"transformer.layers.{layer}.input_layernorm.weight"] == ("F16", [64])
    assert names["lm_head.weight"][0] == "F16"  # the output head stays unquantized
    # the manifest's facts
    assert (facts["quant_algo"], facts["kv_cache_quant_algo"]) == (
        expected["quant_algo"],
        expected["kv_cache_quant_algo"],
    )
    assert facts["group_size"] == expected.get("group_size")
    assert facts["modelopt_version"] == modelopt_version() and facts["tool_packages"] == ["nvidia-modelopt"]
    assert facts["calibration"]["samples"] == 4 and 0 < facts["calibration"]["tokens"] <= 4 * 64
    assert facts["checkpoint_files"] == ["config.json", "rank0.safetensors"]
    assert {"modelopt_state.pth", "modelopt.log", "tokenizer"} <= {p.name for p in out.iterdir()}
    assert (out / "tokenizer" / "tokenizer.json").is_file()  # travels on to the engine folder


def test_tp2_writes_one_shard_per_rank(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny_qwen2_dir, mode="int4_awq", group_size=32, parallel={"tp_size": 2})
    out, facts = convert_and_quantize(cfg, tiny_qwen2_dir, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1}
    assert config["architecture"] == "Qwen2ForCausalLM" and config["qwen_type"] == "qwen2"
    assert facts["checkpoint_files"] == ["config.json", "rank0.safetensors", "rank1.safetensors"]
    ranks = [tensors(out / f"rank{r}.safetensors") for r in range(2)]
    # column-parallel qkv splits its outputs, row-parallel dense its inputs: each rank holds half
    for rank in ranks:
        assert numel(rank["transformer.layers.0.attention.qkv.weight"][1]) == 128 * 64 // 2 // 2
        assert rank["transformer.layers.0.attention.dense.prequant_scaling_factor"] == ("F16", [32])
        assert "transformer.layers.0.attention.qkv.bias" in rank  # Qwen2's qkv bias


def test_the_simulated_model_has_the_calibrated_models_logits(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny_llama_dir, mode="int8_sq", kv_cache_dtype="int8")
    q = cfg.quantization
    log = ModelOptLog()
    mtq = import_modelopt(log)
    model, tokenizer = load_float_model(tiny_llama_dir)
    ids = torch.tensor([tokenizer("def main():\n    return sorted(items)")["input_ids"]])
    with torch.no_grad():
        float_logits = model(ids).logits
    loop = forward_loop(tokenizer, q.calibration, "test", progress=False)
    with log.capture():
        model = mtq.quantize(model, quant_config(mtq, q.mode, q.kv_cache_dtype, q.group_size), loop)
    with torch.no_grad():
        calibrated = model(ids).logits
    assert save_state(model, tmp_path, log) == STATE_FILE
    simulated = load_simulated_model(tiny_llama_dir, tmp_path)
    with torch.no_grad():
        rebuilt = simulated(ids).logits
    assert torch.equal(rebuilt, calibrated)
    assert (rebuilt - float_logits).abs().max() > 1e-2  # it is quantized
    # the same scales as the export: the int8 KV scale is max(k amax, v amax) / 127
    attention = simulated.model.layers[0].self_attn
    assert attention.k_bmm_quantizer.num_bits == 8
    expected = max(attention.k_bmm_quantizer.amax, attention.v_bmm_quantizer.amax) / 127
    out, _ = convert_and_quantize(cfg, tiny_llama_dir, tmp_path / "step")
    with safe_open(str(out / "rank0.safetensors"), "pt") as handle:
        exported = handle.get_tensor("transformer.layers.0.attention.kv_cache_scaling_factor")
    torch.testing.assert_close(exported, expected.reshape(1).float())
    assert torch.equal(load_simulated_model(tiny_llama_dir, out)(ids).logits, rebuilt)


def test_kv_cache_only_and_the_unified_hf_checkpoint(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny_llama_dir, mode="none", kv_cache_dtype="fp8")
    out, facts = convert_and_quantize(cfg, tiny_llama_dir, tmp_path)
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    assert (quantization["quant_algo"], quantization["kv_cache_quant_algo"]) == (None, "FP8")
    names = tensors(out / "rank0.safetensors")
    assert names["transformer.layers.0.attention.qkv.weight"] == ("F16", [128, 64])
    assert names["transformer.layers.0.attention.kv_cache_scaling_factor"] == ("F32", [1])
    hf_out = tmp_path / "hf"
    files = export_unified_hf_checkpoint(tiny_llama_dir, out, hf_out)
    assert {"config.json", "hf_quant_config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    hf_quant = json.loads((hf_out / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["kv_cache_quant_algo"] == "FP8"


def test_unified_hf_checkpoint_of_an_awq_build(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out, _ = convert_and_quantize(
        make_cfg(tiny_llama_dir, mode="int4_awq", group_size=64), tiny_llama_dir, tmp_path
    )
    hf_out = tmp_path / "hf"
    export_unified_hf_checkpoint(tiny_llama_dir, out, hf_out)
    hf_quant = json.loads((hf_out / "hf_quant_config.json").read_text())["quantization"]
    assert (hf_quant["quant_algo"], hf_quant["group_size"]) == ("W4A16_AWQ", 64)
    names = tensors(hf_out / "model.safetensors")
    dtype, shape = names["model.layers.0.self_attn.q_proj.weight"]
    assert dtype in ("I8", "U8") and numel(shape) == 64 * 64 // 2
    # q/k/v (and gate/up) share their input: ModelOpt folds their AWQ scale into the norm before them
    assert "model.layers.0.self_attn.o_proj.pre_quant_scale" in names
    assert names["model.embed_tokens.weight"] == ("F16", [2000, 64])


def test_a_users_calibration_folder(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "calib"
    folder.mkdir()
    (folder / "a.jsonl").write_text(
        '{"text": "def first(): pass"}\n{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    (folder / "b.json").write_text(json.dumps(["import os", {"text": "class Second: pass"}]))
    (folder / "c.txt").write_text("x = 1\n\ny = 2\n")
    (folder / "notes.md").write_text("not a calibration file")
    assert len(load_records(str(folder))) == 6
    cfg = make_cfg(tiny_llama_dir, mode="fp8", calibration={"dataset": str(folder), "num_samples": 10})
    assert sorted(data_files(cfg)) == ["calibration/a.jsonl", "calibration/b.json", "calibration/c.txt"]
    _, facts = convert_and_quantize(cfg, tiny_llama_dir, tmp_path / "run")
    assert facts["calibration"]["samples"] == 6  # every record of the three files, fewer than num_samples
    single = make_cfg(tiny_llama_dir, mode="fp8", calibration={"dataset": str(folder / "b.json")})
    assert data_files(single) == {"calibration": folder / "b.json"}


def test_a_group_size_that_does_not_divide_fails_before_loading(tmp_path: Path) -> None:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128}))  # fmt: skip
    out = tmp_path / "q"
    out.mkdir()
    cfg = make_cfg(hf_dir, mode="int4_awq", group_size=128)
    with pytest.raises(
        ConfigError, match="group_size=128 does not divide the model's hidden_size=64"
    ) as info:
        quantize(cfg, tmp_path, out, hf_dir=hf_dir)  # no weights there: nothing was loaded
    assert info.value.hint == "group sizes that fit: 32, 64"
    tp2 = make_cfg(hf_dir, mode="nvfp4", parallel={"tp_size": 8})
    with pytest.raises(
        ConfigError,
        match="blocks of 16, which do not divide the model's hidden_size=64 / parallel.tp_size=8 = 8",
    ):
        quantize(tp2, tmp_path, out, hf_dir=hf_dir)


def test_quantize_lm_head_is_fp8_only(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="quantize_lm_head=true with mode=int4_awq"):
        quantize(make_cfg(tiny_llama_dir, mode="int4_awq", group_size=32, quantize_lm_head=True), tmp_path, tmp_path,
                 hf_dir=tiny_llama_dir)  # fmt: skip
    out, facts = convert_and_quantize(
        make_cfg(tiny_llama_dir, mode="fp8", quantize_lm_head=True), tiny_llama_dir, tmp_path
    )
    assert "lm_head" not in (facts["exclude_modules"] or [])
    assert tensors(out / "rank0.safetensors")["lm_head.weight"][0] == "F8_E4M3"


def test_a_cpu_host_runs_fetch_convert_quantize_through_the_cli(tiny_llama_dir: Path, tmp_path: Path) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text("def first():\n    pass\n\nclass Second:\n    x = 1\n")
    config = tmp_path / "mo.yaml"
    config.write_text(yaml.safe_dump({
        "name": "mo", "backend": "trtllm", "workdir": str(tmp_path / "work"),
        "source": {"kind": "local", "path": str(tiny_llama_dir)},
        "quantization": {"mode": "w4a8_awq", "group_size": 32, "kv_cache_dtype": "fp8",
                         "calibration": {"dataset": str(calib), "max_seq_length": 32}},
    }))  # fmt: skip
    run = CliRunner().invoke(cli, ["build", str(config), "--until", "quantize"])
    assert run.exit_code == 0, run.output
    assert "Inserted" not in run.output and "current rank" not in run.output  # ModelOpt's chatter is logged
    quantized = tmp_path / "work" / "quantized"
    manifest = json.loads((quantized / "manifest.json").read_text())
    assert (manifest["facts"]["quant_algo"], manifest["facts"]["kv_cache_quant_algo"]) == ("W4A8_AWQ", "FP8")
    assert manifest["tool_versions"]["nvidia-modelopt"] == modelopt_version()
    assert "Inserted" in (quantized / "modelopt.log").read_text()
    assert (quantized / "tokenizer" / "tokenizer.json").is_file()
    assert "quantize: reused" in CliRunner().invoke(cli, ["build", str(config), "--until", "quantize"]).output
    calib.write_text("import os\n")  # the calibration file's contents key the stage's reuse
    again = CliRunner().invoke(cli, ["quantize", str(config)])
    assert again.exit_code == 0 and "quantize: done" in again.output, again.output
    # the engine still needs TensorRT-LLM: stopped at once, with what to install
    engine = CliRunner().invoke(cli, ["build", str(config)])
    assert engine.exit_code == 1 and "TensorRT-LLM is not installed" in engine.output
