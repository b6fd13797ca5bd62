"""The names llmpipe shares with TensorRT-LLM, declared once: quantization modes and their checkpoint
`quant_algo`, scheduler policies, KV cache dtypes, and which tensorrtllm_backend model parameter carries each
build-config field.

The build config follows the LLM API's field names (`kv_cache_config.enable_block_reuse` ->
`kv_cache.enable_block_reuse`), the Triton model follows tensorrtllm_backend's parameter names
(`enable_kv_cache_reuse`): both are upstream's names at their layer, and TRITON_ENGINE_PARAMETERS is the
one place that maps one to the other.
"""

from __future__ import annotations

from typing import Literal

QuantMode = Literal[
    "none", "int8_wo", "int4_wo", "int4_awq", "int4_gptq", "w4a8_awq", "int8_sq", "fp8", "fp8_pc_pt", "nvfp4"
]
# Which quantization modes each backend implements; `trtllm` follows ModelOpt's quantize.py --qformat list
# (which has no GPTQ: TensorRT-LLM only loads GPTQ checkpoints made elsewhere); `trtllm_pytorch` the formats
# TensorRT-LLM 1.1.0's PyTorch backend loads from a ModelOpt checkpoint (its quantization support matrix,
# NVIDIA/TensorRT-LLM:1.1.0/features/quantization.html@8660c119, gh-pages).
BACKEND_QUANT_MODES: dict[str, tuple[str, ...]] = {
    "torch": ("none", "int8_wo", "int8_sq", "int4_wo", "int4_awq", "int4_gptq"),
    "trtllm": ("none", "int8_wo", "int4_wo", "int4_awq", "w4a8_awq", "int8_sq", "fp8", "fp8_pc_pt", "nvfp4"),
    "trtllm_pytorch": ("none", "int4_awq", "w4a8_awq", "fp8", "nvfp4"),
}
# Group sizes of the group-wise int4 formats (TensorRT-LLM's --group_size / ModelOpt's AWQ block).
INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
# (backend, mode) pairs whose int4 grids quantization.tune can train (quantize/tune/).
TUNED_INT4_MODES = (("torch", "int4_wo"), ("torch", "int4_awq"), ("torch", "int4_gptq"))
BACKEND_KV_DTYPES: dict[str, tuple[str, ...]] = {
    "torch": ("auto", "int8"),
    "trtllm": ("auto", "int8", "fp8"),
    "trtllm_pytorch": ("auto", "fp8"),
}
TRTLLM_PYTORCH_SPECULATIVE_MODES = ("none", "draft_model", "ngram")
# Why the PyTorch backend (TensorRT-LLM 1.1.0) cannot take a setting the engine route or the torch backend
# can, keyed by the setting; the config check quotes it. Sources: the quantization support matrix above;
# tensorrt_llm/llmapi/llm_args.py@48b7b5d (LookaheadDecodingConfig / MedusaDecodingConfig.supports_backend,
# TorchLlmArgs.sync_quant_config_with_kv_cache_config_dtype, EagleDecodingConfig.validate).
TRTLLM_PYTORCH_REFUSALS: dict[str, str] = {
    "quantization.mode=int8_wo": "the PyTorch backend has no INT8 weight-only format (its quantization support "
    "matrix lists none; https://github.com/NVIDIA/TensorRT-LLM/issues/3701)",
    "quantization.mode=int4_wo": "plain W4A16 weight-only is an engine-route format: the PyTorch backend loads "
    "int4 weights only as AWQ or GPTQ checkpoints",
    "quantization.mode=int8_sq": "the PyTorch backend has no INT8 SmoothQuant (W8A8) format (its quantization "
    "support matrix lists none)",
    "quantization.mode=fp8_pc_pt": "the PyTorch backend loads FP8 rowwise (FP8_PER_CHANNEL_PER_TOKEN) checkpoints on "
    "Hopper, but llmpipe's ModelOpt step does not make them yet (ModelOpt's FP8_PER_CHANNEL_PER_TOKEN_CFG)",
    "quantization.mode=int4_gptq": "the PyTorch backend loads W4A16 GPTQ only from checkpoints in its own layout, "
    "and this route quantizes with ModelOpt, which makes no GPTQ checkpoints",
    "quantization.kv_cache_dtype=int8": "the PyTorch backend's KvCacheConfig.dtype maps only auto and fp8 (an INT8 "
    "KV cache is not in 1.1.0: https://github.com/NVIDIA/TensorRT-LLM/issues/3701)",
    "speculative.mode=lookahead": "lookahead decoding is an engine-route mode (LookaheadDecodingConfig does not "
    "support the pytorch backend)",
    "speculative.mode=medusa": "Medusa is an engine-route mode (MedusaDecodingConfig does not support the "
    "pytorch backend)",
    "speculative.mode=eagle": "EAGLE on the PyTorch backend needs EAGLE3 draft weights "
    "(EagleDecodingConfig.speculative_model_dir), which the build config does not name",
}
# quantize.py --qformat -> the checkpoint's quantization.quant_algo
# (NVIDIA/TensorRT-LLM:examples/quantization/quantize.py@c8c6df0); int4_gptq, torch only, takes the QuantAlgo
# TensorRT-LLM gives GPTQ checkpoints (W4A16_GPTQ, tensorrt_llm/quantization/mode.py).
QUANT_ALGO: dict[str, str | None] = {
    "none": None,
    "int8_wo": "W8A16",
    "int4_wo": "W4A16",
    "int4_awq": "W4A16_AWQ",
    "int4_gptq": "W4A16_GPTQ",
    "w4a8_awq": "W4A8_AWQ",
    "int8_sq": "W8A8_SQ_PER_CHANNEL",
    "fp8": "FP8",
    "fp8_pc_pt": "FP8_PER_CHANNEL_PER_TOKEN",
    "nvfp4": "NVFP4",
}
# Where the torch backend's format differs from the engine route's for the same mode: its int8_sq quantizes the
# activations per token at run time (no calibrated activation scale), which TensorRT-LLM names
# W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN (tensorrt_llm/quantization/mode.py); ModelOpt's int8_sq export is per tensor.
TORCH_QUANT_ALGO: dict[str, str | None] = {**QUANT_ALGO, "int8_sq": "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"}

# TensorRT-LLM's batch_scheduler_policy values. guaranteed_no_evict admits a request only if its whole
# sequence's KV blocks can be reserved (never preempts); max_utilization admits when the prompt fits and
# preempts the newest request when blocks run out.
SchedulerPolicy = Literal["guaranteed_no_evict", "max_utilization"]
SCHEDULER_POLICIES: tuple[SchedulerPolicy, ...] = ("guaranteed_no_evict", "max_utilization")

# Build-config field -> the `tensorrt_llm` model parameter (config.pbtxt) that carries it, on both backends.
TRITON_ENGINE_PARAMETERS: dict[str, str] = {
    "engine.max_beam_width": "max_beam_width",
    "scheduler.policy": "batch_scheduler_policy",
    "scheduler.enable_chunked_context": "enable_chunked_context",
    "kv_cache.enable_block_reuse": "enable_kv_cache_reuse",
    "kv_cache.free_memory_fraction": "kv_cache_free_gpu_mem_fraction",
    "kv_cache.max_tokens": "max_tokens_in_paged_kv_cache",
    "serving.exclude_input_in_output": "exclude_input_in_output",
}
