"""The engine directory's config.json: TensorRT-LLM's top-level layout (`version`, `pretrained_config`,
`build_config`) plus llmpipe's `runtime_defaults`, read into typed dataclasses and validated at load so
a bad engine fails before the first request."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config.limits import length_limit_errors
from pipeline.config.vocab import SCHEDULER_POLICIES, SchedulerPolicy
from pipeline.errors import ConfigError, MissingArtifactError, UnsupportedModelError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "rank0.safetensors"
TOKENIZER_DIR = "tokenizer"

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


@dataclass(frozen=True)
class PluginConfig:
    tokens_per_block: int = 32
    paged_kv_cache: bool = True
    use_paged_context_fmha: bool = True
    remove_input_padding: bool = True
    context_fmha: bool = True


@dataclass(frozen=True)
class SpeculativeConfig:
    """`build_config.speculative_config`: how the torch runtime drafts (the mode and the draft length are
    `speculative_decoding_mode` and `max_draft_len`)."""

    ngram_min_match: int = 1  # prompt lookup: shortest suffix looked up in prompt + output
    ngram_max_match: int = 3  # longest suffix looked up
    adaptive: bool = True  # per-request draft length: shrink on rejection, grow on acceptance
    draft_engine_dir: str | None = None  # draft_tokens_external: the draft model's engine directory


@dataclass(frozen=True)
class BuildLimits:
    """`build_config`: the limits the engine was built for (trtllm-build's flags)."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    max_beam_width: int = 1
    kv_cache_type: str = "PAGED"
    max_draft_len: int = 0
    speculative_decoding_mode: str | None = None
    plugin_config: PluginConfig = field(default_factory=PluginConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)


@dataclass(frozen=True)
class RuntimeDefaults:
    """`runtime_defaults`: serving-time settings that may be overridden when the engine is loaded."""

    kv_max_tokens: int | None = None  # KV capacity in tokens; None = kv_free_memory_fraction of free memory
    kv_free_memory_fraction: float = 0.2
    enable_block_reuse: bool = False
    enable_chunked_context: bool = False
    scheduler_policy: SchedulerPolicy = "guaranteed_no_evict"


@dataclass(frozen=True)
class EngineConfig:
    version: str
    backend: str
    model: ModelConfig
    build: BuildLimits
    runtime: RuntimeDefaults
    engine_dir: Path | None = None  # where it was loaded from; not written

    @property
    def weights_path(self) -> Path:
        return self._dir() / WEIGHTS_FILE

    @property
    def tokenizer_dir(self) -> Path:
        return self._dir() / TOKENIZER_DIR

    def _dir(self) -> Path:
        if self.engine_dir is None:
            raise ValueError("this EngineConfig was not loaded from an engine directory")
        return self.engine_dir

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "backend": self.backend,
            "pretrained_config": dataclasses.asdict(self.model),
            "build_config": dataclasses.asdict(self.build),
            "runtime_defaults": dataclasses.asdict(self.runtime),
        }


