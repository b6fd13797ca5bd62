"""The paged attention kernel's logit soft-capping equals Hugging Face Gemma 2's eager attention,
scores = tanh(scale * q . k / softcap) * softcap before the mask and softmax, over a mixed batch (a fresh
prompt, a chunk after cached context, decodes) with GQA, a window and every cache format.

The reference attends with the kernel's own rotated queries and cache contents (its RoPE and K/V writes are
checked against torch in tests/integration/test_parity.py), so what is compared is the attention itself."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.engine_config import model_config_from_dict
from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.worker.attn_metadata import SequenceChunk, build_attention_metadata
from pipeline.runtime.worker.kv_cache import KVCache

pytestmark = pytest.mark.skipif(
    not kernels.kernels_available(), reason=f"kernels unavailable: {kernels.kernels_unavailable_reason()}"
)
HEADS, KV_HEADS, BLOCK, NUM_BLOCKS, MAX_POS = 6, 2, 4, 64, 64


def cos_sin(head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(MAX_POS, dtype=torch.float32)[:, None] * inv_freq
    return torch.cat((angles.cos(), angles.sin()), dim=1)


def gemma2_attention(q, k, v, scale, softcap, mask):
    """HF Gemma 2's eager attention for one token: q [H, D], k/v [KV, n, D], mask [n] (True = attend)."""
    k, v = (t.repeat_interleave(q.shape[0] // k.shape[0], dim=0) for t in (k, v))
    w = (q[:, None, :] @ k.transpose(1, 2)) * scale
    if softcap:
        w = w / softcap
        w = torch.tanh(w)
        w = w * softcap
    w = w.masked_fill(~mask, float("-inf"))
    return (torch.softmax(w, dim=-1, dtype=q.dtype) @ v).reshape(-1)


def cached(cache: KVCache, part: int, dtype: torch.dtype) -> torch.Tensor:
    """The layer's K (part 0) or V (1) as [slots, KV, D] floats, dequantized when int8."""
    values = cache.storage[0, part].to(dtype)
    return values if cache.scales is None else values * cache.scales[0, part][..., None].to(dtype)


def run(head_dim: int, window: int | None, cache_format: str, softcap: float, kv_heads: int = KV_HEADS):
    """(kernel output, reference in fp32, reference in fp64) for one layer over the mixed batch."""
    config = model_config_from_dict(
        {
            "architecture": "Gemma2ForCausalLM", "dtype": "float32", "vocab_size": 10, "hidden_size": 48,
            "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "intermediate_size": 8, "max_position_embeddings": MAX_POS,
            "norm_epsilon": 1e-6, "hidden_act": "gelu_pytorch_tanh",
        }
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    chunks = [
        SequenceChunk(0, 13, tables[0:4]),
        SequenceChunk(9, 7, tables[4:8]),
        SequenceChunk(30, 1, tables[8:16]),
        SequenceChunk(3, 1, tables[16:17]),
    ]
    int8 = cache_format == "int8"
    dtype = torch.bfloat16 if cache_format == "bf16" else torch.float32
    cache = KVCache(config, NUM_BLOCKS, BLOCK, dtype, torch.device("cpu"), zero=True, int8=int8)
    cache.storage.copy_(
        (torch.randn(cache.storage.shape, generator=gen) * (40 if int8 else 1)).clamp(-127, 127)
    )
    if cache.scales is not None:
        cache.scales.copy_(torch.rand(cache.scales.shape, generator=gen) / 40)
    meta = build_attention_metadata(chunks, BLOCK, torch.device("cpu"))
    # Large queries: scores of tens, so a small cap saturates tanh and a large one leaves it near-linear.
    qkv = torch.randn(meta.num_tokens, (HEADS + 2 * kv_heads) * head_dim, generator=gen) * 4
    scale = head_dim**-0.5
    out = kernels.paged_attention(
        qkv, cache.k[0], cache.v[0], cache.k_scales[0], cache.v_scales[0], cos_sin(head_dim), meta.positions,
        meta.slot_mapping, meta.block_tables, meta.token_seq, HEADS, BLOCK, window or 0, meta.max_context_len,
        scale, softcap,
    )  # fmt: skip
    refs = []
    for ref_dtype in (torch.float32, torch.float64):
        keys, values = cached(cache, 0, ref_dtype), cached(cache, 1, ref_dtype)
        rows = []
        for t in range(meta.num_tokens):
            pos = int(meta.positions[t])
            table = meta.block_tables[int(meta.token_seq[t])].long()
            slots = table[torch.arange(pos + 1) // BLOCK] * BLOCK + torch.arange(pos + 1) % BLOCK
            mask = torch.arange(pos + 1) > pos - window if window else torch.ones(pos + 1, dtype=torch.bool)
            q = qkv[t, : HEADS * head_dim].view(HEADS, head_dim).to(ref_dtype)
            k, v = (c[slots].transpose(0, 1) for c in (keys, values))
            rows.append(gemma2_attention(q, k, v, scale, softcap, mask))
        refs.append(torch.stack(rows))
    return out, *refs


@pytest.mark.parametrize("cache_format", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("head_dim", [16, 128, 256])
@pytest.mark.parametrize("softcap", [0.0, 3.0, 50.0])
def test_softcapped_attention_matches_gemma2(
    softcap: float, head_dim: int, window: int | None, cache_format: str
):
    out, ref, exact = run(head_dim, window, cache_format, softcap)
    # The kernel is as close to the exact (fp64) result as torch's fp32 eager attention is: ~1e-6 of the
    # output, from scores of tens rounded to fp32.
    assert (out.double() - exact).abs().max() <= 2e-6 * exact.abs().max()
    assert (out - ref).abs().max() <= 4e-6 * ref.abs().max()


@pytest.mark.parametrize("cache_format", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("head_dim", [64, 192])
@pytest.mark.parametrize("kv_heads", [HEADS, 1])
def test_attention_matches_for_other_group_sizes(kv_heads: int, head_dim: int, cache_format: str) -> None:
    """One query head per kv head (no grouping) and six (a group larger than the kernel takes at once)."""
    out, ref, exact = run(head_dim, None, cache_format, 0.0, kv_heads)
    assert (out.double() - exact).abs().max() <= 2e-6 * exact.abs().max()
    assert (out - ref).abs().max() <= 4e-6 * ref.abs().max()


def test_softcap_changes_the_result_and_zero_is_none() -> None:
    """A cap that binds moves the output; 0 is exactly the uncapped kernel."""
    capped, _, _ = run(16, None, "fp32", 3.0)
    plain, _, _ = run(16, None, "fp32", 0.0)
    assert (capped - plain).abs().max() > 0.1
    gen = torch.Generator().manual_seed(5)
    args = dict(
        k_scales=None, v_scales=None, cos_sin=cos_sin(16), positions=torch.tensor([0]),
        slots=torch.tensor([0]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
        token_seq=torch.zeros(1, dtype=torch.int32), num_heads=HEADS, block_size=BLOCK, window=0, max_context=1,
        scale=0.25,
    )  # fmt: skip
    qkv = torch.randn(1, (HEADS + 2 * KV_HEADS) * 16, generator=gen)
    caches = [torch.zeros(BLOCK, KV_HEADS, 16) for _ in range(4)]
    default = kernels.paged_attention(qkv.clone(), caches[0], caches[1], **args)  # type: ignore[arg-type]
    zero = kernels.paged_attention(qkv.clone(), caches[2], caches[3], **args, softcap=0.0)  # type: ignore[arg-type]
    assert torch.equal(default, zero)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        kernels.paged_attention(qkv.clone(), caches[0], caches[1], **args, softcap=-1.0)  # type: ignore[arg-type]
