"""One layer's attention over the paged KV cache: q/k norms, RoPE, the cache write and causal (optionally
windowed, soft-capped) attention — the compiled kernel on CPU, a torch implementation elsewhere.

Everything that differs between layers (RoPE table, window, q/k norm weights) is in `LayerAttention`; the
model's forward only passes the layer index."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.model_config import ModelConfig
from pipeline.runtime.worker.attn_metadata import AttentionMetadata
from pipeline.runtime.worker.kv_cache import KVCache
from pipeline.runtime.worker.kv_quant import dequantize_kv, quantize_kv


@dataclass(frozen=True)
class LayerAttention:
    cos_sin: torch.Tensor  # [max_positions, D], on the compute device
    window: int | None  # attention window in tokens; None = full causal
    q_norm: torch.Tensor | None = None  # [D] (per head) or [H * D]
    k_norm: torch.Tensor | None = None  # [D] or [KV * D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX RoPE: x [T, heads, D]; cos/sin [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(Protocol):
    """q/k norms, RoPE, KV-cache write and paged attention of one layer: qkv [T, (H + 2 KV) D] -> [T, H D]."""

    def begin_step(self, meta: AttentionMetadata) -> None: ...

    def __call__(self, layer: int, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...


class _QKNorm:
    """RMSNorm of the query and key heads before RoPE, in place inside qkv: per head (Qwen3, Gemma 3) or over
    the whole projection (OLMo 2). Per head, the query and key heads are one [T, H + KV, D] view normalized
    in one call and scaled by the two weights stacked per head: three ops a layer, not ten."""

    def __init__(self, config: ModelConfig, layers: Sequence[LayerAttention]) -> None:
        self.heads, self.kv_heads, self.d = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.per_head = config.qk_norm == "per_head"
        self.eps = config.norm_epsilon
        self.head_weights: list[torch.Tensor] = []  # per layer [H + KV, D], per-head norms only
        for layer in layers:
            assert layer.q_norm is not None and layer.k_norm is not None, (
                "a q/k-norm model needs both weights"
            )
            if self.per_head:
                self.head_weights.append(
                    torch.cat((layer.q_norm.expand(self.heads, -1), layer.k_norm.expand(self.kv_heads, -1)))
                )

    def __call__(self, layer: int, qkv: torch.Tensor, params: LayerAttention) -> None:
        tokens, q_width = qkv.shape[0], self.heads * self.d
        if self.per_head:
            heads = qkv[:, : q_width + self.kv_heads * self.d].view(
                tokens, self.heads + self.kv_heads, self.d
            )
            heads.copy_(F.rms_norm(heads, (self.d,), None, self.eps).mul_(self.head_weights[layer]))
            return
        assert params.q_norm is not None and params.k_norm is not None
        for part, weight in (
            (qkv[:, :q_width], params.q_norm),
            (qkv[:, q_width : q_width + self.kv_heads * self.d], params.k_norm),
        ):
            part.copy_(F.rms_norm(part, (part.shape[1],), weight, self.eps))


class KernelAttention:
    """The compiled kernel (CPU, fp32 compute, fp32, bf16 or int8 cache): rotates q/k in place inside qkv,
    writes K/V, attends through block tables."""

    def __init__(self, kv_cache: KVCache, config: ModelConfig, layers: Sequence[LayerAttention]) -> None:
        self.kv_cache = kv_cache
        self.config = config
        self.layers = list(layers)
        self.qk_norm = _QKNorm(config, self.layers) if config.qk_norm else None
        self._step_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None = None
        # Per layer: K, V, K scales, V scales (scales None unless int8), then the RoPE table.
        self._layer_args: list[
            tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]
        ] = [
            (*cache, layer.cos_sin)
            for cache, layer in zip(
                zip(kv_cache.k, kv_cache.v, kv_cache.k_scales, kv_cache.v_scales, strict=True),
                self.layers,
                strict=True,
            )
        ]

    @staticmethod
    def supports(config: ModelConfig) -> bool:
        return config.head_dim % 8 == 0 and config.head_dim <= 256

    def begin_step(self, meta: AttentionMetadata) -> None:
        c = self.config
        self._step_args = (
            meta.positions,
            meta.slot_mapping,
            meta.block_tables,
            meta.token_seq,
            c.num_attention_heads,
            self.kv_cache.block_size,
        )

    def __call__(self, layer: int, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        params, c = self.layers[layer], self.config
        assert self._step_args is not None, "begin_step first"
        if self.qk_norm is not None:
            self.qk_norm(layer, qkv, params)
        k, v, k_scales, v_scales, cos_sin = self._layer_args[layer]
        positions, slots, block_tables, token_seq, num_heads, block_size = self._step_args
        return kernels.paged_attention(
            qkv,
            k,
            v,
            k_scales,
            v_scales,
            cos_sin,
            positions,
            slots,
            block_tables,
            token_seq,
            num_heads,
            block_size,
            params.window or 0,
            meta.max_context_len,
            attention_scale(c),
            c.attn_logit_softcapping or 0.0,
        )

    def plan_binding(self) -> tuple[Any, ...] | None:
        """DecoderPlan.bind_attention's arguments, so the fused decoder runs whole steps in one call; None for
        a model with q/k norms, whose layers' attention stays a call each (its norms are torch ops)."""
        if self.qk_norm is not None:
            return None
        c = self.config
        k, v, k_scales, v_scales, cos_sin = (list(column) for column in zip(*self._layer_args, strict=True))
        return (
            k,
            v,
            k_scales,
            v_scales,
            cos_sin,
            [params.window or 0 for params in self.layers],
            c.num_attention_heads,
            self.kv_cache.block_size,
            attention_scale(c),
            c.attn_logit_softcapping or 0.0,
        )


def attention_scale(config: ModelConfig) -> float:
    return config.attention_scale if config.attention_scale is not None else config.head_dim**-0.5


class TorchAttention:
    """Any device and dtype: gathers each sequence's K/V blocks (dequantized when the cache is int8) into a
    padded batch for one SDPA call (or, with soft-capping, the same attention written out)."""

    def __init__(self, kv_cache: KVCache, config: ModelConfig, layers: Sequence[LayerAttention]) -> None:
        self.kv_cache = kv_cache
        self.config = config
        self.layers = list(layers)
        self.qk_norm = _QKNorm(config, self.layers) if config.qk_norm else None

    def begin_step(self, meta: AttentionMetadata) -> None:
        pass

    def __call__(self, layer: int, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        c, tokens, params = self.config, meta.num_tokens, self.layers[layer]
        heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        assert meta.padded is not None, "TorchAttention needs AttentionMetadata built with padded=True"
        padded = meta.padded
        if self.qk_norm is not None:
            self.qk_norm(layer, qkv, params)
        cos_sin = params.cos_sin[meta.positions].to(qkv.dtype)[:, None, :]  # [T, 1, D]
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
        mask = padded.masks[params.window]
        args = (queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask)
        if c.attn_logit_softcapping:
            out = _softcapped_attention(*args, attention_scale(c), c.attn_logit_softcapping)
        else:
            out = F.scaled_dot_product_attention(
                *args[:3], attn_mask=mask, enable_gqa=kv_heads != heads, scale=attention_scale(c)
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


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """Gemma 2's eager attention: scores = cap * tanh(scale * q . k / cap), masked, softmax in fp32.
    q [S, H, Q, D]; k, v [S, KV, K, D]; mask [S, 1, Q, K] -> [S, H, Q, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * scale / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
