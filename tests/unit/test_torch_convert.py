"""torch backend convert + build: the TensorRT-LLM-style checkpoint and engine directory, the HF -> runtime
weight mapping, the checks that reject what the runtime cannot run, and engine config loading."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pipeline.architectures.hf_config import pretrained_config_from_hf
from pipeline.backends.torch.build import build
from pipeline.backends.torch.checkpoint import convert
from pipeline.config.build_config import BuildConfig, build_config_from_dict
from pipeline.errors import BackendUnavailableError, ConfigError, MissingArtifactError, UnsupportedModelError
from pipeline.runtime.core.outputs import ScheduledRequest, SchedulerOutput
from pipeline.runtime.core.request import Request
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.engine_args import RunnerArgs
from pipeline.runtime.engine_config import load_engine_config, model_config_from_dict
from pipeline.runtime.kernels import build as kernel_build
from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.model.layers import DenseLinear
from pipeline.runtime.model.rope import rotary_cos_sin
from pipeline.runtime.quant.linear import QuantLinear
from pipeline.runtime.quant.primitives import dequantize_int8, quantize_int8_per_channel
from pipeline.runtime.worker.model_runner import ModelRunner
from tests.kernel_helpers import assert_widened_logits


def make_cfg(hf_dir: Path, **sections: Any) -> BuildConfig:
    data: dict[str, Any] = {
        "name": "t",
        "source": {"kind": "local", "path": str(hf_dir)},
        "engine": {"max_seq_len": 512, "max_input_len": 256, "max_num_tokens": 256, "max_batch_size": 4},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return build_config_from_dict(data)


def edited_copy(src: Path, dst: Path, **config_changes: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_checkpoint_layout_and_weight_mapping(tiny_llama_dir: Path, tmp_path: Path) -> None:
    facts = convert(make_cfg(tiny_llama_dir), tiny_llama_dir, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    hf_config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert config["architecture"] == "LlamaForCausalLM" and config["dtype"] == "float32"
    assert config["num_key_value_heads"] == hf_config["num_key_value_heads"]
    assert config["position_embedding_type"] == "rope_gpt_neox" and config["rotary_scaling"] is None
    assert config["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert config["quantization"]["quant_algo"] is None
    hf = load_file(tiny_llama_dir / "model.safetensors")
    ours = load_file(tmp_path / "rank0.safetensors")
    p, q = "transformer.layers.1.", "model.layers.1."
    qkv = torch.cat([hf[q + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(ours[p + "attention.qkv.weight"], qkv)
    gate_up = torch.cat([hf[q + "mlp.gate_proj.weight"], hf[q + "mlp.up_proj.weight"]])
    assert torch.equal(ours[p + "mlp.gate_up.weight"], gate_up)
    assert torch.equal(ours[p + "attention.dense.weight"], hf[q + "self_attn.o_proj.weight"])
    assert torch.equal(ours[p + "mlp.proj.weight"], hf[q + "mlp.down_proj.weight"])
    assert torch.equal(ours[p + "post_layernorm.weight"], hf[q + "post_attention_layernorm.weight"])
    assert torch.equal(ours["lm_head.weight"], hf["lm_head.weight"])
    assert torch.equal(ours["transformer.ln_f.weight"], hf["model.norm.weight"])
    assert facts["num_params"] == sum(t.numel() for t in hf.values())
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    assert (tmp_path / "tokenizer" / "generation_config.json").is_file()


def test_qwen2_bias_and_tied_lm_head_written_out(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    convert(make_cfg(tiny_qwen2_dir), tiny_qwen2_dir, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["qkv_bias"] and config["tie_word_embeddings"]
    hf = load_file(tiny_qwen2_dir / "model.safetensors")
    ours = load_file(tmp_path / "rank0.safetensors")
    bias = torch.cat([hf[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv"])
    assert torch.equal(ours["transformer.layers.0.attention.qkv.bias"], bias)
    assert torch.equal(ours["lm_head.weight"], hf["model.embed_tokens.weight"])


def test_sharded_checkpoint_converts_like_a_single_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_llama_dir, sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(sharded, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    convert(make_cfg(sharded), sharded, tmp_path / "a")
    convert(make_cfg(tiny_llama_dir), tiny_llama_dir, tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "rank0.safetensors"), load_file(tmp_path / "b" / "rank0.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unsupported_architecture_names_the_supported_ones(tiny_llama_dir: Path, tmp_path: Path) -> None:
    bad = edited_copy(tiny_llama_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"):
        convert(make_cfg(bad), bad, tmp_path / "out")


def test_unsupported_rope_scaling_fails_at_convert(tiny_llama_dir: Path, tmp_path: Path) -> None:
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    bad = edited_copy(tiny_llama_dir, tmp_path / "dynamic", rope_parameters=rope)
    with pytest.raises(
        UnsupportedModelError, match="'dynamic'.*supported: default, linear, llama3, yarn, longrope"
    ):
        convert(make_cfg(bad), bad, tmp_path / "out")


def test_max_seq_len_beyond_max_positions(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny_llama_dir, engine={"max_seq_len": 4096})
    with pytest.raises(ConfigError, match="max_seq_len=4096.*max_position_embeddings=1024"):
        convert(cfg, tiny_llama_dir, tmp_path)


def test_unmapped_tensor_is_rejected(tiny_llama_dir: Path, tmp_path: Path) -> None:
    odd = edited_copy(tiny_llama_dir, tmp_path / "odd")
    tensors = load_file(odd / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, odd / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="o_proj.bias"):
        convert(make_cfg(odd), odd, tmp_path / "out")


def test_build_writes_trtllm_style_engine_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(
        tiny_llama_dir,
        kv_cache={"tokens_per_block": 16, "max_tokens": 4096, "enable_block_reuse": True},
        scheduler={"policy": "max_utilization", "enable_chunked_context": True},
        speculative={"mode": "ngram", "max_draft_len": 3},
    )
    convert(cfg, tiny_llama_dir, tmp_path / "ckpt")
    facts = build(cfg, tmp_path / "ckpt", tmp_path / "engine")
    data = json.loads((tmp_path / "engine" / "config.json").read_text())
    assert set(data) == {"version", "backend", "pretrained_config", "build_config", "runtime_defaults"}
    assert data["build_config"]["plugin_config"]["tokens_per_block"] == 16
    assert data["build_config"]["kv_cache_type"] == "PAGED"
    assert data["build_config"]["max_draft_len"] == 3
    assert data["runtime_defaults"] == {
        "kv_max_tokens": 4096,
        "kv_free_memory_fraction": 0.2,
        "enable_block_reuse": True,
        "enable_chunked_context": True,
        "scheduler_policy": "max_utilization",
    }
    assert facts["weights_hardlinked"]
    assert (tmp_path / "engine" / "rank0.safetensors").stat().st_ino == (
        tmp_path / "ckpt" / "rank0.safetensors"
    ).stat().st_ino
    loaded = load_engine_config(tmp_path / "engine")
    assert loaded.model.num_hidden_layers == 2 and loaded.build.max_seq_len == 512
    assert loaded.tokenizer_dir.is_dir()


def test_build_compiles_the_cpu_kernels_and_records_them(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(kernel_build.DISABLE_ENV, raising=False)
    try:
        kernel_build.plan_library()
    except kernel_build.KernelsUnavailable as exc:
        pytest.skip(str(exc))
    cfg = make_cfg(tiny_llama_dir)
    convert(cfg, tiny_llama_dir, tmp_path / "ckpt")
    facts = build(cfg, tmp_path / "ckpt", tmp_path / "engine")
    library = kernel_build.plan_library()
    assert facts["kernels"] == {
        "isa": kernel_build.kernel_isa(),
        "compiler": kernel_build.compiler_identity(kernel_build.compiler_command()),
        "library_sha256": hashlib.sha256(library.path.read_bytes()).hexdigest(),
    }
    assert json.loads(json.dumps(facts)) == facts  # the stage manifest stores the facts as JSON


def test_build_without_a_compiler_fails_unless_the_torch_path_is_chosen(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_cfg(tiny_llama_dir)
    convert(cfg, tiny_llama_dir, tmp_path / "ckpt")
    monkeypatch.delenv(kernel_build.DISABLE_ENV, raising=False)
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(BackendUnavailableError, match="CPU kernels cannot be built here") as info:
        build(cfg, tmp_path / "ckpt", tmp_path / "engine")
    assert "\n" not in info.value.message
    assert info.value.hint is not None and "LLMPIPE_DISABLE_KERNELS=1" in info.value.hint
    assert not (tmp_path / "engine").exists()
    monkeypatch.setenv(kernel_build.DISABLE_ENV, "1")
    assert build(cfg, tmp_path / "ckpt", tmp_path / "engine")["kernels"] is None
    monkeypatch.delenv(kernel_build.DISABLE_ENV)
    cuda_cfg = make_cfg(tiny_llama_dir, engine={"device": "cuda"})  # a GPU engine never runs them
    assert build(cuda_cfg, tmp_path / "ckpt", tmp_path / "cuda-engine")["kernels"] is None


def test_engine_config_errors_name_the_field(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny_llama_dir)
    convert(cfg, tiny_llama_dir, tmp_path / "ckpt")
    build(cfg, tmp_path / "ckpt", tmp_path / "engine")
    path = tmp_path / "engine" / "config.json"
    good = json.loads(path.read_text())
    for section, key, value, pattern in [
        ("build_config", "max_seq_len", 99999, "build_config.max_seq_len=99999"),
        ("runtime_defaults", "scheduler_policy", "fifo", "runtime_defaults.scheduler_policy='fifo'"),
        ("pretrained_config", "hidden_act", "gelu", "pretrained_config.hidden_act='gelu'"),
    ]:
        data = json.loads(json.dumps(good))
        data[section][key] = value
        path.write_text(json.dumps(data))
        with pytest.raises(ConfigError, match=pattern):
            load_engine_config(tmp_path / "engine")
    with pytest.raises(MissingArtifactError):
        load_engine_config(tmp_path)


def test_build_rejects_a_checkpoint_of_another_quantization(tiny_llama_dir: Path, tmp_path: Path) -> None:
    convert(make_cfg(tiny_llama_dir), tiny_llama_dir, tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="quant_algo"):
        build(
            make_cfg(tiny_llama_dir, quantization={"mode": "int8_wo"}), tmp_path / "ckpt", tmp_path / "engine"
        )


def test_bf16_storage_is_computed_in_fp32_on_cpu(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny_llama_dir, dtype="bfloat16")
    convert(cfg, tiny_llama_dir, tmp_path / "ckpt")
    build(cfg, tmp_path / "ckpt", tmp_path / "engine")
    with safe_open(tmp_path / "engine" / "rank0.safetensors", "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    runner = ModelRunner.from_engine_dir(tmp_path / "engine", RunnerArgs(device="cpu", kv_max_tokens=512))
    weights = runner.model.weights
    assert runner.dtype == torch.float32
    # The bf16 lm_head is read widened (fp32 arithmetic on the stored values) where the kernels run.
    stored = torch.bfloat16 if kernels.kernels_available() else torch.float32
    assert weights.lm_head.weight.dtype == stored  # type: ignore[attr-defined]
    x = torch.randn(2, weights.final_norm.shape[0])
    normed = runner.model.norm(x.clone(), None, weights.final_norm)
    fp32_copy = DenseLinear(weights.lm_head.weight.float())  # type: ignore[attr-defined]
    assert_widened_logits(lambda: runner.model.compute_logits(x.clone()), fp32_copy(normed))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 5000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
        {
            "rope_type": "yarn",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "truncate": False,
        },
    ],
    ids=lambda r: f"{r['rope_type']}-{r['rope_theta']:g}",
)
def test_rope_tables_equal_transformers(rope: dict[str, Any]) -> None:
    hf_config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=512, rope_parameters=rope
    )
    pretrained = json.loads(hf_config.to_json_string())
    model = model_config_from_dict(
        pretrained_config_from_hf({**pretrained, "architectures": ["LlamaForCausalLM"]}, "float32")
    )
    ours = rotary_cos_sin(model, 512)
    positions = torch.arange(512)[None]
    cos, sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    half = model.head_dim // 2
    assert torch.equal(ours[:, :half], cos[0, :, :half]) and torch.equal(ours[:, half:], sin[0, :, :half])


def test_quantized_tensors_load_through_quant_linear(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A checkpoint whose qkv is stored as int8 runs like a dense one holding the dequantized weight."""
    cfg = make_cfg(tiny_llama_dir)
    convert(cfg, tiny_llama_dir, tmp_path / "dense")
    weights = load_file(tmp_path / "dense" / "rank0.safetensors")
    name = "transformer.layers.0.attention.qkv"
    qweight, scales = quantize_int8_per_channel(weights[f"{name}.weight"])
    weights[f"{name}.weight"] = dequantize_int8(qweight, scales)
    save_file(weights, tmp_path / "dense" / "rank0.safetensors")
    shutil.copytree(tmp_path / "dense", tmp_path / "int8")
    del weights[f"{name}.weight"]
    save_file(
        {**weights, f"{name}.qweight": qweight, f"{name}.scales": scales},
        tmp_path / "int8" / "rank0.safetensors",
    )
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    config["quantization"]["quant_algo"] = "W8A16"
    (tmp_path / "int8" / "config.json").write_text(json.dumps(config))

    quant_cfg = make_cfg(tiny_llama_dir, quantization={"mode": "int8_wo"})
    build(cfg, tmp_path / "dense", tmp_path / "dense-engine")
    build(quant_cfg, tmp_path / "int8", tmp_path / "int8-engine")
    dense = ModelRunner.from_engine_dir(
        tmp_path / "dense-engine", RunnerArgs(device="cpu", kv_max_tokens=512)
    )
    quantized = ModelRunner.from_engine_dir(
        tmp_path / "int8-engine", RunnerArgs(device="cpu", kv_max_tokens=512)
    )
    assert isinstance(quantized.model.weights.layers[0].qkv, QuantLinear)
    assert isinstance(quantized.model.weights.layers[1].qkv, DenseLinear)
    prompt = list(range(20, 60))
    outputs = []
    for runner in (dense, quantized):
        request = Request("q", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        request.block_table = list(range(3))
        outputs.append(runner.execute(SchedulerOutput([ScheduledRequest(request, len(prompt), sample=True)])))
    assert outputs[0].sampled_token_ids == outputs[1].sampled_token_ids


def test_unknown_quant_algo_fails_at_load(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny_llama_dir)
    convert(cfg, tiny_llama_dir, tmp_path / "ckpt")
    build(cfg, tmp_path / "ckpt", tmp_path / "engine")
    weights = load_file(tmp_path / "engine" / "rank0.safetensors")
    name = "transformer.layers.0.mlp.proj"
    weights[f"{name}.qweight"] = weights.pop(f"{name}.weight").to(torch.int8)
    (tmp_path / "engine" / "rank0.safetensors").unlink()  # hard-linked to the checkpoint's copy
    save_file(weights, tmp_path / "engine" / "rank0.safetensors")
    data = json.loads((tmp_path / "engine" / "config.json").read_text())
    data["pretrained_config"]["quantization"]["quant_algo"] = "FP8"
    (tmp_path / "engine" / "config.json").write_text(json.dumps(data))
    with pytest.raises(UnsupportedModelError, match="FP8"):
        ModelRunner.from_engine_dir(tmp_path / "engine", RunnerArgs(device="cpu", kv_max_tokens=512))


def test_fp8_kv_cache_is_refused_at_load(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny_llama_dir)
    convert(cfg, tiny_llama_dir, tmp_path / "ckpt")
    build(cfg, tmp_path / "ckpt", tmp_path / "engine")
    path = tmp_path / "engine" / "config.json"
    data = json.loads(path.read_text())
    data["pretrained_config"]["quantization"]["kv_cache_quant_algo"] = "FP8"
    path.write_text(json.dumps(data))
    with pytest.raises(UnsupportedModelError, match="kv_cache_quant_algo=FP8"):
        ModelRunner.from_engine_dir(tmp_path / "engine", RunnerArgs(device="cpu", kv_max_tokens=512))
