"""The deployment guards: version and GPU mismatch, formats a GPU cannot build, KV capacity, prompt limits,
runtime features that need build flags, and the config-time refusals of what TensorRT-LLM aborts on.

Upstream behaviour the tests stand on, from the pinned release 1.1.0 (its source as rendered on gh-pages,
NVIDIA/TensorRT-LLM:1.1.0/_modules/tensorrt_llm/builder.html@8660c11, `build()`): the builder turns
use_paged_context_fmha off for an INT8 KV cache and for an FP8 KV cache under weights other than FP8 /
W4A8_AWQ / NVFP4; raises on SM100-SM119 for INT8/INT4 weight-only, INT8 KV, SmoothQuant and per-channel or
per-token scaling; and records max_seq_len + max_draft_len (and max_num_tokens >= max_batch_size *
(max_draft_len + 1)) in a speculative engine's build_config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.artifacts import Manifest
from pipeline.backends.trtllm import convert as convert_step
from pipeline.backends.trtllm import env, guards
from pipeline.backends.trtllm.build_cmd import trtllm_build_argv
from pipeline.backends.trtllm.triton_params import tensorrt_llm_parameters
from pipeline.backends.trtllm.versions import RELEASES, release, release_for_runtime
from pipeline.cli.doctor import collect_report
from pipeline.config.build_config import BuildConfig, build_config_from_dict, load_build_config
from pipeline.errors import ConfigError, ServingError
from tests.conftest import REPO_ROOT
from tests.contract.render import CONFIG_DIR

A100 = env.Gpu(0, "NVIDIA A100-SXM4-80GB", "8.0", 81920, 80000)
L40S = env.Gpu(0, "NVIDIA L40S", "8.9", 46068, 45000)
H100 = env.Gpu(0, "NVIDIA H100 80GB HBM3", "9.0", 81559, 80000)
B200 = env.Gpu(0, "NVIDIA B200", "10.0", 183359, 180000)
RTX_PRO_6000 = env.Gpu(0, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "12.0", 97887, 97000)

# A Llama-3-8B-shaped TensorRT-LLM checkpoint config.json (the fields the guards read).
CKPT_CONFIG: dict[str, Any] = {
    "architecture": "LlamaForCausalLM", "dtype": "float16", "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "hidden_size": 4096, "max_position_embeddings": 8192,
}  # fmt: skip


def make_cfg(**sections: Any) -> BuildConfig:
    return build_config_from_dict({"name": "g", "backend": "trtllm", "source": {"kind": "local", "path": "m"},
                                   **sections})  # fmt: skip


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


@pytest.mark.parametrize("quant", [
    {"mode": "int8_wo"}, {"mode": "int4_wo"}, {"mode": "int4_awq"}, {"mode": "w4a8_awq"}, {"mode": "int8_sq"},
    {"mode": "fp8_pc_pt"}, {"mode": "fp8", "kv_cache_dtype": "int8"},
])  # fmt: skip
def test_blackwell_datacenter_gpus_refuse_integer_and_per_channel_formats(quant: dict[str, str]) -> None:
    # INT8/INT4 weight-only (W4A16_AWQ and W4A8_AWQ map to INT4 weight-only flags), SmoothQuant, FP8
    # per-channel/per-token and an INT8 KV cache raise in the builder on SM100-SM119.
    with pytest.raises(ConfigError, match="refused by TensorRT-LLM's engine builder on SM100-SM119") as info:
        guards.check_gpu_supports(make_cfg(quantization=quant), [B200])
    assert "GPU 0 (NVIDIA B200) is SM100 (10.0)" in info.value.message
    assert info.value.hint == (
        "On this GPU use quantization.mode none / fp8 / nvfp4 with kv_cache_dtype auto / fp8, "
        "or build on another GPU."
    )


def test_blackwell_runs_fp8_and_nvfp4_and_rtx_blackwell_is_not_refused() -> None:
    for quant in ({"mode": "none"}, {"mode": "fp8", "kv_cache_dtype": "fp8"}, {"mode": "nvfp4"}):
        guards.check_gpu_supports(make_cfg(quantization=quant), [B200])
    # the builder's refused range ends below SM120
    guards.check_gpu_supports(
        make_cfg(quantization={"mode": "int4_awq", "kv_cache_dtype": "int8"}), [RTX_PRO_6000]
    )


def test_every_gpu_is_checked_not_only_the_oldest() -> None:
    b200_second = env.Gpu(1, "NVIDIA B200", "10.0", 183359, 180000)
    with pytest.raises(ConfigError, match=r"int4_awq is refused .* GPU 1 \(NVIDIA B200\)"):
        guards.check_gpu_supports(make_cfg(quantization={"mode": "int4_awq"}), [H100, b200_second])


def test_the_shipped_int4_awq_config_stops_on_b200_before_convert(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_build_config(REPO_ROOT / "build_configs" / "llama3-8b-int4-awq-tp2.yaml")
    b200s = [env.Gpu(i, "NVIDIA B200", "10.0", 183359, 180000) for i in range(2)]
    monkeypatch.setattr(env, "gpus", lambda: env.Probe(b200s))

    def heavy_work(*_: Any) -> None:
        raise AssertionError("convert reached TensorRT-LLM")

    monkeypatch.setattr(convert_step, "load_api", heavy_work)
    with pytest.raises(ConfigError, match="quantization.mode=int4_awq is refused"):
        convert_step.convert(cfg, Path("hf"), Path("out"))


def test_doctor_lists_only_the_formats_every_gpu_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env, "gpus", lambda: env.Probe([B200]))
    monkeypatch.setattr(env, "tensorrt_llm_version", lambda: env.Probe("1.1.0"))
    trtllm = collect_report()["backends"]["trtllm"]
    assert trtllm["quant_modes"] == ["none", "fp8", "nvfp4"]
    assert trtllm["kv_cache_dtypes"] == ["auto", "fp8"]


def test_world_size_needs_as_many_gpus() -> None:
    with pytest.raises(ConfigError, match="needs that many GPUs; this machine has 1"):
        guards.check_world_size(make_cfg(parallel={"tp_size": 2}), [H100])


# ---- KV capacity --------------------------------------------------------------------------------------------
def test_kv_tokens_for_one_sequence_rounds_up_to_blocks_and_beams() -> None:
    cfg = make_cfg(engine={"max_seq_len": 2049, "max_beam_width": 2}, kv_cache={"tokens_per_block": 64})
    assert guards.kv_tokens_for_one_sequence(cfg) == 2 * 64 * 33


def test_a_speculative_engines_sequence_includes_its_draft_tokens() -> None:
    # The engine records max_seq_len 2048 + 15 drafts and sizes its blocks per sequence by that.
    cfg = make_cfg(speculative={"mode": "lookahead", "max_draft_len": 15})
    assert guards.kv_tokens_for_one_sequence(cfg) == 32 * 65


def test_kv_bytes_per_token_follow_shape_dtype_and_parallelism() -> None:
    # 2 (K,V) * 32 layers * 8 kv heads * 128 head dim * 2 bytes
    assert guards.kv_bytes_per_token(make_cfg(), CKPT_CONFIG) == 131072
    assert guards.kv_bytes_per_token(make_cfg(quantization={"kv_cache_dtype": "fp8"}), CKPT_CONFIG) == 65536
    assert guards.kv_bytes_per_token(make_cfg(parallel={"tp_size": 2}), CKPT_CONFIG) == 65536


LLAMA3_8B = {**CKPT_CONFIG, "intermediate_size": 14336}


def test_kv_capacity_leaves_room_for_the_activations_of_a_full_step() -> None:
    # One 8192-token sequence needs 8192 * 128 KiB = 1 GiB of KV; at fraction 0.5 that is 2 GiB left over
    # the 16 GiB of weights. The engine's activations take their share of that before the KV cache is
    # sized: at least the MLP's gate and up outputs of 8192 tokens, 8192 * 2 * 14336 * 2 bytes = 448 MiB.
    cfg = make_cfg(engine={"max_seq_len": 8192, "max_input_len": 8192, "max_num_tokens": 8192},
                   kv_cache={"free_memory_fraction": 0.5})  # fmt: skip
    assert guards.activation_bytes_floor(cfg, LLAMA3_8B) == 448 << 20
    capacity = guards.kv_capacity_tokens(cfg, LLAMA3_8B, 18 << 30, 16 << 30)
    assert capacity == ((2 << 30) - (448 << 20)) // 2 // 131072 == 6400
    with pytest.raises(
        ConfigError, match="holds at most 6400 tokens, one sequence of max_seq_len=8192 needs 8192"
    ):
        guards.check_kv_capacity(cfg, capacity)
    # Each rank holds its shard of the MLP, so tensor parallelism divides the floor.
    assert guards.activation_bytes_floor(make_cfg(parallel={"tp_size": 2}), LLAMA3_8B) == 2048 * 14336 * 2


def test_kv_capacity_is_capped_by_max_tokens_and_reported() -> None:
    cfg = make_cfg(kv_cache={"max_tokens": 4096, "free_memory_fraction": 0.9})
    capacity = guards.kv_capacity_tokens(cfg, CKPT_CONFIG, 80 << 30, 16 << 30)
    assert capacity == 4096
    assert guards.check_kv_capacity(cfg, capacity) == {
        "kv_tokens_per_sequence": 2048, "kv_capacity_tokens": 4096, "kv_full_sequences": 2,
    }  # fmt: skip


# ---- kv_cache.free_memory_fraction: the backend's default ------------------------------------------------
def test_unset_free_memory_fraction_is_tensorrtllm_backends_default() -> None:
    # tensorrtllm_backend uses 0.9 when kv_cache_free_gpu_mem_fraction is not given
    # (triton-inference-server/tensorrtllm_backend:docs/model_config.md@b155c0e).
    cfg = make_cfg()
    assert cfg.kv_cache.free_memory_fraction == cfg.kv_free_memory_fraction == 0.9
    assert tensorrt_llm_parameters(cfg, "engine")["kv_cache_free_gpu_mem_fraction"] == "0.9"
    # the guard sizes the cache with it: 0.9 * 64 GiB / 128 KiB per token, less the activation floor
    left = (80 << 30) - (16 << 30) - guards.activation_bytes_floor(cfg, CKPT_CONFIG)
    assert guards.kv_capacity_tokens(cfg, CKPT_CONFIG, 80 << 30, 16 << 30) == int(left * 0.9) // 131072
    explicit = make_cfg(kv_cache={"free_memory_fraction": 0.5})
    assert tensorrt_llm_parameters(explicit, "engine")["kv_cache_free_gpu_mem_fraction"] == "0.5"


def test_a_whole_gpu_for_the_kv_cache_is_refused_on_trtllm() -> None:
    # The executor requires freeMemFraction < 1 (kvCacheManager.cpp, calculateFreeMemBytes).
    with pytest.raises(
        ConfigError, match="kv_cache.free_memory_fraction=1.0 on backend=trtllm must be below 1"
    ):
        make_cfg(kv_cache={"free_memory_fraction": 1.0})


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
    ({"speculative": {"mode": "draft_model", "draft_config": "d.yaml"}, "kv_cache": {"enable_block_reuse": True}},
     {"max_seq_len": 2052}, "max_draft_len=4 but"),
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


# ---- config-time refusals of what TensorRT-LLM aborts on --------------------------------------------------
@pytest.mark.parametrize(("sections", "match"), [
    ({"quantization": {"kv_cache_dtype": "int8"}, "kv_cache": {"enable_block_reuse": True}},
     "kv_cache.enable_block_reuse=true needs paged context FMHA, which TensorRT-LLM's engine builder turns off "
     "for an int8 KV cache \\(quantization.kv_cache_dtype=int8\\)"),
    ({"quantization": {"mode": "int8_wo", "kv_cache_dtype": "int8"}, "scheduler": {"enable_chunked_context": True}},
     "scheduler.enable_chunked_context=true needs paged context FMHA"),
    ({"quantization": {"mode": "int4_awq", "kv_cache_dtype": "fp8"}, "kv_cache": {"enable_block_reuse": True}},
     "an fp8 KV cache under quantization.mode=int4_awq weights"),
    ({"quantization": {"mode": "fp8_pc_pt", "kv_cache_dtype": "fp8"}, "scheduler": {"enable_chunked_context": True}},
     "an fp8 KV cache under quantization.mode=fp8_pc_pt weights"),
    ({"quantization": {"kv_cache_dtype": "fp8"}, "kv_cache": {"enable_block_reuse": True}},
     "or set kv_cache.enable_block_reuse=false"),
])  # fmt: skip
def test_kv_formats_that_turn_paged_context_fmha_off_refuse_reuse_and_chunking(
    sections: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        make_cfg(**sections)


def test_kv_formats_that_keep_paged_context_fmha_allow_reuse_and_chunking() -> None:
    features = {"kv_cache": {"enable_block_reuse": True}, "scheduler": {"enable_chunked_context": True}}
    for mode in ("fp8", "w4a8_awq", "nvfp4"):
        cfg = make_cfg(quantization={"mode": mode, "kv_cache_dtype": "fp8"}, **features)
        assert _flag(trtllm_build_argv(cfg, "c", "e"), "--use_paged_context_fmha") == "enable"
    make_cfg(quantization={"mode": "int4_awq"}, **features)


def test_the_command_line_says_what_the_builder_will_do_with_paged_context_fmha() -> None:
    # Without reuse or chunking an int8 / mismatched fp8 KV cache is allowed, and the builder turns paged
    # context FMHA off: the command line does not ask for it.
    for quant in ({"kv_cache_dtype": "int8"}, {"mode": "int8_wo", "kv_cache_dtype": "fp8"}):
        cfg = make_cfg(quantization=quant)
        assert _flag(trtllm_build_argv(cfg, "c", "e"), "--use_paged_context_fmha") == "disable"
    assert _flag(trtllm_build_argv(make_cfg(), "c", "e"), "--use_paged_context_fmha") == "enable"


DRAFT = {"mode": "draft_model", "draft_config": "d.yaml"}


@pytest.mark.parametrize(("sections", "match"), [
    ({}, "speculative.mode=draft_model on backend=trtllm needs kv_cache.enable_block_reuse=true"),
    ({"kv_cache": {"enable_block_reuse": True}, "engine": {"max_beam_width": 2}},
     "speculative.mode=draft_model on backend=trtllm has no beam search, but engine.max_beam_width=2"),
    ({"kv_cache": {"enable_block_reuse": True, "use_paged_context_fmha": False}},
     "kv_cache.enable_block_reuse=true needs kv_cache.use_paged_context_fmha=true"),
])  # fmt: skip
def test_draft_target_needs_block_reuse_and_no_beam_search(sections: dict[str, Any], match: str) -> None:
    # examples/draft_target_model/README.md; the target's executor checks the reuse itself.
    with pytest.raises(ConfigError, match=match):
        make_cfg(speculative=DRAFT, **sections)
    make_cfg(speculative=DRAFT, kv_cache={"enable_block_reuse": True})


# ---- serve time: an engine as trtllm-build records it ---------------------------------------------------------
def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def recorded_engine_config(cfg: BuildConfig) -> dict[str, Any]:
    """The engine config.json trtllm-build writes for our own command line, by the builder's rules quoted in
    the module docstring: the flags as given, a speculative build's max_seq_len raised by max_draft_len and
    max_num_tokens to max_batch_size * (max_draft_len + 1)."""
    argv = trtllm_build_argv(cfg, "ckpt", "engine")
    build = {flag: int(_flag(argv, f"--{flag}")) for flag in
             ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "max_beam_width")}  # fmt: skip
    build["max_draft_len"] = int(_flag(argv, "--max_draft_len")) if "--max_draft_len" in argv else 0
    if "--speculative_decoding_mode" in argv:
        build["max_seq_len"] += build["max_draft_len"]
        build["max_num_tokens"] = max(
            build["max_num_tokens"], build["max_batch_size"] * (build["max_draft_len"] + 1)
        )
    plugin = {"tokens_per_block": int(_flag(argv, "--tokens_per_block")),
              "use_paged_context_fmha": _flag(argv, "--use_paged_context_fmha") == "enable"}  # fmt: skip
    return engine_config(plugin_config=plugin, **build)


@pytest.mark.parametrize("name", ["draft-target", "lookahead", "fp16-tp1", "fp8-kv-reuse-chunked"])
def test_engines_built_by_our_own_command_pass_the_serve_checks(name: str) -> None:
    cfg = load_build_config(CONFIG_DIR / f"{name}.yaml")
    guards.check_runtime_features(cfg, recorded_engine_config(cfg))


def test_a_speculative_engine_built_for_another_max_seq_len_is_refused() -> None:
    cfg = load_build_config(CONFIG_DIR / "lookahead.yaml")  # max_seq_len 2048, 15 drafts
    engine = recorded_engine_config(cfg)
    engine["build_config"]["max_seq_len"] = 2048  # built with --max_seq_len 2033
    with pytest.raises(ServingError, match=r"engine.max_seq_len \+ max_draft_len \(2048 \+ 15\)=2063 but the engine "
                                           r"was built with max_seq_len=2048"):  # fmt: skip
        guards.check_runtime_features(cfg, engine)


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


def test_preflight_serve_passes_a_draft_target_engine_built_by_our_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_build_config(CONFIG_DIR / "draft-target.yaml")
    manifest = Manifest(stage="engine", config_hash="h", inputs={}, files=[], tool_versions={}, facts=BUILT)
    (tmp_path / "manifest.json").write_text(manifest.to_json())
    (tmp_path / "config.json").write_text(json.dumps(recorded_engine_config(cfg)))
    monkeypatch.setattr(env, "tensorrt_llm_version", lambda: env.Probe("1.2.0"))
    monkeypatch.setattr(env, "tensorrt_version", lambda: env.Probe("10.14.1.48"))
    monkeypatch.setattr(env, "gpus", lambda: env.Probe([H100]))
    guards.preflight_serve(cfg, tmp_path)
