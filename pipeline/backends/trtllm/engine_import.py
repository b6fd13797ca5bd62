"""Bring your own engine: take a folder `trtllm-build` already wrote as the engine stage's output.

The folder is checked as TensorRT-LLM writes it (NVIDIA/TensorRT-LLM:tensorrt_llm/builder.py@008b2b8:
`Engine.save` writes `config.json` on rank 0 and `rank{r}.engine` per rank, plus
`rank{r}_managed_weights.safetensors` when weights are managed and `quant_cfg.json` for mixed precision;
`EngineConfig.to_dict` gives config.json its three keys `version`, `pretrained_config` (architecture, dtype,
mapping, quantization) and `build_config` (`BuildConfig.to_dict`: the shape limits, `kv_cache_type` by name,
`max_draft_len`, `plugin_config`)), then against the build config: the config must describe the engine it
packages, since its engine / kv_cache / scheduler sections become the Triton parameters and the limits the
preprocessing model enforces. The files are hard-linked (copied across file systems) into the engine stage's
folder with the tokenizer of the config's checkpoint, as a build would leave them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pipeline.backends.trtllm import env
from pipeline.backends.trtllm.build_cmd import (
    engine_draft_len,
    engine_max_num_tokens,
    engine_max_seq_len,
    paged_context_fmha,
)
from pipeline.backends.trtllm.versions import PINNED, PINNED_CONTAINER, RELEASES, release_for_runtime
from pipeline.config.build_config import BuildConfig
from pipeline.errors import ConfigError, MissingArtifactError, PipelineError, UnsupportedModelError
from pipeline.runtime.engine_config import TOKENIZER_DIR
from pipeline.sources.local import TOKENIZER_SOURCES
from pipeline.sources.tokenizer import copy_tokenizer
from pipeline.util.files import link_or_copy, read_json_object

ENGINE_CONFIG = "config.json"
_RANK_FILE = re.compile(r"^rank(\d+)\.engine$")
_COMPUTE_CAPABILITY = re.compile(r"^\d+\.\d+$")
# Files Engine.save may write besides config.json and the rank engines, carried along when present.
_OPTIONAL_FILES = ("quant_cfg.json",)
_REBUILD_HINT = f"Rebuild it with trtllm-build of TensorRT-LLM {PINNED} (the container {PINNED_CONTAINER})."


@dataclass(frozen=True)
class EngineFolder:
    """A checked trtllm-build output folder."""

    path: Path
    config: dict[str, Any]  # config.json as parsed
    version: str  # config.json `version`: the TensorRT-LLM that built it
    tp_size: int
    pp_size: int
    files: tuple[str, ...]  # what the runtime reads, relative to `path`

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def pretrained(self) -> dict[str, Any]:
        return dict(self.config["pretrained_config"])

    @property
    def build(self) -> dict[str, Any]:
        return dict(self.config["build_config"])


def _read_config(path: Path) -> dict[str, Any]:
    config_path = path / ENGINE_CONFIG
    if not path.is_dir():
        raise MissingArtifactError(f"--engine-dir {path} is not a folder")
    if not config_path.is_file():
        raise MissingArtifactError(
            f"{path} has no {ENGINE_CONFIG}: not a trtllm-build output folder",
            hint="Pass the folder given to trtllm-build as --output_dir.",
        )
    config = read_json_object(config_path)
    if "builder_config" in config and "build_config" not in config:
        raise UnsupportedModelError(
            f"{config_path} has the layout of engines from before TensorRT-LLM 0.8 (builder_config)",
            hint=_REBUILD_HINT,
        )
    return config


def _field(config: dict[str, Any], dotted: str, kind: type, config_path: Path) -> Any:
    node: Any = config
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            raise UnsupportedModelError(
                f"{config_path} has no {dotted}: not written by trtllm-build", hint=_REBUILD_HINT
            )
        node = node[key]
    if not isinstance(node, kind) or (isinstance(node, bool) and kind is int):
        raise UnsupportedModelError(f"{config_path}: {dotted}={node!r} is not a {kind.__name__}")
    return node


_REQUIRED: tuple[tuple[str, type], ...] = (
    ("version", str),
    ("pretrained_config.architecture", str),
    ("pretrained_config.dtype", str),
    ("pretrained_config.mapping.tp_size", int),
    ("pretrained_config.mapping.pp_size", int),
    ("build_config.max_batch_size", int),
    ("build_config.max_input_len", int),
    ("build_config.max_seq_len", int),
    ("build_config.max_num_tokens", int),
    ("build_config.plugin_config", dict),
)


def read_engine_folder(path: Path) -> EngineFolder:
    """Check `path` as a trtllm-build output folder; a PipelineError naming what is wrong otherwise."""
    path = Path(path)
    config = _read_config(path)
    config_path = path / ENGINE_CONFIG
    for dotted, kind in _REQUIRED:
        _field(config, dotted, kind, config_path)
    mapping = config["pretrained_config"]["mapping"]
    tp, pp = mapping["tp_size"], mapping["pp_size"]
    world = mapping.get("world_size", tp * pp)
    if world != tp * pp:
        raise UnsupportedModelError(
            f"{config_path}: mapping.world_size={world} is not tp_size*pp_size={tp * pp} (context "
            "parallelism, which llmpipe does not configure)"
        )
    ranks = sorted(int(m.group(1)) for p in path.iterdir() if (m := _RANK_FILE.match(p.name)))
    if ranks != list(range(world)):
        expected = ", ".join(f"rank{r}.engine" for r in range(world))
        found = ", ".join(f"rank{r}.engine" for r in ranks) or "none"
        raise MissingArtifactError(
            f"{path}: mapping.world_size={world} needs {expected}; the folder holds {found}",
            hint="Copy every rank's engine file, or pass the folder trtllm-build wrote them into.",
        )
    files = [ENGINE_CONFIG, *(f"rank{r}.engine" for r in ranks)]
    files += [f"rank{r}_managed_weights.safetensors" for r in ranks]
    files += list(_OPTIONAL_FILES)
    present = tuple(name for name in files if (path / name).is_file())
    return EngineFolder(path.resolve(), config, config["version"], tp, pp, present)


def _paged_kv(build: dict[str, Any]) -> bool:
    kv_type = build.get("kv_cache_type")
    if kv_type is not None:
        return str(kv_type).upper() == "PAGED"
    return bool(build["plugin_config"].get("paged_kv_cache"))


class _Pair(NamedTuple):
    """One thing the build config states that the engine fixed at build time."""

    field: str
    value: Any
    engine_field: str
    engine_value: Any
    expected: Any  # what engine_value must be for `value`

    @property
    def differs(self) -> bool:
        return bool(self.engine_value != self.expected)


def _pairs(cfg: BuildConfig, engine: EngineFolder) -> list[_Pair]:
    """What the engine must record for `cfg`, computed as for llmpipe's own trtllm-build command (a
    speculative build raises max_seq_len and max_num_tokens; some KV formats turn paged context FMHA off)."""
    build, plugin, pretrained = engine.build, engine.build["plugin_config"], engine.pretrained
    quant, q, e = pretrained.get("quantization") or {}, cfg.quantization, cfg.engine
    drafts = engine_draft_len(cfg)
    with_drafts = f" + max_draft_len ({{}} + {drafts})" if drafts else ""
    pairs = [
        _Pair("parallel.tp_size", cfg.parallel.tp_size, "mapping.tp_size", engine.tp_size, cfg.parallel.tp_size),
        _Pair("parallel.pp_size", cfg.parallel.pp_size, "mapping.pp_size", engine.pp_size, cfg.parallel.pp_size),
        _Pair("engine.max_batch_size", e.max_batch_size, "build_config.max_batch_size", build["max_batch_size"],
              e.max_batch_size),
        _Pair("engine.max_input_len", e.max_input_len, "build_config.max_input_len", build["max_input_len"],
              e.max_input_len),
        _Pair("engine.max_seq_len" + with_drafts.format(e.max_seq_len), engine_max_seq_len(cfg),
              "build_config.max_seq_len", build["max_seq_len"], engine_max_seq_len(cfg)),
        _Pair("engine.max_num_tokens", engine_max_num_tokens(cfg), "build_config.max_num_tokens",
              build["max_num_tokens"], engine_max_num_tokens(cfg)),
        _Pair("engine.max_beam_width", e.max_beam_width, "build_config.max_beam_width",
              build.get("max_beam_width", 1), e.max_beam_width),
        _Pair("kv_cache.tokens_per_block", cfg.kv_cache.tokens_per_block, "plugin_config.tokens_per_block",
              plugin.get("tokens_per_block"), cfg.kv_cache.tokens_per_block),
        _Pair("kv_cache.use_paged_context_fmha", paged_context_fmha(cfg), "plugin_config.use_paged_context_fmha",
              bool(plugin.get("use_paged_context_fmha")), paged_context_fmha(cfg)),
        _Pair(f"speculative.mode={cfg.speculative.mode} max_draft_len", drafts, "build_config.max_draft_len",
              int(build.get("max_draft_len") or 0), drafts),
        _Pair("quantization.mode", q.mode, "quantization.quant_algo", quant.get("quant_algo"), q.quant_algo),
        _Pair("quantization.kv_cache_dtype", q.kv_cache_dtype, "quantization.kv_cache_quant_algo",
              quant.get("kv_cache_quant_algo"), q.kv_cache_quant_algo),
    ]  # fmt: skip
    if cfg.dtype != "auto":
        pairs.append(_Pair("dtype", cfg.dtype, "pretrained_config.dtype", pretrained["dtype"], cfg.dtype))
    return pairs


def check_engine_matches(cfg: BuildConfig, engine: EngineFolder) -> None:
    """Refuse an engine the build config does not describe, naming every field on both sides."""
    where = f"the engine in {engine.path}"
    if cfg.backend != "trtllm":
        raise ConfigError(
            f"backend={cfg.backend}, but {where} was built by trtllm-build",
            hint="Set `backend: trtllm` in the build config.",
        )
    for what, on in (("a paged KV cache (--kv_cache_type paged)", _paged_kv(engine.build)),
                     ("packed inputs (--remove_input_padding enable)",
                      bool(engine.build["plugin_config"].get("remove_input_padding")))):  # fmt: skip
        if not on:
            # Triton's in-flight batching runs only on such engines (tensorrtllm_backend README@v0.18.0;
            # https://nvidia.github.io/TensorRT-LLM/features/paged-attention-ifb-scheduler.html).
            raise ConfigError(
                f"{where} was built without {what}, which in-flight batching needs", hint=_REBUILD_HINT
            )
    wrong = [p for p in _pairs(cfg, engine) if p.differs]
    if wrong:
        found = "; ".join(
            f"{p.field}={p.value} but the engine has {p.engine_field}={p.engine_value}" for p in wrong
        )
        raise ConfigError(
            f"the build config does not describe {where}: {found}",
            hint="Make the config state what the engine was built with (they become the Triton parameters), "
            "e.g. with --set engine.max_seq_len=<the engine's>.",
        )


def _compute_capability(given: str | None) -> tuple[str, str]:
    """(the GPU compute capability the engine was built for, where that came from)."""
    if given is not None:
        if not _COMPUTE_CAPABILITY.match(given):
            raise ConfigError(f"--compute-capability {given!r} is not MAJOR.MINOR (e.g. 9.0 for H100)")
        return given, "--compute-capability"
    found = env.gpus().value
    if not found:
        raise ConfigError(
            "cannot tell which GPU architecture the engine was built for: config.json does not record it "
            "and this machine has no NVIDIA GPU",
            hint="Pass --compute-capability of the GPU that ran trtllm-build "
            "(`nvidia-smi --query-gpu=compute_cap --format=csv`).",
        )
    return found[0].compute_capability, f"this machine's GPU 0 ({found[0].name})"


def import_engine(
    cfg: BuildConfig, engine_dir: Path, hf_dir: Path, out_dir: Path, compute_capability: str | None
) -> dict[str, Any]:
    """Check `engine_dir` against `cfg`, link it into `out_dir` with `hf_dir`'s tokenizer; the manifest facts.

    `compute_capability` is the GPU architecture it was built for (None: this machine's GPU), which the
    serve-time guards compare with the GPUs that will run it.
    """
    engine = read_engine_folder(engine_dir)
    try:
        release = release_for_runtime(engine.version)
    except PipelineError:
        raise UnsupportedModelError(
            f"{engine.path / ENGINE_CONFIG}: version={engine.version}; llmpipe serves engines of TensorRT-LLM "
            f"{', '.join(RELEASES)}",
            hint=_REBUILD_HINT,
        ) from None
    check_engine_matches(cfg, engine)
    capability, capability_from = _compute_capability(compute_capability)
    for name in engine.files:
        link_or_copy(engine.path / name, out_dir / name)
    tokenizer_files = copy_tokenizer(hf_dir, out_dir / TOKENIZER_DIR)
    if not any(all(name in tokenizer_files for name in source) for source in TOKENIZER_SOURCES):
        raise MissingArtifactError(f"{hf_dir} has no tokenizer files for the engine's repository")
    return {
        "imported_from": str(engine.path),
        "release": release.version,
        "tensorrt_llm_version": engine.version,
        "engine_version": engine.version,
        "tensorrt_version": None,  # config.json does not record it
        "gpu_compute_capability": capability,
        "gpu_compute_capability_from": capability_from,
        "world_size": engine.world_size,
        "architecture": engine.pretrained["architecture"],
        "dtype": engine.pretrained["dtype"],
        "engine_files": list(engine.files),
        "tokenizer_files": tokenizer_files,
    }


def engine_data_files(engine_dir: Path) -> dict[str, Path]:
    """The files of `engine_dir` an import reads, whose digests key its reuse (editing one redoes it)."""
    return {f"engine/{name}": engine_dir / name for name in read_engine_folder(engine_dir).files}
