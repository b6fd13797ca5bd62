"""Building blocks of the Llama-family forward: dense linear, RoPE tables, and paged attention (the
compiled kernel on CPU, a torch implementation elsewhere)."""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from pipeline.errors import UnsupportedModelError
from pipeline.runtime.engine_config import ROPE_TYPES, ModelConfig, rope_type
from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.quant.linear import bf16_linear, fp32_linear
from pipeline.runtime.worker.attn_metadata import AttentionMetadata
from pipeline.runtime.worker.kv_cache import KVCache
from pipeline.runtime.worker.kv_quant import dequantize_kv, quantize_kv


class Linear(Protocol):
    """What the model needs from a (dense or quantized) linear layer: y = x @ W.T (+ b)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def weight_bytes(self) -> int:
        """Bytes of stored weights a forward reads (for a quantized layer: codes, scales, zero points)."""
        ...


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias

    @property
    def weight_bytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Few-row fp32 CPU inputs (decode) take the hand-written GEMV, ~20% faster than MKL's here and
        # ~40% on the lm_head; everything else is F.linear.
        if self.weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
            return bf16_linear(x, self.weight, self.bias)
        return fp32_linear(x, self.weight, self.bias)


class ResidualRMSNorm:
    """hidden += delta (when given), then RMSNorm(hidden) * weight: the compiled kernel when `use_kernel`
    (CPU, fp32), else torch."""

    def __init__(self, use_kernel: bool, hidden_size: int, eps: float) -> None:
        self.use_kernel = use_kernel
        self.shape = (hidden_size,)
        self.eps = eps

    def __call__(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        if self.use_kernel and (delta is None or delta.is_contiguous()):
            return kernels.add_rms_norm(hidden, delta, weight, self.eps)
        if delta is not None:
            hidden.add_(delta)
        return F.rms_norm(hidden, self.shape, weight, self.eps)


def rotary_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], computed as transformers does so cos/sin match it bit for bit."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise UnsupportedModelError(
        f"RoPE scaling {kind!r} is not implemented; supported: {', '.join(ROPE_TYPES)}"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(is_medium, blended, scaled)


def rotary_cos_sin(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim]: cos(pos * inv_freq) in the first half, sin in the second (fp32)."""
    inv_freq = rotary_inv_freq(config.head_dim, config.rotary_base, config.rotary_scaling)
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX RoPE: x [T, heads, D]; cos/sin [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(Protocol):
    """RoPE, KV-cache write and paged attention of one layer: qkv [T, (H + 2 KV) D] -> [T, H D]."""

    def begin_step(self, meta: AttentionMetadata) -> None: ...

    def __call__(self, layer: int, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...


class KernelAttention:
    """The compiled kernel (CPU, fp32 compute, fp32, bf16 or int8 cache): rotates q/k in place inside qkv,
    writes K/V, attends through block tables."""

    def __init__(self, kv_cache: KVCache, config: ModelConfig, cos_sin: torch.Tensor):
        self.kv_cache = kv_cache
        self.config = config
        self.cos_sin = cos_sin  # [max_positions, D]
        self._step_args: tuple[Any, ...] = ()
        # Per layer: K, V, K scales, V scales (scales None unless int8).
        self._layer_args = list(
            zip(kv_cache.k, kv_cache.v, kv_cache.k_scales, kv_cache.v_scales, strict=True)
        )

    @staticmethod
    def supports(config: ModelConfig) -> bool:
        return config.head_dim % 8 == 0 and config.head_dim <= 256

    def begin_step(self, meta: AttentionMetadata) -> None:
        c = self.config
        self._step_args = (
            self.cos_sin,
            meta.positions,
            meta.slot_mapping,
            meta.block_tables,
            meta.token_seq,
            c.num_attention_heads,
            self.kv_cache.block_size,
            c.sliding_window or 0,
            meta.max_context_len,
            c.head_dim**-0.5,
        )

    def __call__(self, layer: int, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return kernels.paged_attention(qkv, *self._layer_args[layer], *self._step_args)


class TorchAttention:
    """Any device and dtype: gathers each sequence's K/V blocks (dequantized when the cache is int8) into a
    padded batch for one SDPA call."""

    def __init__(self, kv_cache: KVCache, config: ModelConfig, cos_sin: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.config = config
        self.cos_sin = cos_sin  # [max_positions, D], on the compute device

    def begin_step(self, meta: AttentionMetadata) -> None:
        pass

    def __call__(self, layer: int, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        c, tokens = self.config, meta.num_tokens
        heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        assert meta.padded is not None, "TorchAttention needs AttentionMetadata built with padded=True"
        padded = meta.padded
        cos_sin = self.cos_sin[meta.positions].to(qkv.dtype)[:, None, :]  # [T, 1, D]
        cos, sin = cos_sin[..., : d // 2], cos_sin[..., d // 2 :]
        q = apply_rope(qkv[:, : heads * d].view(tokens, heads, d), cos, sin)
        k = apply_rope(qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d), cos, sin)
        v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
        cache = self.kv_cache
        keys = self._write_and_gather(
            cache.k[layer], cache.k_scales[layer], k, meta.slot_mapping, padded.block_tables
        )
        values = self._write_and_gather(
            cache.v[layer], cache.v_scales[layer], v, meta.slot_mapping, padded.block_tables
        )
        num_seqs = padded.block_tables.shape[0]
        queries = q.new_zeros(num_seqs, padded.max_query_len, heads, d)
        queries[padded.token_seq, padded.token_row] = q
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=padded.mask,
            enable_gqa=kv_heads != heads,
        )  # [S, H, max_q, D]
        return out.transpose(1, 2)[padded.token_seq, padded.token_row].reshape(tokens, heads * d)

    def _write_and_gather(
        self,
        cache: torch.Tensor,
        scales: torch.Tensor | None,
        new: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """Write new [T, KV, D] into its slots of cache [num_slots, KV, D] (quantized, with scales
        [num_slots, KV], when the cache is int8), then return each sequence's rows through its block table:
        [S, max_blocks * block_size, KV, D] in new's dtype."""
        bs, kv_heads, d = self.kv_cache.block_size, cache.shape[1], cache.shape[2]
        shape = (block_tables.shape[0], block_tables.shape[1] * bs, kv_heads, d)
        if scales is None:  # a cache in the compute dtype or in bf16 under fp32 compute
            cache.index_copy_(0, slot_mapping, new.to(cache.dtype))
            return cache.view(-1, bs, kv_heads, d)[block_tables].view(shape).to(new.dtype)
        q, scale = quantize_kv(new)
        cache.index_copy_(0, slot_mapping, q)
        scales.index_copy_(0, slot_mapping, scale)
        rows = cache.view(-1, bs, kv_heads, d)[block_tables].view(shape)
        row_scales = scales.view(-1, bs, kv_heads)[block_tables].view(shape[:3])
        return dequantize_kv(rows, row_scales, new.dtype)
