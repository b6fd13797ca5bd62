"""The int8 KV cache format (`kv_cache_quant_algo: INT8`): every cached key and value head of every token
is stored as D int8 values plus one fp32 scale, value ~= q * scale, with

    scale = max(max|x| / 127, FLT_MIN)   over the head's D values
    q     = clamp(round_half_even(x / scale), -127, 127)

These torch functions are the format's definition for the torch attention path and the tests; the attention
kernel (runtime/kernels/csrc/paged_attention.cpp) computes the same in C++, bit for bit from the same input floats.

NOTE: why dynamic per-token-per-head scales rather than TensorRT-LLM's static scales calibrated offline
(`kv_cache_scaling_factor` in the checkpoint), measured on SmolLM2-135M-Instruct with K/V quantized and
dequantized as Hugging Face caches them, against fp32 K/V; static scales = max |x| per (layer, KV head) or
per layer over the 30 text samples of pipeline/data/calib.jsonl (512 tokens each):

    held-out text (validate's)   scales            mean KL   top-1    ppl delta
    16 windows x 128 tokens      per token, head   0.0008    0.983    -0.03 %
                                 static per head   0.0037    0.957    -0.02 %
                                 static per layer  0.0047    0.953    +1.20 %
    5 windows x 512 tokens       per token, head   0.0007    0.981    +0.13 %
                                 static per head   0.0032    0.971    +0.33 %
                                 static per layer  0.0038    0.963    +0.67 %

- Accuracy: 4-5x lower KL and 1-3 points more top-1 agreement. A static scale must cover the largest key or
  value of any token (over the calibration text SmolLM2's per-layer maxima are 11-23 for keys, 0.6-20 for
  values), so tokens with smaller keys and values get fewer int8 levels; a per-token scale fits each.
- No calibration: the quantize stage needs no data or forward passes, and a prompt unlike the calibration
  text cannot overflow a scale.
- Cost: one fp32 per token and head beside D int8 values, 4 / D extra (6 % at D = 64): the cache holds
  4 D / (D + 4) times the tokens of a fp32 one (3.8x at D = 64) instead of 4x. Computing the scale is one
  max over D values as each token is written; reading applies it once per key and value, not per element.
"""

from __future__ import annotations

import torch

from pipeline.errors import UnsupportedModelError

# kv_cache_quant_algo values the torch runtime implements (None = the cache is in the compute dtype).
KV_QUANT_ALGOS = (None, "INT8")
INT8_MAX = 127
SCALE_BYTES = 4  # one fp32 scale per token per head


def check_kv_quant_algo(algo: str | None) -> bool:
    """True for an int8 cache, False for the compute dtype; UnsupportedModelError for anything else."""
    if algo not in KV_QUANT_ALGOS:
        raise UnsupportedModelError(
            f"kv_cache_quant_algo={algo} is not implemented by the torch runtime; supported: INT8 or null",
            hint="rebuild with quantization.kv_cache_dtype: int8 or auto",
        )
    return algo == "INT8"


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (q [..., D] int8, scale [...] fp32)."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (x / scale[..., None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [..., D] int8, scale [...] fp32) -> [..., D] in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)
