"""The deployment guards: version and GPU mismatch, SM too old for the format, KV capacity, prompt limits,
runtime features that need build flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.artifacts import Manifest
from pipeline.backends.trtllm import env, guards
from pipeline.backends.trtllm.versions import RELEASES, release, release_for_runtime
from pipeline.config.build_config import BuildConfig
from pipeline.errors import ConfigError, ServingError

A100 = env.Gpu(0, "NVIDIA A100-SXM4-80GB", "8.0", 81920, 80000)
L40S = env.Gpu(0, "NVIDIA L40S", "8.9", 46068, 45000)
H100 = env.Gpu(0, "NVIDIA H100 80GB HBM3", "9.0", 81559, 80000)
B200 = env.Gpu(0, "NVIDIA B200", "10.0", 183359, 180000)

# A Llama-3-8B-shaped TensorRT-LLM checkpoint config.json (the fields the guards read).
CKPT_CONFIG: dict[str, Any] = {
    "architecture": "LlamaForCausalLM", "dtype": "float16", "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "hidden_size": 4096, "max_position_embeddings": 8192,
}  # fmt: skip


def make_cfg(**sections: Any) -> BuildConfig:
    data = {"name": "g", "backend": "trtllm", "source": {"kind": "local", "path": "m"}, **sections}
    return BuildConfig.model_validate(data)


def engine_config(**build: Any) -> dict[str, Any]:
    """An engine config.json in the post-0.8 layout (`version`, `pretrained_config`, `build_config`)."""
    plugin = {"tokens_per_block": 32, "use_paged_context_fmha": True, "paged_kv_cache": True}
    plugin.update(build.pop("plugin_config", {}))
    base = {"max_batch_size": 16, "max_input_len": 1024, "max_seq_len": 2048, "max_beam_width": 1,
            "max_num_tokens": 2048, "max_draft_len": 0, "plugin_config": plugin}  # fmt: skip
    base.update(build)
    return {"version": "1.2.0", "pretrained_config": {"mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}},
            "build_config": base}  # fmt: skip


# ---- versions -------------------------------------------------------------------------------------------
BUILT = {"tensorrt_llm_version": "1.2.0", "tensorrt_version": "10.14.1.48", "gpu_compute_capability": "9.0"}


def test_same_versions_pass() -> None:
    guards.check_runtime_matches(BUILT, "1.2.0", "10.14.1.48")


@pytest.mark.parametrize(("trtllm", "trt", "match"), [
    ("1.1.0", "10.14.1.48", "engine built with TensorRT-LLM 1.2.0, runtime has 1.1.0"),
    ("1.2.0", "10.13.3.9", "engine built with TensorRT 10.14.1.48, runtime has 10.13.3.9"),
    (None, None, "TensorRT-LLM is not installed here"),
])  # fmt: skip
def test_version_mismatch_is_refused(trtllm: str | None, trt: str | None, match: str) -> None:
    with pytest.raises(ServingError, match=match) as info:
        guards.check_runtime_matches(BUILT, trtllm, trt)
    assert "make image" in (info.value.hint or "")


def test_engine_without_recorded_version_is_refused() -> None:
    with pytest.raises(ServingError, match="records no TensorRT-LLM version"):
        guards.check_runtime_matches({}, "1.2.0", None)


def test_engine_for_another_gpu_architecture_is_refused() -> None:
    guards.check_gpu_matches(BUILT, [H100])
    with pytest.raises(ServingError, match=r"built for compute capability 9.0, this machine has 8.9"):
        guards.check_gpu_matches(BUILT, [L40S])


def test_runtime_versions_map_onto_the_release_table() -> None:
    assert release_for_runtime("1.2.0rc7").version == "1.2.0"
    assert release_for_runtime("1.1.0").version == "1.1.0"
    with pytest.raises(ConfigError, match="1.3.0 is not a release"):
        release_for_runtime("1.3.0")
    assert release().triton_container == "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"


def test_releases_pair_with_the_containers_tritons_matrix_lists() -> None:
    # https://docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/introduction/compatibility.html
    assert RELEASES["1.1.0"].triton_container == "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"
    assert RELEASES["1.0.0"].triton_container == "nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3"
    assert RELEASES["1.2.0"].triton_container is None  # no container listed with 1.2.x
    assert release().version == "1.1.0"


def test_patch_releases_map_to_their_minor_release() -> None:
    assert release_for_runtime("1.2.1").version == "1.2.0"
    assert release_for_runtime("1.0.3").version == "1.0.0"
    assert release_for_runtime("1.2.0rc7").version == "1.2.0"
    with pytest.raises(ConfigError, match="0.19.0 is not a release"):
        release_for_runtime("0.19.0")


# ---- GPU architecture vs format ---------------------------------------------------------------------------
@pytest.mark.parametrize(("quant", "gpu", "needs"), [
    ({"mode": "fp8"}, A100, "SM89"),
    ({"mode": "w4a8_awq"}, A100, "SM89"),
    ({"mode": "nvfp4"}, H100, "SM100"),
    ({"mode": "int4_awq", "kv_cache_dtype": "fp8"}, A100, "SM89"),
])  # fmt: skip
def test_sm_too_old_for_the_format_is_refused(quant: dict[str, str], gpu: env.Gpu, needs: str) -> None:
    with pytest.raises(ConfigError, match=needs):
        guards.check_gpu_supports(make_cfg(quantization=quant), [gpu])


def test_formats_run_on_new_enough_gpus() -> None:
    guards.check_gpu_supports(make_cfg(quantization={"mode": "fp8", "kv_cache_dtype": "fp8"}), [L40S, H100])
    guards.check_gpu_supports(make_cfg(quantization={"mode": "nvfp4"}), [B200])
    guards.check_gpu_supports(make_cfg(quantization={"mode": "int4_awq"}), [A100])


def test_world_size_needs_as_many_gpus() -> None:
    with pytest.raises(ConfigError, match="needs that many GPUs; this machine has 1"):
        guards.check_world_size(make_cfg(parallel={"tp_size": 2}), [H100])


# ---- KV capacity --------------------------------------------------------------------------------------------
def test_kv_tokens_for_one_sequence_rounds_up_to_blocks_and_beams() -> None:
    cfg = make_cfg(engine={"max_seq_len": 2049, "max_beam_width": 2}, kv_cache={"tokens_per_block": 64})
    assert guards.kv_tokens_for_one_sequence(cfg) == 2 * 64 * 33


def test_kv_bytes_per_token_follow_shape_dtype_and_parallelism() -> None:
    # 2 (K,V) * 32 layers * 8 kv heads * 128 head dim * 2 bytes
    assert guards.kv_bytes_per_token(make_cfg(), CKPT_CONFIG) == 131072
    assert guards.kv_bytes_per_token(make_cfg(quantization={"kv_cache_dtype": "fp8"}), CKPT_CONFIG) == 65536
    assert guards.kv_bytes_per_token(make_cfg(parallel={"tp_size": 2}), CKPT_CONFIG) == 65536


def test_kv_capacity_from_memory_is_refused_when_one_sequence_does_not_fit() -> None:
    cfg = make_cfg(engine={"max_seq_len": 8192}, kv_cache={"free_memory_fraction": 0.1})
    # 17 GiB free, 16 GiB of weights: 0.1 * 1 GiB / 128 KiB per token = 819 tokens < 8192.
    capacity = guards.kv_capacity_tokens(cfg, CKPT_CONFIG, 17 << 30, 16 << 30)
    assert capacity == 819
    with pytest.raises(
        ConfigError, match="holds 819 tokens, one sequence of engine.max_seq_len=8192 needs 8192"
    ):
        guards.check_kv_capacity(cfg, capacity)


def test_kv_capacity_is_capped_by_max_tokens_and_reported() -> None:
    cfg = make_cfg(kv_cache={"max_tokens": 4096, "free_memory_fraction": 0.9})
    capacity = guards.kv_capacity_tokens(cfg, CKPT_CONFIG, 80 << 30, 16 << 30)
    assert capacity == 4096
    assert guards.check_kv_capacity(cfg, capacity) == {
        "kv_tokens_per_sequence": 2048, "kv_capacity_tokens": 4096, "kv_full_sequences": 2,
    }  # fmt: skip


# ---- prompt limits ------------------------------------------------------------------------------------------
def test_max_seq_len_beyond_the_models_positions_is_refused() -> None:
    cfg = make_cfg(engine={"max_seq_len": 16384, "max_input_len": 1024})
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings=8192"):
        guards.check_prompt_limits(cfg, CKPT_CONFIG)
    guards.check_prompt_limits(cfg, {**CKPT_CONFIG, "rotary_scaling": {"type": "linear", "factor": 2.0}})


def test_chunked_context_lifts_the_prompt_limit() -> None:
    assert guards.effective_max_input_len(make_cfg()) == 1024
    chunked = make_cfg(scheduler={"enable_chunked_context": True})
    assert guards.effective_max_input_len(chunked) == 2047


# ---- runtime features vs build flags -------------------------------------------------------------------------
def test_matching_engine_passes() -> None:
    guards.check_runtime_features(make_cfg(kv_cache={"enable_block_reuse": True}), engine_config())


@pytest.mark.parametrize(("sections", "build", "match"), [
    ({"kv_cache": {"enable_block_reuse": True}}, {"plugin_config": {"use_paged_context_fmha": False}},
     "kv_cache.enable_block_reuse=true but the engine was built with use_paged_context_fmha=disable"),
    ({"scheduler": {"enable_chunked_context": True}}, {"plugin_config": {"use_paged_context_fmha": False}},
     "scheduler.enable_chunked_context=true"),
    ({"kv_cache": {"tokens_per_block": 64}}, {}, "tokens_per_block=64 but the engine was built with tokens_per_block=32"),
    ({"engine": {"max_beam_width": 2}}, {}, "max_beam_width=2"),
    ({"serving": {"triton_max_batch_size": 8}}, {"max_batch_size": 4}, "triton_max_batch_size=8"),
    ({"speculative": {"mode": "draft_model", "draft_config": "d.yaml"}}, {}, "max_draft_len=4 but"),
    ({}, {"max_draft_len": 10}, "speculative.mode=none max_draft_len=0"),
    ({"parallel": {"tp_size": 2}}, {}, "tp_size\\*pp_size=2"),
])  # fmt: skip
def test_runtime_features_that_need_build_flags(
    sections: dict[str, Any], build: dict[str, Any], match: str
) -> None:
    with pytest.raises(ServingError, match=match):
        guards.check_runtime_features(make_cfg(**sections), engine_config(**build))


@pytest.mark.parametrize(("spec", "match"), [
    ({"mode": "ngram"}, "no server-side implementation"),
    ({"mode": "medusa"}, "needs a checkpoint with medusa heads"),
])  # fmt: skip
def test_speculative_modes_the_engine_path_cannot_build(spec: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        guards.check_build_features(make_cfg(speculative=spec))


def test_draft_target_needs_paged_context_fmha() -> None:
    cfg = make_cfg(
        speculative={"mode": "draft_model", "draft_config": "d.yaml"},
        kv_cache={"use_paged_context_fmha": False},
    )
    with pytest.raises(ConfigError, match="draft_model needs kv_cache.use_paged_context_fmha=true"):
        guards.check_build_features(cfg)


def test_preflight_serve_reads_the_engine_manifest_and_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = tmp_path / "engine"
    engine.mkdir()
    manifest = Manifest(stage="engine", config_hash="h", inputs={}, files=[], tool_versions={}, facts=BUILT)
    (engine / "manifest.json").write_text(manifest.to_json())
    monkeypatch.setattr(env, "tensorrt_llm_version", lambda: env.Probe("1.2.0"))
    monkeypatch.setattr(env, "tensorrt_version", lambda: env.Probe("10.14.1.48"))
    monkeypatch.setattr(env, "gpus", lambda: env.Probe([H100]))
    with pytest.raises(ServingError, match="config.json is missing or not JSON"):
        guards.preflight_serve(make_cfg(), engine)
    (engine / "config.json").write_text(json.dumps(engine_config()))
    guards.preflight_serve(make_cfg(), engine)
    monkeypatch.setattr(env, "tensorrt_llm_version", lambda: env.Probe("1.1.0"))
    with pytest.raises(ServingError, match="runtime has 1.1.0"):
        guards.preflight_serve(make_cfg(), engine)
