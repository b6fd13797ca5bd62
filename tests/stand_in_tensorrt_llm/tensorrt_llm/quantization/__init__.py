"""Stand-in `tensorrt_llm.quantization.QuantAlgo`: the 1.x member names (tensorrt_llm/quantization/mode.py)."""

from __future__ import annotations

from enum import Enum


class QuantAlgo(str, Enum):
    W8A16 = "W8A16"
    W4A16 = "W4A16"
    W4A16_AWQ = "W4A16_AWQ"
    W4A8_AWQ = "W4A8_AWQ"
    W8A16_GPTQ = "W8A16_GPTQ"
    W4A16_GPTQ = "W4A16_GPTQ"
    W8A8_SQ_PER_CHANNEL = "W8A8_SQ_PER_CHANNEL"
    FP8 = "FP8"
    FP8_PER_CHANNEL_PER_TOKEN = "FP8_PER_CHANNEL_PER_TOKEN"
    INT8 = "INT8"
    NVFP4 = "NVFP4"
    NO_QUANT = "NO_QUANT"
