"""convert (trtllm): HF checkpoint -> TensorRT-LLM unified checkpoint (config.json + rank{r}.safetensors).

One `from_hugging_face` + `save_checkpoint` per rank, as TensorRT-LLM's convert_checkpoint.py does, with
the tp/pp Mapping of the config. Weight-only modes (int8_wo/int4_wo) are applied here without calibration;
calibrated modes and quantized KV caches are produced by the quantize step from the HF checkpoint, so this
step then writes the unquantized checkpoint (the reference those modes are validated against).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from pipeline.backends.trtllm import guards
from pipeline.backends.trtllm.api import check_unified_checkpoint, hf_architecture, load_api, model_class_name
from pipeline.backends.trtllm.versions import WEIGHT_ONLY_MODES
from pipeline.config.build_config import BuildConfig
from pipeline.runtime.engine_config import TOKENIZER_DIR
from pipeline.sources.tokenizer import copy_tokenizer


def convert_quant_algo(cfg: BuildConfig) -> str | None:
    """The quant_algo convert applies itself: weight-only without a quantized KV cache, else none."""
    q = cfg.quantization
    if q.mode in WEIGHT_ONLY_MODES and q.kv_cache_dtype == "auto":
        return q.quant_algo
    return None


def convert(cfg: BuildConfig, hf_dir: Path, out_dir: Path) -> dict[str, Any]:
    guards.check_this_machine_supports(cfg)  # before conversion and calibration, not after them
    api = load_api()
    class_name = model_class_name(hf_dir)
    model_cls = api.model_class(class_name)
    quant_algo = convert_quant_algo(cfg)
    quant_config = api.make_quant_config(quant_algo, None, cfg.quantization.group_size)
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
    # trtllm-build writes no tokenizer; carried from here to the engine folder, which serving reads
    tokenizer_files = copy_tokenizer(hf_dir, out_dir / TOKENIZER_DIR)
    return {
        "architecture": hf_architecture(hf_dir),
        "trtllm_model_class": class_name,
        "dtype": cfg.dtype,
        "tp_size": tp,
        "pp_size": pp,
        "quant_algo": quant_algo,
        "checkpoint_files": files,
        "tokenizer_files": tokenizer_files,
        "tensorrt_llm_version": api.version,
        "tool_packages": ["tensorrt_llm"],
    }
