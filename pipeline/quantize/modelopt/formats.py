"""llmpipe's quantization settings -> the ModelOpt quantize config, and which settings take this route.

Sources of the mapping:
* mode -> config: the QUANT_CFG_CHOICES of ModelOpt's examples/llm_ptq/hf_ptq.py
  (NVIDIA/Model-Optimizer:examples/llm_ptq/hf_ptq.py@003e0fba3d937b1789dcdca8c97521df053516ac), the same
  table TensorRT-LLM's quantize.py uses
  (NVIDIA/TensorRT-LLM:tensorrt_llm/quantization/quantize_by_modelopt.py@042c510d33e3ba07ac0e3d1ef810b82198b90e0c,
  quant_cfg_choices). The group size of the AWQ formats replaces the weight quantizer's last-axis block size,
  as quantize_by_modelopt.py does with --awq_block_size.
* KV cache: hf_ptq.py appends the entries of `FP8_KV_CFG` to the model config
  (mtq.utils.update_quant_cfg_with_kv_cache_quant). TensorRT-LLM's int8 KV cache is KV_CACHE_CFG in
  quantize_by_modelopt.py: 8-bit, one scale per tensor (axis None). ModelOpt 0.47 has no int8 KV preset and
  its exporter reads the KV cache from the attention's k/v BMM quantizers
  (modelopt/torch/export/quant_utils.py get_kv_cache_dtype: num_bits 8 -> INT8, (4, 3) -> FP8), so int8 is
  FP8_KV_CFG's entry with TensorRT-LLM's int8 numerics.
* Which settings calibrate through ModelOpt: TensorRT-LLM's QuantConfig._requires_modelopt_quantization
  (tensorrt_llm/models/modeling_utils.py): NVFP4, FP8, W4A16_AWQ, W4A8_AWQ, W8A8_SQ_PER_CHANNEL, or no weight
  quantization with an FP8 KV cache. An int8 KV cache alone takes the same route here.
"""

from __future__ import annotations

import copy
from typing import Any

from pipeline.errors import ConfigError

# quantization.mode -> the ModelOpt config (an attribute of modelopt.torch.quantization).
MODE_CONFIGS: dict[str, str] = {
    "fp8": "FP8_DEFAULT_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int4_awq": "INT4_AWQ_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",
    "nvfp4": "NVFP4_DEFAULT_CFG",
}
MODELOPT_MODES: frozenset[str] = frozenset(MODE_CONFIGS)
# Modes whose weights are quantized in blocks along the input features: the block is quantization.group_size
# for the AWQ formats and NVFP4's fixed 16 (its FP8 scale per 16 values).
GROUP_SIZE_MODES: frozenset[str] = frozenset({"int4_awq", "w4a8_awq"})
NVFP4_BLOCK = 16
# Modes TensorRT-LLM applies while converting (from_hugging_face), without calibration.
CONVERT_MODES: frozenset[str] = frozenset({"int8_wo", "int4_wo", "fp8_pc_pt"})

_KV_ENTRY = "*[kv]_bmm_quantizer"
_KV_NUM_BITS: dict[str, Any] = {"fp8": (4, 3), "int8": 8}


def uses_modelopt(mode: str, kv_cache_dtype: str) -> bool:
    """Whether these settings are calibrated by ModelOpt (the quantize step), not applied by convert."""
    return mode in MODELOPT_MODES or (mode == "none" and kv_cache_dtype != "auto")


def unsupported_reason(mode: str, kv_cache_dtype: str) -> str | None:
    """Why the trtllm backend cannot produce this combination, or None. A quantized KV cache needs
    calibration, which here is ModelOpt's, and ModelOpt exports none of the modes convert applies (TensorRT-LLM
    calibrates those with its own `<Model>.quantize` flow, which llmpipe does not run). Fit for a config
    validator (it only reads the two fields)."""
    if mode in CONVERT_MODES and kv_cache_dtype != "auto":
        return (
            f"quantization.mode={mode} with quantization.kv_cache_dtype={kv_cache_dtype}: a quantized KV cache is "
            f"calibrated by ModelOpt, which cannot export {mode}; use kv_cache_dtype=auto with {mode}, or a "
            f"calibrated mode ({', '.join(sorted(MODELOPT_MODES))}) or mode=none with the KV cache dtype"
        )
    return None


