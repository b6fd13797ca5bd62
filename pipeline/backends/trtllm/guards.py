"""Refuse, before anything slow starts, the configurations that most often break a TensorRT-LLM deployment:

- an engine built by another TensorRT-LLM/TensorRT than the runtime's, or for another GPU architecture
- a KV cache too small for one sequence of max_seq_len
- prompt limits baked in at build that the model or the runtime cannot honour
- runtime features (block reuse, chunked context, beam, speculative decoding, batch, world size) that
  need matching build flags: checked across the build config and the engine's recorded build_config
- quantization formats on GPUs too old for them (fp8 -> SM89+, nvfp4 -> SM100+).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipeline.artifacts import require_manifest
from pipeline.backends.trtllm import env
from pipeline.backends.trtllm.env import Gpu
from pipeline.backends.trtllm.versions import (
    MIN_SM_FOR_KV,
    MIN_SM_FOR_QUANT,
    PINNED_CONTAINER,
    sm_label,
)
from pipeline.config.build_config import BuildConfig
from pipeline.errors import ConfigError, ServingError

_REBUILD_HINT = (
    f"Build the engine inside the serving image ({PINNED_CONTAINER}; `make image`) "
    "so both come from one TensorRT-LLM build."
)
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


# ---- the engine and the runtime must come from one build, for one GPU architecture -----------------
def check_runtime_matches(
    engine_facts: dict[str, Any], runtime_trtllm: str | None, runtime_trt: str | None
) -> None:
    """Refuse an engine whose recorded TensorRT-LLM / TensorRT versions differ from the runtime's."""
    built = engine_facts.get("tensorrt_llm_version")
    if not built:
        raise ServingError(
            "the engine manifest records no TensorRT-LLM version: cannot prove it matches the runtime",
            hint=_REBUILD_HINT,
        )
    if runtime_trtllm is None:
        raise ServingError(
            "TensorRT-LLM is not installed here, so this engine cannot be served here", hint=_REBUILD_HINT
        )
    if built != runtime_trtllm:
        raise ServingError(
            f"engine built with TensorRT-LLM {built}, runtime has {runtime_trtllm}: TensorRT refuses plans "
            'from another version ("Serialization assertion stdVersionRead == kSERIALIZATION_VERSION")',
            hint=_REBUILD_HINT,
        )
    built_trt = engine_facts.get("tensorrt_version")
    if built_trt and runtime_trt and built_trt != runtime_trt:
        raise ServingError(
            f"engine built with TensorRT {built_trt}, runtime has {runtime_trt}", hint=_REBUILD_HINT
        )


def check_gpu_matches(engine_facts: dict[str, Any], gpus: list[Gpu]) -> None:
    """Refuse an engine built for another compute capability than the GPUs that would run it."""
    built = engine_facts.get("gpu_compute_capability")
    if not built:
        raise ServingError("the engine manifest records no GPU compute capability", hint=_REBUILD_HINT)
    others = sorted({g.compute_capability for g in gpus if g.compute_capability != built})
    if others:
        raise ServingError(
            f"engine built for compute capability {built}, this machine has {', '.join(others)}: TensorRT plans "
            'are specific to the GPU architecture ("generated on an incompatible device")',
            hint="Rebuild the engine on the GPU type that serves it.",
        )


def check_gpu_supports(cfg: BuildConfig, gpus: list[Gpu]) -> None:
    """Refuse quantization formats the GPUs cannot run (fp8 needs SM89+, nvfp4 SM100+)."""
    if not gpus:
        return
    q = cfg.quantization
    oldest = min(gpus, key=lambda g: g.sm)
    for what, need in (
        (f"quantization.mode={q.mode}", MIN_SM_FOR_QUANT[q.mode]),
        (f"quantization.kv_cache_dtype={q.kv_cache_dtype}", MIN_SM_FOR_KV[q.kv_cache_dtype]),
    ):
        if oldest.sm < need:
            raise ConfigError(
                f"{what} needs a GPU of {sm_label(need)} or newer; GPU {oldest.index} ({oldest.name}) is "
                f"{sm_label(oldest.sm)}",
                hint="Pick a format this GPU supports (e.g. int4_awq or int8_wo on Ampere) or a newer GPU.",
            )


def check_world_size(cfg: BuildConfig, gpus: list[Gpu]) -> None:
    if len(gpus) < cfg.parallel.world_size:
        raise ConfigError(
            f"parallel tp_size*pp_size = {cfg.parallel.world_size} needs that many GPUs; this machine has {len(gpus)}",
            hint="Lower parallel.tp_size / pp_size or build on a larger host.",
        )


