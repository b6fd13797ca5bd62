"""The TensorRT-LLM releases llmpipe's engine path supports, as data.

Everything release-specific lives in RELEASES; code elsewhere looks facts up here instead of branching on
version strings.

How the flag lists were verified: each release's `trtllm-build` flag set is transcribed from that release's
rendered CLI reference, `NVIDIA/TensorRT-LLM` gh-pages `<version>/commands/trtllm-build.html` (Sphinx
argparse output generated from `tensorrt_llm/commands/build.py` + `PluginConfig`), read for 1.0.0
(@090dc64), 1.1.0 (@8660c11) and 1.2.0 (@7e873e5). The engine path is gone after 1.2
(NVIDIA/TensorRT-LLM:docs/source/legacy/tensorrt-backend-removal.md@335107a). Container tags and TensorRT
versions: Triton's compatibility matrix,
https://docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/introduction/compatibility.html
(25.12-trtllm-python-py3: TensorRT-LLM 1.1.0, TensorRT 10.13.3.9; 25.10: 1.0.0, TensorRT 10.11); no NGC
container is listed with 1.2.x, so 1.2.0 has none here and llmpipe pins 1.1.0. The version actually inside
a container is read at run time (`llmpipe doctor`, guards.check_runtime_matches), never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import ConfigError

# Flags present in every supported release (1.0.0, 1.1.0, 1.2.0 render the same list apart from EXTRA_FLAGS).
_COMMON_FLAGS: frozenset[str] = frozenset(
    {
        # input / output
        "--checkpoint_dir", "--model_config", "--build_config", "--model_cls_file", "--model_cls_name",
        "--output_dir",
        # shape limits
        "--max_batch_size", "--max_input_len", "--max_seq_len", "--max_decoder_seq_len", "--max_beam_width",
        "--max_num_tokens", "--opt_num_tokens", "--max_encoder_input_len", "--max_prompt_embedding_table_size",
        "--max_multimodal_len",
        # KV cache and engine packaging
        "--kv_cache_type", "--paged_kv_cache", "--input_timing_cache", "--output_timing_cache",
        "--profiling_verbosity", "--strip_plan", "--weight_sparsity", "--weight_streaming", "--fast_build",
        # build process and debugging
        "--workers", "--log_level", "--enable_debug_output", "--visualize_network", "--dry_run",
        "--monitor_memory",
        # logits, LoRA, speculative decoding
        "--logits_dtype", "--gather_context_logits", "--gather_generation_logits", "--gather_all_token_logits",
        "--lora_dir", "--lora_ckpt_source", "--lora_target_modules", "--max_lora_rank",
        "--speculative_decoding_mode", "--max_draft_len",
        # plugins (take a dtype or "disable")
        "--bert_attention_plugin", "--gpt_attention_plugin", "--gemm_plugin", "--gemm_swiglu_plugin",
        "--fp8_rowwise_gemm_plugin", "--nccl_plugin", "--lora_plugin", "--dora_plugin", "--moe_plugin",
        "--mamba_conv1d_plugin", "--low_latency_gemm_plugin", "--low_latency_gemm_swiglu_plugin",
        "--gemm_allreduce_plugin",
        # features (enable/disable) and tokens_per_block
        "--context_fmha", "--bert_context_fmha_fp32_acc", "--remove_input_padding", "--norm_quant_fusion",
        "--reduce_fusion", "--user_buffer", "--tokens_per_block", "--use_paged_context_fmha",
        "--use_fp8_context_fmha", "--fuse_fp4_quant", "--multiple_profiles", "--paged_state", "--streamingllm",
        "--use_fused_mlp", "--pp_reduce_scatter",
    }
)  # fmt: skip

# The auto-parallel planner flags still render in 1.0.0 and 1.1.0 and are gone in 1.2.0.
_AUTO_PARALLEL_FLAGS: frozenset[str] = frozenset({"--auto_parallel", "--gpus_per_node", "--cluster_key"})

_DTYPE_PLUGIN = ("auto", "float16", "float32", "bfloat16", "int32", "disable")
_FEATURE = ("enable", "disable")

# Closed value sets of the flags llmpipe emits, identical in the three releases.
FLAG_CHOICES: dict[str, tuple[str, ...]] = {
    "--kv_cache_type": ("continuous", "paged", "disabled"),
    "--gpt_attention_plugin": _DTYPE_PLUGIN,
    "--gemm_plugin": ("auto", "float16", "float32", "bfloat16", "int32", "fp8", "nvfp4", "disable"),
    "--context_fmha": _FEATURE,
    "--remove_input_padding": _FEATURE,
    "--use_paged_context_fmha": _FEATURE,
    "--multiple_profiles": _FEATURE,
    "--speculative_decoding_mode": (
        "draft_tokens_external", "lookahead_decoding", "medusa", "explicit_draft_tokens", "eagle",
    ),
    "--log_level": ("internal_error", "error", "warning", "info", "verbose", "debug", "trace"),
}  # fmt: skip


@dataclass(frozen=True)
class Release:
    """One TensorRT-LLM release whose engine path llmpipe generates commands for."""

    version: str
    # NGC image that serves this release's engines, and builds them so versions match; None when Triton's
    # compatibility matrix lists no container carrying the release.
    triton_container: str | None
    # TensorRT major.minor the release was built against (tensorrtllm_backend's Dockerfile at the matching
    # submodule bump). Informational: guards compare the versions recorded in the engine, not this.
    tensorrt: str
    build_flags: frozenset[str]
    docs_commit: str  # gh-pages commit of the CLI reference the flag list was read from


def _container(yy_mm: str) -> str:
    return f"nvcr.io/nvidia/tritonserver:{yy_mm}-trtllm-python-py3"


RELEASES: dict[str, Release] = {
    "1.0.0": Release("1.0.0", _container("25.10"), "10.11", _COMMON_FLAGS | _AUTO_PARALLEL_FLAGS, "090dc64"),
    "1.1.0": Release("1.1.0", _container("25.12"), "10.13", _COMMON_FLAGS | _AUTO_PARALLEL_FLAGS, "8660c11"),
    "1.2.0": Release("1.2.0", None, "10.14", _COMMON_FLAGS, "7e873e5"),
}
# The release the Dockerfile, `pip install llmpipe[trtllm]` and the contract tests are pinned to: the
# newest one a named container carries.
PINNED = "1.1.0"
PINNED_CONTAINER: str = RELEASES[PINNED].triton_container or ""


def release(version: str = PINNED) -> Release:
    try:
        return RELEASES[version]
    except KeyError:
        raise ConfigError(
            f"TensorRT-LLM {version} is not a release llmpipe's engine path supports",
            hint=f"Supported: {', '.join(RELEASES)} (trtllm-build was removed after 1.2). Use the container "
            f"{PINNED_CONTAINER}.",
        ) from None


def release_for_runtime(installed: str) -> Release:
    """The table entry for an installed TensorRT-LLM version string: its major.minor release, whatever the
    patch or pre-release ('1.2.0rc7', '1.2.1', '1.0.3' -> 1.2.0, 1.2.0, 1.0.0): the CLI and engine format
    do not change within a minor release."""
    base = installed.split("+")[0]
    for tag in ("rc", ".post", "a", "b"):
        base = base.split(tag)[0]
    major_minor = ".".join(base.rstrip(".").split(".")[:2])
    matches = [r for v, r in RELEASES.items() if ".".join(v.split(".")[:2]) == major_minor]
    return matches[0] if matches else release(base.rstrip("."))


# Smallest GPU compute capability (major*10+minor) each quantization mode / KV dtype needs on this path.
# fp8 needs Ada (SM89) or newer, nvfp4 needs Blackwell (SM100)
# (NVIDIA/TensorRT-LLM:docs/source/legacy/reference/precision.md@b2ae043); the rest run on Ampere (SM80),
# the oldest architecture the 1.x releases list as supported.
MIN_SM_FOR_QUANT: dict[str, int] = {
    "none": 80,
    "int8_wo": 80,
    "int4_wo": 80,
    "int4_awq": 80,
    "int8_sq": 80,
    "w4a8_awq": 89,
    "fp8": 89,
    "fp8_pc_pt": 89,
    "nvfp4": 100,
}
MIN_SM_FOR_KV: dict[str, int] = {"auto": 80, "int8": 80, "fp8": 89}

# Compute capabilities (first, last) on which the engine builder refuses a format outright. The pinned
# release's `tensorrt_llm.builder.build` raises for SM100-SM119 (data-centre Blackwell: B200, GB200, B300) on
# INT8/INT4 weight-only weights, an INT8 KV cache, SmoothQuant and per-channel/per-token scaling
# (NVIDIA/TensorRT-LLM:1.1.0/_modules/tensorrt_llm/builder.html@8660c11, the 1.1.0 source as rendered on
# gh-pages). Which modes those are follows `QuantMode.from_quant_algo`
# (NVIDIA/TensorRT-LLM:1.1.0/_modules/tensorrt_llm/quantization/mode.html@8660c11): W4A16_AWQ and W4A8_AWQ
# both map to INT4 weight-only flags (W4A8's FP8 activations are not a QuantMode flag), and
# FP8_PER_CHANNEL_PER_TOKEN sets the per-channel and per-token flags. SM120+ (RTX Blackwell) is not refused.
_BLACKWELL_DATACENTER = (100, 119)
REFUSED_SMS_FOR_QUANT: dict[str, tuple[int, int]] = {
    "int8_wo": _BLACKWELL_DATACENTER,
    "int4_wo": _BLACKWELL_DATACENTER,
    "int4_awq": _BLACKWELL_DATACENTER,
    "w4a8_awq": _BLACKWELL_DATACENTER,
    "int8_sq": _BLACKWELL_DATACENTER,
    "fp8_pc_pt": _BLACKWELL_DATACENTER,
}
REFUSED_SMS_FOR_KV: dict[str, tuple[int, int]] = {"int8": _BLACKWELL_DATACENTER}


def quant_mode_builds_on(mode: str, sm: int) -> bool:
    """Whether an engine of quantization mode `mode` builds for a GPU of compute capability `sm`."""
    return _builds_on(sm, MIN_SM_FOR_QUANT[mode], REFUSED_SMS_FOR_QUANT.get(mode))


def kv_dtype_builds_on(kv_cache_dtype: str, sm: int) -> bool:
    """Whether an engine with KV cache element type `kv_cache_dtype` builds for compute capability `sm`."""
    return _builds_on(sm, MIN_SM_FOR_KV[kv_cache_dtype], REFUSED_SMS_FOR_KV.get(kv_cache_dtype))


def _builds_on(sm: int, min_sm: int, refused: tuple[int, int] | None) -> bool:
    return sm >= min_sm and not (refused and refused[0] <= sm <= refused[1])


def sm_label(sm: int) -> str:
    return f"SM{sm} ({sm // 10}.{sm % 10})"


def sm_range_label(sms: tuple[int, int]) -> str:
    return f"SM{sms[0]}-SM{sms[1]}"