def check_supported(mode: str, kv_cache_dtype: str) -> None:
    """ConfigError with unsupported_reason's words, for the steps and the plan."""
    reason = unsupported_reason(mode, kv_cache_dtype)
    if reason:
        raise ConfigError(reason)


def block_size(mode: str, group_size: int) -> int | None:
    """The block along the input features the mode quantizes weights in, or None (per tensor / channel)."""
    if mode in GROUP_SIZE_MODES:
        return group_size
    return NVFP4_BLOCK if mode == "nvfp4" else None


def quant_config(
    mtq: Any, mode: str, kv_cache_dtype: str, group_size: int, quantize_lm_head: bool = False
) -> dict[str, Any]:
    """The `mtq.quantize` config for these settings (a deep copy: ModelOpt's presets are shared). ModelOpt
    0.47 spells `quant_cfg` as a list of {"quantizer_name", "cfg" | "enable"} entries applied in order, the
    0.3x releases (TensorRT-LLM 1.1's pin is ~=0.37) as a dict keyed by the quantizer pattern: both are
    edited in their own shape."""
    if mode in MODE_CONFIGS:
        config: dict[str, Any] = copy.deepcopy(getattr(mtq, MODE_CONFIGS[mode]))
    elif mode == "none" and kv_cache_dtype != "auto":
        config = _disabled_like(mtq.FP8_DEFAULT_CFG)
    else:
        raise ValueError(f"quantization.mode={mode} kv_cache_dtype={kv_cache_dtype} is not a ModelOpt format")
    entries = config["quant_cfg"]
    if mode in GROUP_SIZE_MODES:
        # W4A8 quantizes weights twice (int4 in blocks, then FP8): the first format holds the block.
        weight = _entry(entries, "*weight_quantizer")
        first = weight[0] if isinstance(weight, list) else weight
        first["block_sizes"] = {**first["block_sizes"], -1: group_size}
    if quantize_lm_head:  # TensorRT-LLM's quantize.py drops the entry that keeps the output head unquantized
        config["quant_cfg"] = _without(entries, "*lm_head*")
    if kv_cache_dtype != "auto":
        config["quant_cfg"] = _merged(config["quant_cfg"], kv_cache_entries(mtq, kv_cache_dtype))
    return config


def kv_cache_entries(mtq: Any, kv_cache_dtype: str) -> Any:
    """FP8_KV_CFG's `quant_cfg` (the shape of the installed release) with `kv_cache_dtype`'s numerics."""
    entries = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    kv = _entry(entries, _KV_ENTRY)
    kv.update(num_bits=_KV_NUM_BITS[kv_cache_dtype], axis=None)
    return entries


def _entry(entries: Any, name: str) -> Any:
    """The settings of quantizer pattern `name` (mutable, in place)."""
    if isinstance(entries, dict):
        return entries[name]
    for entry in entries:
        if entry.get("quantizer_name") == name and "cfg" in entry:
            return entry["cfg"]
    raise ValueError(f"the ModelOpt config has no {name} entry: {entries}")


def _without(entries: Any, name: str) -> Any:
    if isinstance(entries, dict):
        return {k: v for k, v in entries.items() if k != name}
    return [e for e in entries if e.get("quantizer_name") != name]


def _merged(entries: Any, extra: Any) -> Any:
    # dict: TensorRT-LLM's quantize_by_modelopt.py updates the dict; list: hf_ptq.py appends the entries
    # (mtq.utils.update_quant_cfg_with_kv_cache_quant), later entries winning.
    return {**entries, **extra} if isinstance(entries, dict) else [*entries, *extra]


def _disabled_like(preset: dict[str, Any]) -> dict[str, Any]:
    """A config that enables no quantizer, in the preset's shape: the base a KV-cache-only config extends."""
    if isinstance(preset["quant_cfg"], dict):
        return {"quant_cfg": {"default": {"enable": False}}, "algorithm": "max"}
    return {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
