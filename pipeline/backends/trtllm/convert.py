"""convert (trtllm): HF checkpoint -> TensorRT-LLM unified checkpoint (config.json + rank{r}.safetensors).

Modes TensorRT-LLM applies without calibration (none, int8_wo, int4_wo, fp8_pc_pt) are converted here with
one `from_hugging_face` + `save_checkpoint` per rank, as its convert_checkpoint.py does, with the tp/pp Mapping
of the config. The ModelOpt formats (fp8, int8_sq, int4_awq, w4a8_awq, nvfp4, a quantized KV cache) are
calibrated and exported from the HF checkpoint by the quantize step, so for them this step needs no
TensorRT-LLM: it checks the model's shapes against the format and carries the tokenizer on.
Either way the tokenizer goes into `tokenizer/` (trtllm-build writes none; the engine folder carries it).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from pipeline.backends.trtllm import guards
from pipeline.backends.trtllm.api import (
    check_unified_checkpoint,
    convert_needs_trtllm,
    hf_architecture,
    load_api,
    model_class_name,
)
from pipeline.config.build_config import BuildConfig
from pipeline.quantize.modelopt.formats import CONVERT_MODES, check_supported
from pipeline.quantize.modelopt.run import check_config
from pipeline.quantize.modelopt.shapes import read_hf_config
from pipeline.runtime.engine_config import TOKENIZER_DIR
from pipeline.sources.tokenizer import copy_tokenizer

# convert_checkpoint.py --use_fp8_rowwise sets this activation clamp unless the HF config carries its own
# (NVIDIA/TensorRT-LLM:examples/models/core/llama/convert_checkpoint.py@fd96a08bdc489f41f139b295935b10ed43652fa1,
# args_to_quant_config).
FP8_ROWWISE_CLAMP = [-1200.0, 1200.0]


def convert_quant_algo(cfg: BuildConfig) -> str | None:
    """The quant_algo convert applies itself: weight-only or FP8 rowwise, else none."""
    q = cfg.quantization
    return q.quant_algo if q.mode in CONVERT_MODES else None


def convert(cfg: BuildConfig, hf_dir: Path, out_dir: Path) -> dict[str, Any]:
    q = cfg.quantization
    check_supported(q.mode, q.kv_cache_dtype)
    guards.check_this_machine_supports(cfg)  # before conversion and calibration, not after them
    class_name = model_class_name(hf_dir)  # an architecture the engine route lacks: refused before either
    if not convert_needs_trtllm(cfg):
        return _for_modelopt(cfg, hf_dir, out_dir)
    api = load_api()
    model_cls = api.model_class(class_name)
    quant_algo = convert_quant_algo(cfg)
    clamp_val = FP8_ROWWISE_CLAMP if q.mode == "fp8_pc_pt" else None
    quant_config = api.make_quant_config(quant_algo, None, q.group_size, clamp_val=clamp_val)
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    world = tp * pp
    for rank in range(world):
        mapping = api.mapping(world_size=world, rank=rank, tp_size=tp, pp_size=pp)
        # Each rank loads the HF weights and keeps its shard; loading on CPU keeps GPU memory for the build.
        model = model_cls.from_hugging_face(
            str(hf_dir), dtype=cfg.dtype, mapping=mapping, quant_config=quant_config, load_model_on_cpu=True
        )
        model.save_checkpoint(str(out_dir), save_config=(rank == 0))
        del model
        gc.collect()
    files = check_unified_checkpoint(out_dir, world)
    return {
        "architecture": hf_architecture(hf_dir),
        "trtllm_model_class": class_name,
        "dtype": cfg.dtype,
        "tp_size": tp,
        "pp_size": pp,
        "quant_algo": quant_algo,
        "checkpoint_files": files,
        "tokenizer_files": copy_tokenizer(hf_dir, out_dir / TOKENIZER_DIR),
        "tensorrt_llm_version": api.version,
        "tool_packages": ["tensorrt_llm"],
    }


def _for_modelopt(cfg: BuildConfig, hf_dir: Path, out_dir: Path) -> dict[str, Any]:
    class_name = model_class_name(hf_dir)
    # Fail here, not after a long calibration: the checks read config.json alone.
    check_config(cfg, read_hf_config(hf_dir))
    return {
        "architecture": hf_architecture(hf_dir),
        "trtllm_model_class": class_name,
        "route": "modelopt",
        "quant_algo": None,
        "checkpoint_files": [],
        "note": "ModelOpt calibrates and exports the HF checkpoint in the quantize step",
        "tokenizer_files": copy_tokenizer(hf_dir, out_dir / TOKENIZER_DIR),
    }
