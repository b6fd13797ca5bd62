"""quantize (trtllm): the calibrated formats (fp8, int8_sq, int4_awq, w4a8_awq, nvfp4) and a quantized KV cache,
through NVIDIA ModelOpt on the CPU (pipeline.quantize.modelopt), the way TensorRT-LLM's
examples/quantization/quantize.py produces them: ModelOpt calibrates the HF checkpoint (`hf_dir`) and exports
the TensorRT-LLM checkpoint. TensorRT-LLM itself is not needed here.

The modes convert applies with TensorRT-LLM (none, int8_wo, int4_wo, fp8_pc_pt; no KV cache quantization)
pass through unchanged. The tokenizer travels on from the convert step (trtllm-build writes none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.artifacts import link_tree
from pipeline.backends.trtllm.api import check_unified_checkpoint
from pipeline.config.build_config import BuildConfig
from pipeline.errors import MissingArtifactError
from pipeline.quantize.calibration import data_files as dataset_data_files
from pipeline.quantize.modelopt.formats import check_supported, uses_modelopt
from pipeline.quantize.modelopt.library import DISTRIBUTION
from pipeline.quantize.modelopt.run import quantize_checkpoint
from pipeline.runtime.engine_config import TOKENIZER_DIR


def needs_calibration(cfg: BuildConfig) -> bool:
    q = cfg.quantization
    return uses_modelopt(q.mode, q.kv_cache_dtype)


def quantize(cfg: BuildConfig, ckpt_dir: Path, out_dir: Path, hf_dir: Path | None = None) -> dict[str, Any]:
    q = cfg.quantization
    check_supported(q.mode, q.kv_cache_dtype)
    if not needs_calibration(cfg):
        link_tree(ckpt_dir, out_dir)
        return {"quant_algo": q.quant_algo, "kv_cache_quant_algo": None, "pass_through": True}
    if hf_dir is None:
        raise MissingArtifactError("quantization needs the HF checkpoint (ModelOpt calibrates the HF model)")
    facts = quantize_checkpoint(cfg, Path(hf_dir), out_dir)
    check_unified_checkpoint(out_dir, cfg.parallel.world_size)
    if (ckpt_dir / TOKENIZER_DIR).is_dir():
        link_tree(ckpt_dir / TOKENIZER_DIR, out_dir / TOKENIZER_DIR)
    return {**facts, "tool_packages": [DISTRIBUTION]}


def data_files(cfg: BuildConfig) -> dict[str, Path]:
    """The calibration files a calibrated build reads: their contents key the stage's reuse."""
    if not needs_calibration(cfg):
        return {}
    return dataset_data_files("calibration", cfg.quantization.calibration.dataset)
