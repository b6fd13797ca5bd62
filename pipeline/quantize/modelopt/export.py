"""ModelOpt's exporters: the TensorRT-LLM checkpoint that `trtllm-build` reads, and the unified HF checkpoint
(safetensors + hf_quant_config.json) that TensorRT-LLM's LLM API loads.

TensorRT-LLM checkpoint format: NVIDIA/TensorRT-LLM:docs/source/legacy/architecture/checkpoint.md@10c1d594d3078c5e9f425373bc15763e87084a07
(config.json with `architecture`, `dtype`, `mapping`, `quantization`; one rank{r}.safetensors per rank).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pipeline.architectures import SUPPORTED_ARCHITECTURES
from pipeline.backends.trtllm.architectures import MODEL_CLASS_FOR_ARCHITECTURE
from pipeline.errors import UnsupportedModelError
from pipeline.quantize.modelopt.formats import CONVERT_MODES
from pipeline.quantize.modelopt.library import LOG_NAME, ModelOptLog
from pipeline.runtime.model_config import hf_rope
from pipeline.sources.tokenizer import copy_tokenizer

# HF architecture -> ModelOpt's decoder type: what its get_model_type gives (the first MODEL_NAME_TO_TYPE key
# found in the model class name; modelopt/torch/export/model_utils.py of nvidia-modelopt 0.47.0, and
# NVIDIA/Model-Optimizer:modelopt/torch/export/model_utils.py@0bb9291). Olmo2, Granite and SmolLM3 have none.
DECODER_TYPES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen",
    "Qwen3ForCausalLM": "qwen",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}

# Why export_tensorrt_llm_checkpoint fails for an architecture where llmpipe runs ModelOpt (CPU, no
# TensorRT-LLM, transformers 5), as observed with nvidia-modelopt 0.47.0 on a random 2-layer model of each
# after FP8 calibration (tests/contract/upstream/modelopt_export.tsv). Without tensorrt_llm its
# convert_to_tensorrt_llm_config writes configs for the decoder types gpt, gemma, llama and qwen only; its
# build_moe_config takes llama, dbrx, phi3, deepseek and qwen MoE layers only.
_NO_DECODER = "get_model_type gives it no decoder type"
_NO_CONFIG = "it writes TensorRT-LLM configs for decoder types gpt, gemma, llama and qwen only when TensorRT-LLM is not installed"
NO_TRTLLM_CHECKPOINT: dict[str, str] = {
    "MixtralForCausalLM": "transformers 5 fuses Mixtral's experts into one module its exporter cannot index",
    "Qwen3MoeForCausalLM": "its MoE export takes llama, dbrx, phi3, deepseek and qwen layers, not qwen3moe",
    "Gemma2ForCausalLM": _NO_CONFIG,
    "Gemma3ForCausalLM": _NO_CONFIG,
    "Phi3ForCausalLM": _NO_CONFIG,
    "Olmo2ForCausalLM": _NO_DECODER,
    "GraniteForCausalLM": _NO_DECODER,
    "SmolLM3ForCausalLM": _NO_DECODER,
}
# Those whose TensorRT-LLM checkpoint it exports (the engine route's calibrated formats).
TRTLLM_CHECKPOINT_ARCHITECTURES: tuple[str, ...] = tuple(
    a for a in DECODER_TYPES if a not in NO_TRTLLM_CHECKPOINT
)
# Those whose unified HF checkpoint (the trtllm_pytorch route's format) it exports: all of llmpipe's, as observed.
UNIFIED_HF_ARCHITECTURES: tuple[str, ...] = SUPPORTED_ARCHITECTURES

# What the quantize step exports: a TensorRT-LLM checkpoint (backend trtllm) or a unified HF one (trtllm_pytorch).
TRTLLM_EXPORT, HF_EXPORT = "trtllm", "hf"


def hf_architecture(hf_config: dict[str, Any]) -> str:
    architectures = hf_config.get("architectures") or []
    return str(architectures[0]) if architectures else ""


def architecture(hf_config: dict[str, Any], export: str = TRTLLM_EXPORT) -> str:
    """The checkpoint's architecture when ModelOpt exports it to `export`'s format here; else
    UnsupportedModelError in one line that says why and what to use instead."""
    arch = hf_architecture(hf_config)
    name = arch or "(none)"
    if export == HF_EXPORT:
        if arch not in UNIFIED_HF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"ModelOpt: architecture {name} has no unified HF checkpoint export in llmpipe; it exports "
                f"{', '.join(UNIFIED_HF_ARCHITECTURES)}"
            )
        return arch
    if arch in TRTLLM_CHECKPOINT_ARCHITECTURES:
        return arch
    why = NO_TRTLLM_CHECKPOINT.get(arch, "llmpipe has no record of ModelOpt exporting it")
    instead = "use backend: trtllm_pytorch (ModelOpt's unified HF checkpoint)"
    if arch in MODEL_CLASS_FOR_ARCHITECTURE:
        instead += f", or a mode the engine route's convert applies itself ({', '.join(['none', *sorted(CONVERT_MODES)])})"
    raise UnsupportedModelError(
        f"ModelOpt cannot export a TensorRT-LLM checkpoint of architecture {name} here: {why}; it exports "
        f"{', '.join(TRTLLM_CHECKPOINT_ARCHITECTURES)}; {instead}"
    )


def checkpoint_dtype(dtype: str, hf_config: dict[str, Any]) -> str:
    """The dtype of the unquantized tensors. `auto` keeps a float16/bfloat16 checkpoint's dtype and turns
    float32 into float16, as TensorRT-LLM's convert_checkpoint.py --dtype auto does
    (NVIDIA/TensorRT-LLM:examples/models/core/llama/convert_checkpoint.py@fd96a08bdc489f41f139b295935b10ed43652fa1)."""
    if dtype != "auto":
        return dtype
    source = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
    return source if source in ("float16", "bfloat16") else "float16"


def rank_files(world_size: int) -> list[str]:
    return ["config.json"] + [f"rank{r}.safetensors" for r in range(world_size)]


def export_trtllm_checkpoint(
    model: torch.nn.Module,
    hf_config: dict[str, Any],
    out_dir: Path,
    dtype: str,
    tp_size: int,
    pp_size: int,
    log: ModelOptLog,
) -> list[str]:
    """Write the TensorRT-LLM checkpoint of the calibrated `model` into `out_dir`; the files written. The
    export changes `model` (it packs weights in place)."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    with log.capture():
        export_tensorrt_llm_checkpoint(
            model,
            DECODER_TYPES[architecture(hf_config)],
            getattr(torch, dtype),
            export_dir=out_dir,
            inference_tensor_parallel=tp_size,
            inference_pipeline_parallel=pp_size,
        )
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config_path.write_text(json.dumps(complete_config(config, hf_config), indent=2) + "\n", encoding="utf-8")
    return rank_files(tp_size * pp_size)


