"""Refuse, before anything slow starts, the configurations that most often break a TensorRT-LLM deployment:

- an engine built by another TensorRT-LLM/TensorRT than the runtime's, or for another GPU architecture
- a KV cache too small for one sequence of max_seq_len
- prompt limits baked in at build that the model or the runtime cannot honour
- runtime features (block reuse, chunked context, beam, speculative decoding, batch, world size) that
  need matching build flags: checked across the build config and the engine's recorded build_config
- quantization formats on GPUs that cannot build them (fp8 -> SM89+, nvfp4 -> SM100+; no INT8/INT4
  weight-only, SmoothQuant, per-channel/per-token or INT8 KV on SM100-SM119), checked before convert.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipeline.artifacts import require_manifest
from pipeline.backends.trtllm import env
from pipeline.backends.trtllm.build_cmd import engine_draft_len, engine_max_num_tokens, engine_max_seq_len
from pipeline.backends.trtllm.env import Gpu
from pipeline.backends.trtllm.versions import (
    MIN_SM_FOR_KV,
    MIN_SM_FOR_QUANT,
    PINNED_CONTAINER,
    REFUSED_SMS_FOR_KV,
    REFUSED_SMS_FOR_QUANT,
    kv_dtype_builds_on,
    quant_mode_builds_on,
    sm_label,
    sm_range_label,
)
from pipeline.config.build_config import BuildConfig
from pipeline.config.vocab import BACKEND_QUANT_MODES
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


def _why_not(value: str, sm: int, min_sm: dict[str, int], refused: dict[str, tuple[int, int]]) -> str:
    if sm < min_sm[value]:
        return f"needs a GPU of {sm_label(min_sm[value])} or newer"
    return f"is refused by TensorRT-LLM's engine builder on {sm_range_label(refused[value])}"


def check_gpu_supports(cfg: BuildConfig, gpus: list[Gpu]) -> None:
    """Refuse quantization formats a GPU cannot build: too old (fp8 needs SM89+, nvfp4 SM100+) or refused
    on its architecture (INT8/INT4 weight-only, SmoothQuant, FP8 per-channel/per-token, INT8 KV on SM100-119)."""
    q = cfg.quantization
    for gpu in gpus:
        wrong = [
            f"quantization.{field}={value} {_why_not(value, gpu.sm, min_sm, refused)}"
            for field, value, builds, min_sm, refused in (
                ("mode", q.mode, quant_mode_builds_on, MIN_SM_FOR_QUANT, REFUSED_SMS_FOR_QUANT),
                ("kv_cache_dtype", q.kv_cache_dtype, kv_dtype_builds_on, MIN_SM_FOR_KV, REFUSED_SMS_FOR_KV),
            )
            if not builds(value, gpu.sm)
        ]
        if wrong:
            modes = [m for m in BACKEND_QUANT_MODES["trtllm"] if quant_mode_builds_on(m, gpu.sm)]
            kv_dtypes = [k for k in MIN_SM_FOR_KV if kv_dtype_builds_on(k, gpu.sm)]
            raise ConfigError(
                f"{'; '.join(wrong)}; GPU {gpu.index} ({gpu.name}) is {sm_label(gpu.sm)}",
                hint=f"On this GPU use quantization.mode {' / '.join(modes)} with kv_cache_dtype "
                f"{' / '.join(kv_dtypes)}, or build on another GPU.",
            )


def check_this_machine_supports(cfg: BuildConfig) -> None:
    """check_gpu_supports on this machine's GPUs (none found: nothing to check), for the steps before the
    engine build, so a format this GPU cannot build fails before conversion and calibration run."""
    check_gpu_supports(cfg, env.gpus().value or [])


def check_world_size(cfg: BuildConfig, gpus: list[Gpu]) -> None:
    if len(gpus) < cfg.parallel.world_size:
        raise ConfigError(
            f"parallel tp_size*pp_size = {cfg.parallel.world_size} needs that many GPUs; this machine has {len(gpus)}",
            hint="Lower parallel.tp_size / pp_size or build on a larger host.",
        )


# ---- KV capacity ------------------------------------------------------------------------------------
def kv_tokens_for_one_sequence(cfg: BuildConfig) -> int:
    """Tokens the paged cache must hold for one sequence: beam * tokens_per_block * blocks per sequence, the
    blocks counted over the engine's max_seq_len (which a speculative build raises by max_draft_len)."""
    tokens_per_block = cfg.kv_cache.tokens_per_block
    blocks = math.ceil(engine_max_seq_len(cfg) / tokens_per_block)
    return cfg.engine.max_beam_width * tokens_per_block * blocks