def write_engine_config(engine_dir: Path, config: EngineConfig) -> Path:
    validate_engine_config(config)
    path = Path(engine_dir) / CONFIG_FILE
    path.write_text(json.dumps(config.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path


def load_engine_config(engine_dir: str | Path) -> EngineConfig:
    """Read and validate `<engine_dir>/config.json`; errors name the field and its value."""
    engine_dir = Path(engine_dir)
    path = engine_dir / CONFIG_FILE
    if not path.is_file():
        raise MissingArtifactError(
            f"{path} not found: {engine_dir} is not an engine directory",
            hint="Run `llmpipe build` first, or point at the folder that holds config.json and rank0.safetensors.",
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    config = engine_config_from_dict(data, origin=str(path))
    config = dataclasses.replace(config, engine_dir=engine_dir)
    validate_engine_config(config, origin=str(path))
    return config


def engine_config_from_dict(data: dict[str, Any], origin: str = "config.json") -> EngineConfig:
    for key in ("version", "pretrained_config", "build_config"):
        if key not in data:
            raise ConfigError(f"{origin}: missing top-level field {key!r}")
    build = dict(data["build_config"])
    model = model_config_from_dict(dict(data["pretrained_config"]), origin)
    limits = _make(
        BuildLimits,
        {
            **build,
            "plugin_config": _make(
                PluginConfig, build.get("plugin_config") or {}, f"{origin}: build_config.plugin_config"
            ),
            "speculative_config": _make(
                SpeculativeConfig,
                build.get("speculative_config") or {},
                f"{origin}: build_config.speculative_config",
            ),
        },
        f"{origin}: build_config",
    )
    runtime = _make(RuntimeDefaults, data.get("runtime_defaults") or {}, f"{origin}: runtime_defaults")
    return EngineConfig(str(data["version"]), str(data.get("backend", "torch")), model, limits, runtime)


def model_config_from_dict(pretrained: dict[str, Any], origin: str = "config.json") -> ModelConfig:
    """A checkpoint's config.json (or an engine's pretrained_config) as a ModelConfig."""
    return _make(
        ModelConfig,
        {
            **pretrained,
            "mapping": _make(
                Mapping, pretrained.get("mapping") or {}, f"{origin}: pretrained_config.mapping"
            ),
            "quantization": _make(
                QuantConfig, pretrained.get("quantization") or {}, f"{origin}: pretrained_config.quantization"
            ),
        },
        f"{origin}: pretrained_config",
    )


def _make(cls: type, values: dict[str, Any], where: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)} - {"engine_dir"}
    # Unknown keys are tolerated: TensorRT-LLM writes many plugin/build fields this runtime does not use.
    picked = {k: v for k, v in values.items() if k in known}
    try:
        return cls(**picked)
    except TypeError as err:
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in picked and _required(f))
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing) or '?'} ({err})") from None


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def validate_engine_config(config: EngineConfig, origin: str = "config.json") -> None:
    m, b, r = config.model, config.build, config.runtime
    checks: list[tuple[bool, str, object, str]] = [
        (
            config.backend == "torch",
            "backend",
            config.backend,
            "'torch' (this runtime loads torch engines only)",
        ),
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
        (b.max_beam_width == 1, "build_config.max_beam_width", b.max_beam_width, "1 (no beam search)"),
        (b.kv_cache_type == "PAGED", "build_config.kv_cache_type", b.kv_cache_type, "'PAGED'"),
        (
            r.scheduler_policy in SCHEDULER_POLICIES,
            "runtime_defaults.scheduler_policy",
            r.scheduler_policy,
            f"one of {', '.join(SCHEDULER_POLICIES)}",
        ),
        (
            0 < r.kv_free_memory_fraction <= 1,
            "runtime_defaults.kv_free_memory_fraction",
            r.kv_free_memory_fraction,
            "in (0, 1]",
        ),
        (
            b.max_seq_len <= m.max_position_embeddings,
            "build_config.max_seq_len",
            b.max_seq_len,
            f"<= pretrained_config.max_position_embeddings ({m.max_position_embeddings})",
        ),
    ]
    positive = {
        "pretrained_config.vocab_size": m.vocab_size,
        "pretrained_config.hidden_size": m.hidden_size,
        "pretrained_config.num_hidden_layers": m.num_hidden_layers,
        "pretrained_config.num_attention_heads": m.num_attention_heads,
        "pretrained_config.num_key_value_heads": m.num_key_value_heads,
        "pretrained_config.head_dim": m.head_dim,
        "pretrained_config.intermediate_size": m.intermediate_size,
        "build_config.max_batch_size": b.max_batch_size,
        "build_config.max_num_tokens": b.max_num_tokens,
        "build_config.plugin_config.tokens_per_block": b.plugin_config.tokens_per_block,
    }
    checks += [(isinstance(v, int) and v > 0, name, v, "a positive integer") for name, v in positive.items()]
    checks += [
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
        (
            1 <= b.speculative_config.ngram_min_match <= b.speculative_config.ngram_max_match,
            "build_config.speculative_config.ngram_min_match",
            b.speculative_config.ngram_min_match,
            f"in 1..ngram_max_match ({b.speculative_config.ngram_max_match})",
        ),
        (
            r.kv_max_tokens is None or r.kv_max_tokens > 0,
            "runtime_defaults.kv_max_tokens",
            r.kv_max_tokens,
            "> 0 or null",
        ),
    ]
    for ok, name, value, limit in checks:
        if not ok:
            raise ConfigError(f"{origin}: {name}={value!r} is invalid: must be {limit}")
    errors = length_limit_errors(
        max_input_len=b.max_input_len,
        max_seq_len=b.max_seq_len,
        max_num_tokens=b.max_num_tokens,
        max_batch_size=b.max_batch_size,
        enable_chunked_context=r.enable_chunked_context,
        name=lambda field: (
            f"runtime_defaults.{field}" if field == "enable_chunked_context" else f"build_config.{field}"
        ),
    )
    if errors:
        raise ConfigError(f"{origin}: {errors[0]}")
    if rope_type(m.rotary_scaling) not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{origin}: RoPE scaling {rope_type(m.rotary_scaling)!r} is not implemented by the torch runtime; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )


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
