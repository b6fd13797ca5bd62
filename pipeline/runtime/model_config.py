"""The model's shape and features as the engine's `pretrained_config` stores them (ModelConfig), the
checks every engine's model passes at load, and the RoPE vocabulary shared with the converters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float32", "float16", "bfloat16")
# The HF rope_type values the runtime implements (see model/layers.py: rotary_inv_freq).
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # SwiGLU, GeGLU
NORM_LAYOUTS = ("pre", "sandwich", "post")
QK_NORMS = ("per_head", "full")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class QuantConfig:
    """`pretrained_config.quantization`: the weight/KV scheme a quantized checkpoint was written with."""

    quant_algo: str | None = None  # e.g. W8A16, W4A16, W4A16_AWQ; None = dense weights
    kv_cache_quant_algo: str | None = None  # INT8 / FP8; None = KV cache in the compute dtype
    group_size: int = 128  # columns per scale for group-wise schemes
    has_zero_point: bool = False
    pre_quant_scale: bool = False  # AWQ: activations are scaled before the quantized matmul
    exclude_modules: list[str] | None = None  # runtime names kept dense (e.g. lm_head)


@dataclass(frozen=True)
class Mapping:
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1


@dataclass(frozen=True)
class ModelConfig:
    """`pretrained_config`: the model's shape, as the converted checkpoint stores it."""

    architecture: str
    dtype: str  # storage dtype of rank0.safetensors
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_epsilon: float
    hidden_act: str
    position_embedding_type: str = "rope_gpt_neox"
    rotary_base: float = 10000.0
    rotary_scaling: dict[str, Any] | None = None  # HF rope_scaling dict; None = plain RoPE
    qkv_bias: bool = False
    dense_bias: bool = False  # the attention output projection has a bias (Llama attention_bias)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # window in tokens of the sliding layers; None = full causal attention
    # Per layer "full_attention" or "sliding_attention" (HF's layer_types); None = every layer slides when
    # sliding_window is set (Mistral)
    layer_types: list[str] | None = None
    # RoPE of the sliding layers when it differs from the full ones' (Gemma 3's rope_local_base_freq):
    # base, no scaling
    local_rotary_base: float | None = None
    rotary_dim: int | None = None  # partial rotary (Phi): rotated channels per head; None = head_dim
    nope_layers: list[int] | None = None  # layers that apply no RoPE (SmolLM3's no_rope_layers == 0)
    # "pre": RMSNorm before attention and MLP (Llama); "sandwich": also after each (Gemma); "post": only
    # after each (OLMo 2)
    norm_layout: str = "pre"
    qk_norm: str | None = (
        None  # RMSNorm of q and k before RoPE: "per_head" (Qwen3, Gemma 3) or "full" (OLMo 2)
    )
    attention_scale: float | None = None  # multiplies q . k; None = head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    embedding_multiplier: float | None = None  # embeddings are scaled by it (Gemma's sqrt(hidden), Granite)
    logits_scaling: float | None = None  # logits are divided by it (Granite)
    num_experts: int = 0  # sparse MoE: experts per sparse layer; 0 = dense MLPs only
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    normalize_top_k: bool = (
        True  # renormalize the chosen experts' probabilities (Mixtral; Qwen3-MoE's norm_topk_prob)
    )
    dense_layers: list[int] | None = (
        None  # in an MoE model, the layers with a dense MLP (Qwen3-MoE mlp_only_layers)
    )
    mapping: Mapping = field(default_factory=Mapping)
    quantization: QuantConfig = field(default_factory=QuantConfig)

    def layer_window(self, layer: int) -> int | None:
        """The attention window of `layer` in tokens; None = full causal attention."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a sparse MoE block."""
        return self.num_experts > 0 and layer not in (self.dense_layers or [])

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer slides with the same one (Mistral, Phi-3); None otherwise."""
        windows = self.windows
        return windows[0] if len(windows) == 1 else None

    @property
    def windows(self) -> list[int | None]:
        """The distinct attention windows over the layers."""
        return sorted({self.layer_window(i) for i in range(self.num_hidden_layers)}, key=lambda w: w or 0)


Check = tuple[bool, str, object, str]  # (ok, field, value, what it must be)


def model_checks(m: ModelConfig) -> list[Check]:
    """Every constraint on a pretrained_config the runtime relies on, named by its field."""
    checks: list[Check] = [
        (m.dtype in DTYPES, "pretrained_config.dtype", m.dtype, f"one of {', '.join(DTYPES)}"),
        (
            m.hidden_act in HIDDEN_ACTS,
            "pretrained_config.hidden_act",
            m.hidden_act,
            f"one of {', '.join(HIDDEN_ACTS)}",
        ),
        (
            m.norm_layout in NORM_LAYOUTS,
            "pretrained_config.norm_layout",
            m.norm_layout,
            f"one of {', '.join(NORM_LAYOUTS)}",
        ),
        (
            m.qk_norm in (None, *QK_NORMS),
            "pretrained_config.qk_norm",
            m.qk_norm,
            f"null or one of {', '.join(QK_NORMS)}",
        ),
        (
            m.layer_types is None
            or (len(m.layer_types) == m.num_hidden_layers and set(m.layer_types) <= set(LAYER_TYPES)),
            "pretrained_config.layer_types",
            m.layer_types,
            f"null or one of {', '.join(LAYER_TYPES)} per layer ({m.num_hidden_layers})",
        ),
        (
            m.rotary_dim is None or (0 < m.rotary_dim <= m.head_dim and m.rotary_dim % 2 == 0),
            "pretrained_config.rotary_dim",
            m.rotary_dim,
            f"null or even and in 2..head_dim ({m.head_dim})",
        ),
        (
            m.num_experts == 0 or 0 < m.num_experts_per_tok <= m.num_experts and m.moe_intermediate_size > 0,
            "pretrained_config.num_experts_per_tok",
            m.num_experts_per_tok,
            f"in 1..num_experts ({m.num_experts}), with moe_intermediate_size > 0",
        ),
        (
            m.position_embedding_type == "rope_gpt_neox",
            "pretrained_config.position_embedding_type",
            m.position_embedding_type,
            "'rope_gpt_neox'",
        ),
        (
            m.mapping.world_size == 1,
            "pretrained_config.mapping.world_size",
            m.mapping.world_size,
            "1 (one device)",
        ),
    ]
    positive = {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_hidden_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.intermediate_size,
    }
    checks += [
        (isinstance(v, int) and v > 0, f"pretrained_config.{name}", v, "a positive integer")
        for name, v in positive.items()
    ]
    return checks + [
        (
            m.num_attention_heads % m.num_key_value_heads == 0,
            "pretrained_config.num_attention_heads",
            m.num_attention_heads,
            f"a multiple of num_key_value_heads ({m.num_key_value_heads})",
        ),
        (m.head_dim % 2 == 0, "pretrained_config.head_dim", m.head_dim, "even (RoPE rotates pairs)"),
        (
            math.isfinite(m.norm_epsilon) and m.norm_epsilon > 0,
            "pretrained_config.norm_epsilon",
            m.norm_epsilon,
            "> 0",
        ),
    ]


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The HF rope type of a rope_scaling dict (older configs name it `type`)."""
    scaling = scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def hf_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rotary_base, rotary_scaling) of an HF config.json, from transformers 5's `rope_parameters` or the
    older `rope_theta` + `rope_scaling` pair; the scaling in the older form (no rope_theta inside), None for
    plain RoPE."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        base = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        base = float(hf.get("rope_theta", 10000.0))
        scaling = dict(hf.get("rope_scaling") or {})
    return base, (scaling if scaling and rope_type(scaling) != "default" else None)
