"""The engine directory's config.json: TensorRT-LLM's top-level layout (`version`, `pretrained_config`,
`build_config`) plus llmpipe's `runtime_defaults`, read into typed dataclasses and validated at load so
a bad engine fails before the first request."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config.limits import length_limit_errors
from pipeline.config.vocab import SCHEDULER_POLICIES, SchedulerPolicy
from pipeline.errors import ConfigError, MissingArtifactError, UnsupportedModelError
from pipeline.runtime.model_config import (
    ROPE_TYPES,
    Check,
    Mapping,
    ModelConfig,
    QuantConfig,
    model_checks,
    rope_type,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "rank0.safetensors"
TOKENIZER_DIR = "tokenizer"


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
    checks: list[Check] = [
        (
            config.backend == "torch",
            "backend",
            config.backend,
            "'torch' (this runtime loads torch engines only)",
        ),
        *model_checks(m),
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
        *[
            (isinstance(v, int) and v > 0, f"build_config.{name}", v, "a positive integer")
            for name, v in (
                ("max_batch_size", b.max_batch_size),
                ("max_num_tokens", b.max_num_tokens),
                ("plugin_config.tokens_per_block", b.plugin_config.tokens_per_block),
            )
        ],
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
