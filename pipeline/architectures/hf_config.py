"""A Hugging Face config.json -> the runtime's `pretrained_config` (pipeline.runtime.engine_config.ModelConfig).

Each supported architecture reads the keys its HF model class reads, with that class's defaults (the HF config
class fills them in, so derived values such as Qwen2's or Gemma's `layer_types` come out as transformers
computes them). A key that changes the model's math but that the architecture's HF class would ignore, such
as a Granite multiplier in a config relabelled as Llama, is refused rather than built wrong."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pipeline.architectures import SUPPORTED_ARCHITECTURES
from pipeline.errors import UnsupportedModelError
from pipeline.runtime.model_config import ROPE_TYPES, hf_rope, rope_type

# The HF model_type of each architecture (config.json's own `model_type` wins when present).
MODEL_TYPES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite",
    "SmolLM3ForCausalLM": "smollm3",
}

# Config keys that change a model's output, with the value that leaves it unchanged, and the architectures
# whose HF class reads them. Present with another value under any other architecture: refused.
MATH_KEYS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "attention_bias": (False, ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GraniteForCausalLM",
                               "SmolLM3ForCausalLM", "Olmo2ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")),
    "mlp_bias": (False, ("LlamaForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM")),
    "embedding_multiplier": (1.0, ("GraniteForCausalLM",)),
    "residual_multiplier": (1.0, ("GraniteForCausalLM",)),
    "logits_scaling": (1.0, ("GraniteForCausalLM",)),
    "attention_multiplier": (None, ("GraniteForCausalLM",)),
    "no_rope_layers": (None, ("SmolLM3ForCausalLM",)),
    "query_pre_attn_scalar": (None, ("Gemma2ForCausalLM", "Gemma3ForCausalLM")),
    "attn_logit_softcapping": (None, ("Gemma2ForCausalLM", "Gemma3ForCausalLM")),
    "final_logit_softcapping": (None, ("Gemma2ForCausalLM", "Gemma3ForCausalLM")),
    "partial_rotary_factor": (1.0, ("Phi3ForCausalLM",)),
    "use_sliding_window": (False, ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "SmolLM3ForCausalLM")),
    # transformers aliases the two names to each other in both MoE configs
    "num_local_experts": (None, ("MixtralForCausalLM", "Qwen3MoeForCausalLM")),
    "num_experts": (None, ("MixtralForCausalLM", "Qwen3MoeForCausalLM")),
    "sliding_window": (None, ("MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                              "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                              "SmolLM3ForCausalLM")),
    "use_bidirectional_attention": (False, ("Gemma3ForCausalLM",)),
}  # fmt: skip


def architecture_of(hf: dict[str, Any]) -> str:
    architecture = str((hf.get("architectures") or ["?"])[0])
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {architecture} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def check_hf_config(hf: dict[str, Any]) -> str:
    """The architecture of config.json `hf`, after refusing a config whose math-changing keys its
    architecture would ignore (any backend builds such a checkpoint wrong). Reads only the dict."""
    architecture = architecture_of(hf)
    foreign = [
        f"{key}={hf[key]!r}"
        for key, (neutral, readers) in MATH_KEYS.items()
        if key in hf and architecture not in readers and not _neutral(hf[key], neutral)
    ]
    if foreign:
        raise UnsupportedModelError(
            f"{architecture} config.json sets {', '.join(foreign)}, which {architecture} does not read: building "
            "it would ignore them and give wrong tokens (is `architectures` right?)"
        )
    return architecture


def _check_rope_types(hf: dict[str, Any]) -> None:
    for kind in _rope_types(hf):
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {kind!r} is not implemented by the torch runtime; supported: {', '.join(ROPE_TYPES)}"
            )


def _neutral(value: Any, neutral: Any) -> bool:
    if value is None or value == neutral:
        return True
    if isinstance(value, list):  # no_rope_layers: all ones = RoPE everywhere
        return all(v == 1 for v in value)
    return False


def _rope_types(hf: dict[str, Any]) -> list[str]:
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and all(isinstance(v, dict) for v in params.values()) and params:
        return [rope_type(v) for v in params.values()]  # per layer type (Gemma 3)
    return [rope_type(hf_rope(hf)[1])]


def pretrained_config_from_hf(hf: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The runtime's pretrained_config for HF config.json `hf`, weights stored in `dtype`."""
    architecture = check_hf_config(hf)
    _check_rope_types(hf)
    config = _hf_config_object(hf, architecture)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    # From the config object, not the raw file: unset RoPE keys take the class's defaults (Mixtral's base 1e6,
    # SmolLM3's 2e6) and transformers 5 has already merged top-level keys into rope_parameters.
    base, scaling = hf_rope(config.to_dict())
    pretrained: dict[str, Any] = {
        "architecture": architecture,
        "dtype": dtype,
        "vocab_size": int(config.vocab_size),
        "hidden_size": int(config.hidden_size),
        "num_hidden_layers": int(config.num_hidden_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": head_dim,
        "intermediate_size": int(config.intermediate_size),
        "max_position_embeddings": int(config.max_position_embeddings),
        "norm_epsilon": float(getattr(config, "rms_norm_eps", 1e-6)),
        "hidden_act": str(
            getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        ),
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": base,
        "rotary_scaling": scaling,
        "qkv_bias": bool(getattr(config, "attention_bias", False)),
        "dense_bias": bool(getattr(config, "attention_bias", False)),
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "sliding_window": None,
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {
            "quant_algo": None,
            "kv_cache_quant_algo": None,
            "group_size": 128,
            "has_zero_point": False,
            "pre_quant_scale": False,
            "exclude_modules": None,
        },
    }
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModelError(
            f"{architecture} checkpoint uses mlp_bias=true, which the torch runtime lacks"
        )
    FAMILY_READERS.get(architecture, _windowed)(config, pretrained)
    if pretrained["hidden_act"] not in ("silu", "gelu_pytorch_tanh"):
        raise UnsupportedModelError(
            f"{architecture} checkpoint uses hidden_act={pretrained['hidden_act']!r}; the torch runtime has "
            "silu (SwiGLU) and gelu_pytorch_tanh (GeGLU)"
        )
    return pretrained


def _hf_config_object(hf: dict[str, Any], architecture: str) -> Any:
    """transformers' config class for `hf`, so unset keys take the defaults the HF model would use."""
    from transformers import AutoConfig

    values = {k: v for k, v in hf.items() if k not in ("model_type", "architectures", "auto_map")}
    return AutoConfig.for_model(str(hf.get("model_type") or MODEL_TYPES[architecture]), **values)


def _layer_types(config: Any) -> list[str] | None:
    types = getattr(config, "layer_types", None)
    return [str(t) for t in types] if types else None


def _windowed(config: Any, pretrained: dict[str, Any]) -> None:
    """Sliding windows as the HF class applies them: on the layers `layer_types` names (Qwen2/3, SmolLM3,
    Gemma), else on every layer (Mistral, Mixtral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    types = _layer_types(config)
    if types is not None and "sliding_attention" not in types:
        window = None
    if window is None:
        types = None
    pretrained["sliding_window"] = int(window) if window else None
    pretrained["layer_types"] = types


def _qwen2(config: Any, pretrained: dict[str, Any]) -> None:
    _windowed(config, pretrained)
    pretrained["qkv_bias"], pretrained["dense_bias"] = True, False


def _qwen3(config: Any, pretrained: dict[str, Any]) -> None:
    _windowed(config, pretrained)
    pretrained["qk_norm"] = "per_head"


def _qwen3_moe(config: Any, pretrained: dict[str, Any]) -> None:
    _qwen3(config, pretrained)
    num_layers = pretrained["num_hidden_layers"]
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only_dense = set(getattr(config, "mlp_only_layers", None) or [])
    pretrained.update(
        num_experts=int(config.num_experts),
        num_experts_per_tok=int(config.num_experts_per_tok),
        moe_intermediate_size=int(config.moe_intermediate_size),
        normalize_top_k=bool(getattr(config, "norm_topk_prob", False)),
        dense_layers=[i for i in range(num_layers) if i in only_dense or (i + 1) % step != 0],
    )


def _mixtral(config: Any, pretrained: dict[str, Any]) -> None:
    _windowed(config, pretrained)
    pretrained.update(
        num_experts=int(config.num_local_experts),
        num_experts_per_tok=int(config.num_experts_per_tok),
        moe_intermediate_size=pretrained["intermediate_size"],
        normalize_top_k=True,
        dense_layers=[],
    )


def _gemma(config: Any, pretrained: dict[str, Any]) -> None:
    """Gemma 2 and 3: four norms per layer (their (1 + w) scales are folded into the weights at convert),
    embeddings scaled by sqrt(hidden), a query scale of its own, optional soft-capping."""
    _windowed(config, pretrained)
    scalar = getattr(config, "query_pre_attn_scalar", None)
    pretrained.update(
        norm_layout="sandwich",
        attention_scale=float(scalar) ** -0.5 if scalar else None,
        attn_logit_softcapping=_optional_float(getattr(config, "attn_logit_softcapping", None)),
        final_logit_softcapping=_optional_float(getattr(config, "final_logit_softcapping", None)),
        embedding_multiplier=float(math.sqrt(pretrained["hidden_size"])),
    )


def _gemma3(config: Any, pretrained: dict[str, Any]) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "Gemma3ForCausalLM checkpoint uses use_bidirectional_attention=true (an embedding model, not a causal "
            "LM); the torch runtime attends causally"
        )
    _gemma(config, pretrained)
    pretrained["qk_norm"] = "per_head"
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):  # transformers 5
        global_base, global_scaling = hf_rope({"rope_parameters": params["full_attention"]})
        local = params.get("sliding_attention") or {}
        if rope_type(local) != "default":
            raise UnsupportedModelError(f"Gemma 3 sliding layers with RoPE type {rope_type(local)!r}")
        local_base = float(local.get("rope_theta", 10000.0))
    else:  # transformers 4: rope_theta + rope_scaling for global layers, rope_local_base_freq for local ones
        global_base, global_scaling = pretrained["rotary_base"], pretrained["rotary_scaling"]
        local_base = float(getattr(config, "rope_local_base_freq", 10000.0))
    pretrained.update(rotary_base=global_base, rotary_scaling=global_scaling, local_rotary_base=local_base)


def _phi3(config: Any, pretrained: dict[str, Any]) -> None:
    _windowed(config, pretrained)
    params = getattr(config, "rope_parameters", None) or {}
    factor = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
    rotary_dim = int(pretrained["head_dim"] * factor)
    pretrained["rotary_dim"] = rotary_dim if rotary_dim != pretrained["head_dim"] else None
    scaling = pretrained["rotary_scaling"]
    if scaling is not None and "original_max_position_embeddings" not in scaling:
        original = getattr(config, "original_max_position_embeddings", None)
        if original:
            pretrained["rotary_scaling"] = {**scaling, "original_max_position_embeddings": int(original)}


def _olmo2(config: Any, pretrained: dict[str, Any]) -> None:
    pretrained.update(norm_layout="post", qk_norm="full")


def _granite(config: Any, pretrained: dict[str, Any]) -> None:
    """Granite's residual_multiplier is folded into the output projections' weights at convert; the other
    multipliers are runtime fields."""
    pretrained.update(
        attention_scale=_optional_float(getattr(config, "attention_multiplier", None)),
        embedding_multiplier=_optional_float(getattr(config, "embedding_multiplier", None)),
        logits_scaling=_optional_float(getattr(config, "logits_scaling", None)),
    )


def _smollm3(config: Any, pretrained: dict[str, Any]) -> None:
    _windowed(config, pretrained)
    flags = getattr(config, "no_rope_layers", None) or []
    nope = [i for i, uses_rope in enumerate(flags) if not uses_rope]
    pretrained["nope_layers"] = nope or None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


FAMILY_READERS: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "MixtralForCausalLM": _mixtral,
    "Gemma2ForCausalLM": _gemma,
    "Gemma3ForCausalLM": _gemma3,
    "Phi3ForCausalLM": _phi3,
    "Olmo2ForCausalLM": _olmo2,
    "GraniteForCausalLM": _granite,
    "SmolLM3ForCausalLM": _smollm3,
}
