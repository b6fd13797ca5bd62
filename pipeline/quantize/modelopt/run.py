"""The ModelOpt quantize step: the HF checkpoint -> a calibrated TensorRT-LLM checkpoint, on the CPU.

Shapes are checked before anything loads; ModelOpt's output goes to `modelopt.log` in the output folder; the
calibrated state is saved next to the export (`state.load_simulated_model` rebuilds the fake-quantized model
from it); the exported config.json must carry the quant_algo and kv_cache_quant_algo the config asked for.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.config.build_config import BuildConfig
from pipeline.errors import ConfigError, UnsupportedModelError
from pipeline.quantize.modelopt.export import (
    DECODER_TYPES,
    TRTLLM_EXPORT,
    architecture,
    checkpoint_dtype,
    export_trtllm_checkpoint,
)
from pipeline.quantize.modelopt.formats import MODE_CONFIGS, check_supported, quant_config
from pipeline.quantize.modelopt.library import LOG_NAME, ModelOptLog, import_modelopt, require_modelopt
from pipeline.quantize.modelopt.loop import forward_loop, load_float_model
from pipeline.quantize.modelopt.shapes import check_shapes, read_hf_config
from pipeline.quantize.modelopt.state import save_state


def check_config(cfg: BuildConfig, hf_config: dict[str, Any], export: str = TRTLLM_EXPORT) -> None:
    """Everything that can be refused before loading the model: the combination, the lm_head switch, the
    architecture (whether ModelOpt exports it to `export`'s format), the group/block size against the
    model's shapes."""
    q = cfg.quantization
    check_supported(q.mode, q.kv_cache_dtype)
    if q.quantize_lm_head and q.mode != "fp8":
        raise ConfigError(
            f"quantization.quantize_lm_head=true with mode={q.mode}: TensorRT-LLM's quantize.py quantizes the "
            "output projection for mode=fp8 only",
            hint="Set quantization.quantize_lm_head: false, or use mode=fp8.",
        )
    architecture(hf_config, export)
    check_shapes(hf_config, q.mode, q.group_size, cfg.parallel.tp_size)


def quantize_checkpoint(
    cfg: BuildConfig, hf_dir: Path, out_dir: Path, progress: bool = True, export: str = TRTLLM_EXPORT
) -> dict[str, Any]:
    """Calibrate the HF checkpoint `hf_dir` with ModelOpt, save the calibrated state into `out_dir` and, for
    `export` = TRTLLM_EXPORT, export the TensorRT-LLM checkpoint (tp/pp from `parallel`) there too; the facts
    for the stage manifest. HF_EXPORT leaves the unified HF checkpoint to export.export_unified_hf_checkpoint,
    which rebuilds the model from the saved state."""
    q, calib = cfg.quantization, cfg.quantization.calibration
    hf_config = read_hf_config(hf_dir)
    check_config(cfg, hf_config, export)
    to_trtllm = export == TRTLLM_EXPORT
    version = require_modelopt(q.mode, DECODER_TYPES[architecture(hf_config)] if to_trtllm else None)
    dtype = checkpoint_dtype(cfg.dtype, hf_config)
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    with (out_dir / LOG_NAME).open("w", encoding="utf-8") as stream:
        log = ModelOptLog(stream)
        mtq = import_modelopt(log)
        model, tokenizer = load_float_model(hf_dir)
        loop = forward_loop(tokenizer, calib, f"ModelOpt {q.mode} calibration", progress)
        config = quant_config(mtq, q.mode, q.kv_cache_dtype, q.group_size, q.quantize_lm_head)
        started = time.perf_counter()
        with log.capture():
            model = mtq.quantize(model, config, loop)
        calibrated = time.perf_counter()
        state_file = save_state(model, out_dir, log)
        files = export_trtllm_checkpoint(model, hf_config, out_dir, dtype, tp, pp, log) if to_trtllm else []
    exported: dict[str, Any] = {}
    if to_trtllm:
        exported = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))["quantization"]
        _check_exported(cfg, exported)
    return {
        "route": "modelopt",
        "modelopt_version": version,
        "modelopt_config": MODE_CONFIGS.get(q.mode, "KV cache only"),
        "modelopt_algorithm": config.get("algorithm"),
        "quant_algo": exported.get("quant_algo"),
        "kv_cache_quant_algo": exported.get("kv_cache_quant_algo"),
        "group_size": exported.get("group_size"),
        "exclude_modules": exported.get("exclude_modules"),
        "dtype": dtype,
        "tp_size": tp,
        "pp_size": pp,
        "calibration": {
            "dataset": calib.dataset,
            "samples": loop.samples,
            "tokens": loop.tokens,
            "batch_size": calib.batch_size,
            "max_seq_length": calib.max_seq_length,
            "seed": calib.seed,
            "passes": loop.passes,
        },
        "checkpoint_files": files,
        "modelopt_state_file": state_file,
        "modelopt_log": LOG_NAME,
        "modelopt_warnings": log.warnings,
        "calibrate_seconds": round(calibrated - started, 2),
        "export_seconds": round(time.perf_counter() - calibrated, 2),
    }


def _check_exported(cfg: BuildConfig, exported: dict[str, Any]) -> None:
    q = cfg.quantization
    wanted = (q.quant_algo, q.kv_cache_quant_algo)
    got = (exported.get("quant_algo"), exported.get("kv_cache_quant_algo"))
    if got != wanted:
        raise UnsupportedModelError(
            f"ModelOpt exported quant_algo={got[0]} kv_cache_quant_algo={got[1]} for quantization.mode={q.mode} "
            f"kv_cache_dtype={q.kv_cache_dtype}; TensorRT-LLM would build {wanted[0]} / {wanted[1]} from it",
            hint=f"See {LOG_NAME} in the output folder for ModelOpt's messages.",
        )
