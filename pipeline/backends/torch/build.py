"""build (torch backend): checkpoint directory -> engine directory. The torch runtime needs no compiled
plan, so "building" records the limits the engine was built for (TensorRT-LLM's `build_config`) and the
serving defaults next to the checkpoint's weights, which are hard-linked when possible, and compiles this
machine's CPU kernels into the kernel cache (recorded in the facts; the runtime rebuilds them on demand where
the engine directory moves to another machine)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pipeline
from pipeline.config.build_config import BuildConfig
from pipeline.config.workdir import draft_engine_dir
from pipeline.errors import BackendUnavailableError, ConfigError, MissingArtifactError
from pipeline.runtime.engine_config import (
    TOKENIZER_DIR,
    WEIGHTS_FILE,
    EngineConfig,
    RuntimeDefaults,
    engine_config_from_dict,
    write_engine_config,
)
from pipeline.runtime.kernels import build as kernel_build
from pipeline.util.files import link_or_copy

# speculative.mode -> TensorRT-LLM's SpeculativeDecodingMode name.
SPECULATIVE_MODES: dict[str, str | None] = {
    "none": None,
    "draft_model": "draft_tokens_external",
    "ngram": "ngram",
    "lookahead": "lookahead_decoding",
    "medusa": "medusa",
    "eagle": "eagle",
}


def build(cfg: BuildConfig, ckpt_dir: Path, out_dir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    pretrained = _read_checkpoint_config(ckpt_dir)
    _check_matches_config(cfg, pretrained, ckpt_dir)
    # Validates the checkpoint's fields with the same rules the runtime applies at load, and reads the
    # build limits (with their plugin and speculative configs) into their dataclasses.
    parsed = engine_config_from_dict(
        {
            "version": pipeline.__version__,
            "pretrained_config": pretrained,
            "build_config": _build_limits(cfg),
        },
        origin=str(ckpt_dir / "config.json"),
    )
    model = parsed.model
    engine = EngineConfig(
        version=pipeline.__version__,
        backend="torch",
        model=model,
        build=parsed.build,
        runtime=RuntimeDefaults(
            kv_max_tokens=cfg.kv_cache.max_tokens,
            kv_free_memory_fraction=cfg.kv_free_memory_fraction,
            enable_block_reuse=cfg.kv_cache.enable_block_reuse,
            enable_chunked_context=cfg.scheduler.enable_chunked_context,
            scheduler_policy=cfg.scheduler.policy,
        ),
    )
    kernels = _compile_kernels(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    linked = link_or_copy(ckpt_dir / WEIGHTS_FILE, out_dir / WEIGHTS_FILE)
    if (ckpt_dir / TOKENIZER_DIR).is_dir():
        shutil.copytree(ckpt_dir / TOKENIZER_DIR, out_dir / TOKENIZER_DIR, dirs_exist_ok=True)
    write_engine_config(out_dir, engine)
    return {
        "architecture": model.architecture,
        "dtype": model.dtype,
        "quant_algo": model.quantization.quant_algo,
        "kv_cache_quant_algo": model.quantization.kv_cache_quant_algo,
        "max_batch_size": engine.build.max_batch_size,
        "max_seq_len": engine.build.max_seq_len,
        "max_num_tokens": engine.build.max_num_tokens,
        "tokens_per_block": engine.build.plugin_config.tokens_per_block,
        "weights_hardlinked": linked,
        "kernels": kernels,
        "seconds": round(time.perf_counter() - started, 2),
    }


def _read_checkpoint_config(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / "config.json"
    for needed in (path, ckpt_dir / WEIGHTS_FILE):
        if not needed.is_file():
            raise MissingArtifactError(
                f"{needed} not found: not a torch-backend checkpoint", hint="run `llmpipe convert`"
            )
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None


def _check_matches_config(cfg: BuildConfig, pretrained: dict[str, Any], ckpt_dir: Path) -> None:
    max_positions = int(pretrained.get("max_position_embeddings", 0))
    if cfg.engine.max_seq_len > max_positions:
        raise ConfigError(
            f"engine.max_seq_len={cfg.engine.max_seq_len} exceeds the model's max_position_embeddings={max_positions}",
            hint=f"set engine.max_seq_len <= {max_positions}",
        )
    stored = pretrained.get("quantization") or {}
    q = cfg.quantization
    for field, setting, wanted in (
        ("quant_algo", f"quantization.mode={q.mode}", q.quant_algo_for("torch")),
        ("kv_cache_quant_algo", f"quantization.kv_cache_dtype={q.kv_cache_dtype}", q.kv_cache_quant_algo),
    ):
        if stored.get(field) != wanted:
            raise ConfigError(
                f"{ckpt_dir} holds {field}={stored.get(field)!r} but {setting} means {wanted!r}",
                hint="rerun `llmpipe quantize` (or the whole pipeline) with this config",
            )


def _compile_kernels(cfg: BuildConfig) -> dict[str, str] | None:
    """Build the CPU kernels here, so that a missing compiler fails the build rather than slowing every
    request down at serving time: their record for the facts, or None where the engine will not use them
    (an engine that runs on CUDA, or LLMPIPE_DISABLE_KERNELS=1)."""
    import torch

    device = cfg.engine.device
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return None
    try:
        return kernel_build.build_library().facts()
    except kernel_build.KernelsUnavailable as exc:
        if exc.chosen:
            return None
        raise BackendUnavailableError(
            f"the torch backend's CPU kernels cannot be built here: {exc}",
            hint=f"install a C++ compiler (g++, or set CXX), or set {kernel_build.DISABLE_ENV}=1 to serve "
            "through the pure-PyTorch path (several times slower)",
        ) from None


def _build_limits(cfg: BuildConfig) -> dict[str, Any]:
    e, spec = cfg.engine, cfg.speculative
    return {
        "max_batch_size": e.max_batch_size,
        "max_input_len": e.max_input_len,
        "max_seq_len": e.max_seq_len,
        "max_num_tokens": e.max_num_tokens,
        "max_beam_width": e.max_beam_width,
        "kv_cache_type": "PAGED",
        "max_draft_len": spec.max_draft_len if spec.mode != "none" else 0,
        "speculative_decoding_mode": SPECULATIVE_MODES[spec.mode],
        "plugin_config": _plugin_config(cfg),
        "speculative_config": _speculative_config(cfg),
    }


def _speculative_config(cfg: BuildConfig) -> dict[str, Any]:
    spec = cfg.speculative
    return {
        "ngram_min_match": spec.ngram.min_match,
        "ngram_max_match": spec.ngram.max_match,
        "adaptive": spec.adaptive,
        "draft_engine_dir": str(draft_engine_dir(cfg)[1]) if spec.mode == "draft_model" else None,
    }


def _plugin_config(cfg: BuildConfig) -> dict[str, Any]:
    return {
        "tokens_per_block": cfg.kv_cache.tokens_per_block,
        "paged_kv_cache": True,
        "use_paged_context_fmha": cfg.kv_cache.use_paged_context_fmha,
        "remove_input_padding": True,
        "context_fmha": True,
    }