# ---- KV capacity ------------------------------------------------------------------------------------
def kv_tokens_for_one_sequence(cfg: BuildConfig) -> int:
    """Tokens the paged cache must hold for one sequence: beam * tokens_per_block * blocks per sequence."""
    return cfg.engine.max_beam_width * cfg.kv_cache.tokens_per_block * cfg.kv_blocks_per_sequence


def kv_bytes_per_token(cfg: BuildConfig, ckpt_config: dict[str, Any]) -> int:
    """Bytes of K and V one token takes on one GPU, from a TensorRT-LLM checkpoint config.json."""
    layers = int(ckpt_config["num_hidden_layers"])
    heads = int(ckpt_config["num_attention_heads"])
    kv_heads = int(ckpt_config.get("num_key_value_heads") or heads)
    head_dim = int(ckpt_config.get("head_size") or ckpt_config["hidden_size"] // heads)
    kv = cfg.quantization.kv_cache_dtype
    element = _DTYPE_BYTES[kv] if kv != "auto" else _DTYPE_BYTES.get(str(ckpt_config.get("dtype")), 2)
    per_gpu_layers = math.ceil(layers / cfg.parallel.pp_size)
    per_gpu_kv_heads = max(1, math.ceil(kv_heads / cfg.parallel.tp_size))
    return 2 * per_gpu_layers * per_gpu_kv_heads * head_dim * element


def kv_capacity_tokens(
    cfg: BuildConfig, ckpt_config: dict[str, Any], free_bytes: int, weight_bytes_per_gpu: int
) -> int:
    """Tokens the runtime will give the paged cache: min(max_tokens, fraction of memory left after weights)."""
    left = max(0, free_bytes - weight_bytes_per_gpu)
    fitted = int(left * cfg.kv_cache.free_memory_fraction) // kv_bytes_per_token(cfg, ckpt_config)
    return fitted if cfg.kv_cache.max_tokens is None else min(fitted, cfg.kv_cache.max_tokens)


def check_kv_capacity(cfg: BuildConfig, capacity_tokens: int | None = None) -> dict[str, int]:
    """Raise unless the cache holds one full sequence; return the numbers for the manifest."""
    needed = kv_tokens_for_one_sequence(cfg)
    capacity = cfg.kv_cache.max_tokens if capacity_tokens is None else capacity_tokens
    if capacity is not None and capacity < needed:
        raise ConfigError(
            f"the KV cache holds {capacity} tokens, one sequence of engine.max_seq_len={cfg.engine.max_seq_len} "
            f"needs {needed} (max_beam_width {cfg.engine.max_beam_width} * tokens_per_block "
            f"{cfg.kv_cache.tokens_per_block} * {cfg.kv_blocks_per_sequence} blocks)",
            hint="Raise kv_cache.max_tokens / kv_cache.free_memory_fraction, or lower engine.max_seq_len.",
        )
    numbers = {"kv_tokens_per_sequence": needed}
    if capacity is not None:
        numbers.update(kv_capacity_tokens=capacity, kv_full_sequences=capacity // needed)
    return numbers


# ---- prompt limits ------------------------------------------------------------------------------------
def check_prompt_limits(cfg: BuildConfig, ckpt_config: dict[str, Any]) -> None:
    """max_seq_len must fit the model's positions (unless it scales RoPE); the config checks the rest."""
    positions = ckpt_config.get("max_position_embeddings")
    scaled = bool(ckpt_config.get("rotary_scaling") or ckpt_config.get("rope_scaling"))
    if positions and not scaled and cfg.engine.max_seq_len > int(positions):
        raise ConfigError(
            f"engine.max_seq_len={cfg.engine.max_seq_len} exceeds the model's max_position_embeddings={positions}",
            hint=f"Set engine.max_seq_len <= {positions}; prompts longer than the build limits are rejected "
            "per request at run time.",
        )


def effective_max_input_len(cfg: BuildConfig) -> int:
    """Longest prompt the runtime accepts: with chunked context it lifts max_input_len to max_seq_len - 1."""
    return cfg.engine.max_seq_len - 1 if cfg.scheduler.enable_chunked_context else cfg.engine.max_input_len


# ---- runtime features vs the engine's build_config ------------------------------------------------------
def check_build_features(cfg: BuildConfig) -> None:
    """Runtime features the build config asks for that need build flags, before building."""
    if cfg.speculative.mode == "draft_model" and not cfg.kv_cache.use_paged_context_fmha:
        raise ConfigError(
            "speculative.mode=draft_model needs kv_cache.use_paged_context_fmha=true (the target re-reads its "
            "cache when draft tokens are rejected)"
        )
    if cfg.speculative.mode == "ngram":
        raise ConfigError(
            "speculative.mode=ngram (prompt lookup) has no server-side implementation in Triton's tensorrtllm "
            "backend",
            hint="Use draft_model or lookahead with backend=trtllm, or ngram with backend=torch.",
        )
    if cfg.speculative.mode in ("medusa", "eagle"):
        raise ConfigError(
            f"speculative.mode={cfg.speculative.mode} needs a checkpoint with {cfg.speculative.mode} heads, "
            "which llmpipe's convert step does not produce",
            hint="Use draft_model or lookahead with backend=trtllm.",
        )


def _mismatch(field: str, runtime: Any, engine_field: str, built: Any) -> ServingError:
    return ServingError(
        f"{field}={runtime} but the engine was built with {engine_field}={built}",
        hint="Rebuild the engine (`llmpipe build CONFIG --force`) or change the config back.",
    )


def check_runtime_features(cfg: BuildConfig, engine_config: dict[str, Any]) -> None:
    """Cross-check the serving config against an engine's config.json (its build_config and mapping)."""
    build = engine_config.get("build_config", {})
    plugin = build.get("plugin_config", {})
    mapping = engine_config.get("pretrained_config", {}).get("mapping", {})
    paged_fmha = bool(plugin.get("use_paged_context_fmha"))
    for field, on in (
        ("kv_cache.enable_block_reuse", cfg.kv_cache.enable_block_reuse),
        ("scheduler.enable_chunked_context", cfg.scheduler.enable_chunked_context),
    ):
        if on and not paged_fmha:
            raise _mismatch(field, "true", "use_paged_context_fmha", "disable")
    checks = (
        (
            "kv_cache.tokens_per_block",
            cfg.kv_cache.tokens_per_block,
            "tokens_per_block",
            plugin.get("tokens_per_block"),
        ),
        ("engine.max_seq_len", cfg.engine.max_seq_len, "max_seq_len", build.get("max_seq_len")),
    )
    for field, runtime, engine_field, built in checks:
        if built is not None and runtime != built:
            raise _mismatch(field, runtime, engine_field, built)
    upper_bounds: tuple[tuple[str, int | None, str, Any], ...] = (
        ("engine.max_beam_width", cfg.engine.max_beam_width, "max_beam_width", build.get("max_beam_width")),
        ("serving.triton_max_batch_size", cfg.serving.triton_max_batch_size, "max_batch_size",
         build.get("max_batch_size")),
    )  # fmt: skip
    for field, limit, engine_field, built in upper_bounds:
        if built is not None and limit is not None and limit > built:
            raise _mismatch(field, limit, engine_field, built)
    built_draft = int(build.get("max_draft_len") or 0)
    wanted_draft = 0 if cfg.speculative.mode in ("none", "ngram") else cfg.speculative.max_draft_len
    if built_draft != wanted_draft:
        raise _mismatch(
            f"speculative.mode={cfg.speculative.mode} max_draft_len",
            wanted_draft,
            "max_draft_len",
            built_draft,
        )
    world = mapping.get("world_size") or (mapping.get("tp_size", 1) * mapping.get("pp_size", 1))
    if mapping and world != cfg.parallel.world_size:
        raise _mismatch("parallel tp_size*pp_size", cfg.parallel.world_size, "mapping.world_size", world)


def preflight_serve(cfg: BuildConfig, engine_dir: Path) -> None:
    """Everything that must hold before tritonserver loads `engine_dir`: versions and GPU, runtime features
    against the engine's build flags, KV capacity."""
    facts = require_manifest(engine_dir, "engine").facts
    check_runtime_matches(facts, env.tensorrt_llm_version().value, env.tensorrt_version().value)
    found = env.gpus().value or []
    check_gpu_matches(facts, found)
    config_path = engine_dir / "config.json"
    try:
        engine_config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        # The backend would die with json parse_error.101 at instance creation.
        raise ServingError(f"{config_path} is missing or not JSON ({err})", hint=_REBUILD_HINT) from None
    check_runtime_features(cfg, engine_config)
    check_kv_capacity(cfg)
