"""RoPE tables: per layer a [max_positions, head_dim] table of cos (first half) and sin (second half),
computed as transformers computes them, for every RoPE type and layer kind the runtime implements."""

from __future__ import annotations

import math
from typing import Any

import torch

from pipeline.errors import UnsupportedModelError
from pipeline.runtime.model_config import ROPE_TYPES, ModelConfig, rope_type


def rotary_inv_freq(
    dim: int, base: float, scaling: dict[str, Any] | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] of the rotated channels and the factor cos/sin are scaled by, computed
    as transformers does so the tables match it bit for bit."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (base**exponents)
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor") or max_position_embeddings / original
    if kind == "yarn":
        return _yarn(dim, base, scaling, float(factor), original)
    if kind == "longrope":
        # The short factors: the runtime is limited to original_max_position_embeddings (convert checks).
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (short * base**exponents), float(attention)
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


def _yarn(
    dim: int, base: float, scaling: dict[str, Any], factor: float, original: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated frequencies (divided by `factor`) for the long wavelengths, the original ones for
    the short, a linear ramp between, and cos/sin scaled up by the attention factor."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def rotary_cos_sin(config: ModelConfig, max_positions: int, local: bool = False) -> torch.Tensor:
    """[max_positions, head_dim]: cos(pos * inv_freq) in the first half, sin in the second (fp32), scaled by
    the RoPE type's attention factor. `local`: the sliding layers' RoPE (Gemma 3's local base, no scaling).
    Partial rotary (rotary_dim < head_dim): the frequencies past rotary_dim / 2 are zero, an identity that
    leaves the passed-through channels as they are (convert orders the channels so)."""
    d = config.head_dim
    rotary_dim = config.rotary_dim or d
    if local and config.local_rotary_base is not None:
        inv_freq, factor = rotary_inv_freq(
            rotary_dim, config.local_rotary_base, None, config.max_position_embeddings
        )
    else:
        inv_freq, factor = rotary_inv_freq(
            rotary_dim, config.rotary_base, config.rotary_scaling, config.max_position_embeddings
        )
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    passed = d // 2 - inv_freq.shape[0]
    if passed:
        cos = torch.cat((cos, cos.new_ones(max_positions, passed)), dim=1)
        sin = torch.cat((sin, sin.new_zeros(max_positions, passed)), dim=1)
    return torch.cat((cos, sin), dim=-1).contiguous()


def identity_cos_sin(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """The table of a layer without RoPE (SmolLM3's NoPE layers): cos 1, sin 0, so rotating is a no-op."""
    half = config.head_dim // 2
    return torch.cat((torch.ones(max_positions, half), torch.zeros(max_positions, half)), dim=-1)


def layer_cos_sin(config: ModelConfig, max_positions: int) -> list[torch.Tensor]:
    """Each layer's RoPE table; layers of one kind share the tensor."""
    tables: dict[str, torch.Tensor] = {}

    def table(kind: str) -> torch.Tensor:
        if kind not in tables:
            tables[kind] = (
                identity_cos_sin(config, max_positions)
                if kind == "none"
                else rotary_cos_sin(config, max_positions, local=kind == "local")
            )
        return tables[kind]

    kinds = []
    for i in range(config.num_hidden_layers):
        if i in (config.nope_layers or []):
            kinds.append("none")
        elif config.layer_window(i) is not None and config.local_rotary_base is not None:
            kinds.append("local")
        else:
            kinds.append("global")
    return [table(kind) for kind in kinds]
