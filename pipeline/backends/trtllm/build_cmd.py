"""The exact `trtllm-build` command line for a BuildConfig, checked against the pinned release's flag list.

Parallelism is not a flag: since 0.12 trtllm-build reads tp/pp from the checkpoint's `mapping`, so the
convert/quantize step fixes it. The KV cache element type likewise comes from the checkpoint's
`quantization.kv_cache_quant_algo`.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from pipeline.backends.trtllm.versions import FLAG_CHOICES, PINNED, Release, release
from pipeline.config.build_config import BuildConfig, paged_context_fmha_blocker
from pipeline.errors import ConfigError

# speculative.mode -> trtllm-build --speculative_decoding_mode
# (NVIDIA/TensorRT-LLM:tensorrt_llm/commands/build.py@65f1d15).
SPECULATIVE_DECODING_MODE: dict[str, str] = {
    "draft_model": "draft_tokens_external",
    "lookahead": "lookahead_decoding",
    "medusa": "medusa",
    "eagle": "eagle",
}
# Where the TensorRT network is exported as ONNX, inside the engine folder (inspected by onnx.checker).
NETWORK_DIRNAME = "network_onnx"
BUILD_LOG_NAME = "trtllm-build.log"
TIMING_CACHE_NAME = "trtllm-timing.cache"
# Batch sizes at or below which the FP8 GEMM plugin beats the QDQ path (TensorRT-LLM's own benchmark
# builder switches at the same point).
_FP8_GEMM_PLUGIN_MAX_BATCH = 4


def lookahead_max_draft_len(window: int, ngram: int, verification_set: int) -> int:
    """max_draft_len an engine needs for lookahead (W, N, G), per TensorRT-LLM's examples/lookahead."""
    return (0 if ngram == 1 else ngram - 2) + (window - 1 + verification_set) * (ngram - 1)


def max_draft_len(cfg: BuildConfig) -> int:
    spec = cfg.speculative
    if spec.mode == "lookahead":
        wng = (spec.lookahead_window_size, spec.lookahead_ngram_size, spec.lookahead_verification_set_size)
        needed = lookahead_max_draft_len(*wng)
        if spec.max_draft_len != needed:
            raise ConfigError(
                f"speculative.max_draft_len={spec.max_draft_len} does not match lookahead (W, N, G) = "
                f"{wng}, "
                f"which needs max_draft_len={needed}",
                hint=f"Set speculative.max_draft_len: {needed}",
            )
    return spec.max_draft_len


def engine_draft_len(cfg: BuildConfig) -> int:
    """The engine's max_draft_len: what `--max_draft_len` passes for a speculative mode, else 0."""
    return max_draft_len(cfg) if cfg.speculative.mode in SPECULATIVE_DECODING_MODE else 0


# What trtllm-build records in the engine's build_config for a speculative engine: `build()` raises
# max_seq_len by max_draft_len (the draft tokens ride on top of the sequence; EAGLE also adds its layer count,
# a mode llmpipe does not build) and max_num_tokens to at least max_batch_size * (max_draft_len + 1)
# (NVIDIA/TensorRT-LLM:1.1.0/_modules/tensorrt_llm/builder.html@8660c11).
def engine_max_seq_len(cfg: BuildConfig) -> int:
    """max_seq_len the built engine records (and sizes its KV blocks per sequence by)."""
    return cfg.engine.max_seq_len + engine_draft_len(cfg)


def engine_max_num_tokens(cfg: BuildConfig) -> int:
    """max_num_tokens the built engine records: room for every sequence's draft tokens in one step."""
    drafts = engine_draft_len(cfg)
    floor = cfg.engine.max_batch_size * (drafts + 1) if drafts else 0
    return max(cfg.engine.max_num_tokens, floor)


def paged_context_fmha(cfg: BuildConfig) -> bool:
    """--use_paged_context_fmha as the built engine will have it: the config's wish, unless the KV cache
    format makes the builder turn it off (then the command line says so instead of asking for it)."""
    return cfg.kv_cache.use_paged_context_fmha and paged_context_fmha_blocker(cfg) is None


def plugin_dtype(cfg: BuildConfig) -> str:
    """Compute dtype for the attention/GEMM plugins; 'auto' follows the checkpoint's dtype."""
    return "auto" if cfg.dtype == "auto" else cfg.dtype


