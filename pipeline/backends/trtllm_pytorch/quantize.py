"""quantize (trtllm_pytorch): a ModelOpt unified HF checkpoint (safetensors with quantized weights and
scales, hf_quant_config.json, the tokenizer), the format TensorRT-LLM's PyTorch backend loads.

The calibration and export are pipeline.quantize.modelopt's (llmpipe's one home of ModelOpt, CPU-capable):
it calibrates into a scratch folder, where it also saves the calibrated state, and the unified checkpoint is
exported from that state. `none` with an auto KV cache never gets here (the stage links the checkpoint
through).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from pipeline.backends.trtllm_pytorch.checkpoint import HF_QUANT_CONFIG, group_size, quant_algos
from pipeline.config.build_config import BuildConfig
from pipeline.errors import UnsupportedModelError


def quantize(cfg: BuildConfig, ckpt_dir: Path, out_dir: Path, hf_dir: Path | None = None) -> dict[str, Any]:
    # `ckpt_dir` (convert's output) is the HF checkpoint itself on this route.
    from pipeline.quantize.modelopt.export import HF_EXPORT, export_unified_hf_checkpoint
    from pipeline.quantize.modelopt.run import quantize_checkpoint
    from pipeline.quantize.modelopt.state import SIMULATION_DIR, STATE_FILE, state_path

    with tempfile.TemporaryDirectory(prefix="llmpipe-modelopt-", dir=out_dir.parent) as scratch:
        facts = quantize_checkpoint(cfg, ckpt_dir, Path(scratch), export=HF_EXPORT)
        files = export_unified_hf_checkpoint(ckpt_dir, Path(scratch), out_dir, cfg.dtype)
        # kept for `llmpipe validate`, which measures the calibrated model in simulation
        (out_dir / SIMULATION_DIR).mkdir()
        shutil.move(state_path(Path(scratch)), out_dir / SIMULATION_DIR / STATE_FILE)
    q = cfg.quantization
    found = quant_algos(out_dir)
    if found != (q.quant_algo, q.kv_cache_quant_algo):
        raise UnsupportedModelError(
            f"ModelOpt's unified checkpoint names quant_algo={found[0]} kv_cache_quant_algo={found[1]} "
            f"({HF_QUANT_CONFIG}) for quantization.mode={q.mode} kv_cache_dtype={q.kv_cache_dtype}",
            hint="See modelopt.log in the quantize output folder for ModelOpt's messages.",
        )
    # The engine-route facts of the calibration run that describe the checkpoint written here.
    kept = ("modelopt_version", "modelopt_config", "modelopt_algorithm", "dtype", "calibration",
            "modelopt_warnings", "calibrate_seconds")  # fmt: skip
    return {
        **{key: facts[key] for key in kept if key in facts},
        "format": "ModelOpt unified HF checkpoint",
        "quant_algo": found[0],
        "kv_cache_quant_algo": found[1],
        "group_size": group_size(out_dir),
        "checkpoint_files": files,
        "tool_packages": ["nvidia-modelopt"],
    }