def complete_config(config: dict[str, Any], hf_config: dict[str, Any]) -> dict[str, Any]:
    """The fields ModelOpt's exporter leaves out or gets wrong, set from the HF config as TensorRT-LLM's
    quantize.py sets them after exporting (quantize_by_modelopt.py, quantize_and_export): the RoPE base and
    scaling (the exporter reads `rope_theta`, which transformers 5 keeps inside `rope_parameters`, so it
    would fall back to 10000) and, for Qwen, `qwen_type`, which picks Qwen2 over the first Qwen."""
    base, scaling = hf_rope(hf_config)
    completed = {**config, "rotary_base": base, "rotary_scaling": scaling}
    if DECODER_TYPES[architecture(hf_config)] == "qwen":
        completed["qwen_type"] = str(hf_config.get("model_type", "qwen2"))
    return completed


def export_unified_hf_checkpoint(
    hf_dir: Path, quantized_dir: Path, export_dir: Path, dtype: str = "auto"
) -> list[str]:
    """The unified HF checkpoint (safetensors with quantized weights and scales, hf_quant_config.json, the
    tokenizer) of the model calibrated into `quantized_dir`, rebuilt from its saved ModelOpt state; the files
    written, ModelOpt's messages in `modelopt.log` among them."""
    from pipeline.quantize.modelopt.shapes import read_hf_config
    from pipeline.quantize.modelopt.state import load_simulated_model

    export_dir = Path(export_dir)
    export_dir.mkdir(parents=True, exist_ok=True)
    target = getattr(torch, checkpoint_dtype(dtype, read_hf_config(hf_dir)))
    with (export_dir / LOG_NAME).open("w", encoding="utf-8") as stream:
        log = ModelOptLog(stream)
        model = load_simulated_model(hf_dir, quantized_dir, log)
        # This exporter writes unquantized tensors in the model's own dtype (float32 after CPU calibration),
        # and runs the model once: cast all of it, as hf_ptq.py exports a model loaded in the target dtype.
        model.to(target)
        model.config.dtype = target
        with log.capture():
            from modelopt.torch.export import export_hf_checkpoint

            export_hf_checkpoint(model, dtype=target, export_dir=export_dir)
    copy_tokenizer(Path(hf_dir), export_dir)
    return sorted(p.name for p in export_dir.iterdir() if p.is_file())