def gemm_plugin(cfg: BuildConfig) -> str | None:
    """--gemm_plugin value, or None to leave the plugin off (FP8 at larger batch runs faster as QDQ)."""
    mode = cfg.quantization.mode
    if mode == "nvfp4":
        return "nvfp4"
    if mode in ("fp8", "fp8_pc_pt"):
        return "fp8" if cfg.engine.max_batch_size <= _FP8_GEMM_PLUGIN_MAX_BATCH else None
    # Quantized GEMMs use their own kernels; the plugin covers the rest (e.g. lm_head).
    return plugin_dtype(cfg)


def build_workers(cfg: BuildConfig) -> int:
    # One worker per rank by default: trtllm-build caps it at the visible GPU count itself.
    return cfg.engine.build_workers or cfg.parallel.world_size


def trtllm_build_argv(
    cfg: BuildConfig,
    ckpt_dir: Path | str,
    engine_dir: Path | str,
    *,
    target: Release | None = None,
) -> list[str]:
    """The argv of `trtllm-build` (argv[0] included), every flag checked against `target`'s flag list."""
    target = target or release(PINNED)
    e, kv = cfg.engine, cfg.kv_cache
    on = {True: "enable", False: "disable"}
    argv = [
        "trtllm-build",
        "--checkpoint_dir", str(ckpt_dir),
        "--output_dir", str(engine_dir),
        "--max_batch_size", str(e.max_batch_size),
        "--max_input_len", str(e.max_input_len),
        "--max_seq_len", str(e.max_seq_len),
        "--max_num_tokens", str(e.max_num_tokens),
        "--max_beam_width", str(e.max_beam_width),
        "--kv_cache_type", "paged",
        "--tokens_per_block", str(kv.tokens_per_block),
        "--gpt_attention_plugin", plugin_dtype(cfg),
        "--context_fmha", "enable",
        "--use_paged_context_fmha", on[paged_context_fmha(cfg)],
        "--remove_input_padding", "enable",
        # More TensorRT optimization profiles: a longer build for faster steps across batch shapes.
        "--multiple_profiles", on[e.multiple_profiles],
    ]  # fmt: skip
    gemm = gemm_plugin(cfg)
    if gemm is not None:
        argv += ["--gemm_plugin", gemm]
    if cfg.speculative.mode in SPECULATIVE_DECODING_MODE:
        argv += ["--speculative_decoding_mode", SPECULATIVE_DECODING_MODE[cfg.speculative.mode]]
        argv += ["--max_draft_len", str(engine_draft_len(cfg))]
    argv += ["--workers", str(build_workers(cfg))]
    if e.visualize_network:
        argv += ["--visualize_network", str(Path(engine_dir) / NETWORK_DIRNAME)]
    # Upstream's default, model.cache, lands in whatever directory the build was started from; the work dir
    # keeps it beside the engine instead, outside the engine folder (it is no part of the engine).
    argv += ["--output_timing_cache", str(Path(engine_dir).parent / TIMING_CACHE_NAME)]
    argv += ["--log_level", "info"]
    check_argv(argv, target)
    return argv


def check_argv(argv: list[str], target: Release) -> None:
    """Raise ConfigError if any flag (or a value with a closed choice set) is not in `target`'s CLI."""
    for index, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        if token not in target.build_flags:
            raise ConfigError(f"trtllm-build {token} does not exist in TensorRT-LLM {target.version}")
        choices = FLAG_CHOICES.get(token)
        value = argv[index + 1] if index + 1 < len(argv) else None
        if choices is not None and value not in choices:
            raise ConfigError(
                f"trtllm-build {token} {value} is not valid in TensorRT-LLM {target.version}; "
                f"choose one of {', '.join(choices)}"
            )


def format_argv(argv: list[str]) -> str:
    """One shell-quoted command line, flags and values paired, for plans and logs."""
    parts = [shlex.quote(argv[0])]
    index = 1
    while index < len(argv):
        token = argv[index]
        if index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            parts.append(f"{token} {shlex.quote(argv[index + 1])}")
            index += 2
        else:
            parts.append(token)
            index += 1
    return " \\\n    ".join(parts)