def kv_bytes_per_token(cfg: BuildConfig, ckpt_config: dict[str, Any]) -> int:
    """Bytes of K and V one token takes on one GPU, from a TensorRT-LLM checkpoint config.json."""
    layers = int(ckpt_config["num_hidden_layers"])
    heads = int(ckpt_config["num_attention_heads"])
    kv_heads = int(ckpt_config.get("num_key_value_heads") or heads)
    head_dim = int(ckpt_config.get("head_size") or ckpt_config["hidden_size"] // heads)
    kv = cfg.quantization.kv_cache_dtype
    element = _DTYPE_BYTES[kv] if kv != "auto" else _compute_bytes(ckpt_config)
    per_gpu_layers = math.ceil(layers / cfg.parallel.pp_size)
    per_gpu_kv_heads = max(1, math.ceil(kv_heads / cfg.parallel.tp_size))
    return 2 * per_gpu_layers * per_gpu_kv_heads * head_dim * element


def _compute_bytes(ckpt_config: dict[str, Any]) -> int:
    return _DTYPE_BYTES.get(str(ckpt_config.get("dtype")), 2)


def activation_bytes_floor(cfg: BuildConfig, ckpt_config: dict[str, Any]) -> int:
    """The least activation memory the engine holds on one GPU: the MLP's gate and up projections of a full
    step of max_num_tokens tokens, in the compute dtype (the hidden width when the checkpoint names no
    intermediate_size). TensorRT fixes the real activation workspace when it builds the engine, sized by the
    largest profile and roughly max_num_tokens times a network-dependent factor, and it is known only from the
    built engine (`device_memory_size_v2`; NVIDIA/TensorRT-LLM:docs/source/legacy/reference/memory.md@4946125),
    so before the build only this floor can be subtracted."""
    intermediate = ckpt_config.get("intermediate_size")
    width = (
        2 * math.ceil(int(intermediate) / cfg.parallel.tp_size)
        if intermediate
        else int(ckpt_config["hidden_size"])
    )
    return engine_max_num_tokens(cfg) * width * _compute_bytes(ckpt_config)


def kv_capacity_tokens(
    cfg: BuildConfig, ckpt_config: dict[str, Any], free_bytes: int, weight_bytes_per_gpu: int
) -> int:
    """An upper bound on the tokens the runtime will give the paged cache.

    The executor sizes the cache once the engine is loaded: kv_cache_free_gpu_mem_fraction of the memory
    still free after the weights, the activation workspace and the runtime and decoder buffers are allocated,
    capped by max_tokens_in_paged_kv_cache (NVIDIA/TensorRT-LLM:cpp/tensorrt_llm/batch_manager/
    trtGptModelInflightBatching.cpp@00825c4 then kvCacheManager.cpp@002ba6a, calculateFreeMemBytes). Before
    the build `free_bytes` is measured with none of that loaded: the weights and the activation floor are
    taken off; the rest of the workspace and the buffers are not known, so the real capacity is lower.
    """
    left = max(0, free_bytes - weight_bytes_per_gpu - activation_bytes_floor(cfg, ckpt_config))
    fitted = int(left * cfg.kv_free_memory_fraction) // kv_bytes_per_token(cfg, ckpt_config)
    return fitted if cfg.kv_cache.max_tokens is None else min(fitted, cfg.kv_cache.max_tokens)


def check_kv_capacity(cfg: BuildConfig, capacity_tokens: int | None = None) -> dict[str, int]:
    """Raise unless the cache holds one full sequence; return the numbers for the manifest (with a measured
    `capacity_tokens`, upper bounds: see kv_capacity_tokens)."""
    needed = kv_tokens_for_one_sequence(cfg)
    capacity = cfg.kv_cache.max_tokens if capacity_tokens is None else capacity_tokens
    if capacity is not None and capacity < needed:
        tokens_per_block = cfg.kv_cache.tokens_per_block
        raise ConfigError(
            f"the KV cache holds at most {capacity} tokens, one sequence of max_seq_len={engine_max_seq_len(cfg)} "
            f"needs {needed} (max_beam_width {cfg.engine.max_beam_width} * tokens_per_block {tokens_per_block} "
            f"* {needed // (cfg.engine.max_beam_width * tokens_per_block)} blocks)",
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
    drafts = engine_draft_len(cfg)
    # A speculative build records max_seq_len + max_draft_len (see build_cmd.engine_max_seq_len).
    seq_field = "engine.max_seq_len"
    if drafts:
        seq_field += f" + max_draft_len ({cfg.engine.max_seq_len} + {drafts})"
    checks = (
        (
            "kv_cache.tokens_per_block",
            cfg.kv_cache.tokens_per_block,
            "tokens_per_block",
            plugin.get("tokens_per_block"),
        ),
        (seq_field, engine_max_seq_len(cfg), "max_seq_len", build.get("max_seq_len")),
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
    if built_draft != drafts:
        raise _mismatch(
            f"speculative.mode={cfg.speculative.mode} max_draft_len", drafts, "max_draft_len", built_draft
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
