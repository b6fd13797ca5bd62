"""Check that a local folder is a Hugging Face checkpoint llmpipe can convert, before any stage loads it.

Reads only config.json and file names: no torch, no transformers, so a bad folder fails in milliseconds
with a message that says what to fix."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.architectures import SUPPORTED_ARCHITECTURES
from pipeline.architectures.hf_config import check_hf_config
from pipeline.errors import MissingArtifactError, UnsupportedModelError
from pipeline.sources import PICKLE_WEIGHTS, SAFETENSORS_WEIGHTS, TOKENIZER_FILES
from pipeline.util.files import read_json_object

# Weight-like files outside the HF naming, named in the "no weights" error so the user sees why.
OTHER_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
# Any one of these is enough for AutoTokenizer to build a tokenizer.
TOKENIZER_SOURCES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


@dataclass(frozen=True)
class LocalCheckpoint:
    """A checked HF checkpoint folder."""

    path: Path
    # config.json as parsed
    config: dict[str, Any]
    # config["architectures"][0], one of SUPPORTED_ARCHITECTURES
    architecture: str
    # file names relative to `path`: safetensors (and index) or, with allow_pickle, pickle weights
    weight_files: list[str] = field(default_factory=list)
    # file names relative to `path`, those of TOKENIZER_FILES present
    tokenizer_files: list[str] = field(default_factory=list)
    has_generation_config: bool = False


def inspect_local_checkpoint(
    path: Path, allow_pickle: bool = False, trust_remote_code: bool = False
) -> LocalCheckpoint:
    """Validate `path` as a convertible checkpoint; raise a PipelineError naming the fix otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise MissingArtifactError(f"checkpoint folder not found: {path}", hint="check `source.path`")
    config = _read_config(path)
    architecture = _architecture(path, config)
    if "auto_map" in config and not trust_remote_code:
        raise UnsupportedModelError(
            f"{path / 'config.json'} has an `auto_map`: loading it runs Python code shipped with the checkpoint",
            hint="review that code, then set `source.trust_remote_code: true`",
        )
    return LocalCheckpoint(
        path=path,
        config=config,
        architecture=architecture,
        weight_files=_weight_files(path, allow_pickle),
        tokenizer_files=_tokenizer_files(path),
        has_generation_config=(path / "generation_config.json").is_file(),
    )


def _read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise MissingArtifactError(
            f"{path} has no config.json: not a Hugging Face checkpoint folder",
            hint="point `source.path` at the folder holding config.json (a GGUF file needs `source.kind: gguf`)",
        )
    return read_json_object(config_path)


def _architecture(path: Path, config: dict[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if not architectures:
        raise UnsupportedModelError(
            f"{path / 'config.json'} names no `architectures`",
            hint=f"add the model class, one of {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    architecture = str(architectures[0])
    if architecture not in SUPPORTED_ARCHITECTURES:
        custom = " (custom code via auto_map)" if "auto_map" in config else ""
        raise UnsupportedModelError(
            f"architecture {architecture}{custom} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    check_hf_config(config)
    return architecture


def _weight_files(path: Path, allow_pickle: bool) -> list[str]:
    safetensors = _matching(path, SAFETENSORS_WEIGHTS)
    if safetensors:
        _check_shards(path, safetensors, SAFETENSORS_WEIGHTS[-1])
        return safetensors
    pickles = _matching(path, PICKLE_WEIGHTS)
    if not pickles:
        others = _matching(path, OTHER_WEIGHT_PATTERNS)
        found = (
            f"; found {', '.join(others)}, which transformers does not load from a folder" if others else ""
        )
        raise MissingArtifactError(
            f"{path} has no weights (model*.safetensors){found}",
            hint="copy the model's safetensors files into the folder (a GGUF file needs `source.kind: gguf`)",
        )
    if not allow_pickle:
        raise UnsupportedModelError(
            f"{path} has only pickle weights ({', '.join(pickles)}); loading a pickle can run arbitrary code",
            hint="convert them to safetensors, or set `source.allow_pickle: true` if you trust the files",
        )
    _check_shards(path, pickles, PICKLE_WEIGHTS[-1])
    return pickles


def _check_shards(path: Path, weight_files: list[str], index_name: str) -> None:
    """A sharded checkpoint lists its shards in an index; a missing shard fails late and obscurely."""
    if index_name not in weight_files:
        return
    index_path = path / index_name
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise UnsupportedModelError(f"{index_path} is not a valid weight index: {err}") from err
    missing = sorted(set(weight_map.values()) - set(weight_files))
    if missing:
        raise MissingArtifactError(
            f"{index_path} lists shards that are absent: {', '.join(missing)}",
            hint="re-download or copy the missing shard files",
        )


def _tokenizer_files(path: Path) -> list[str]:
    present = [name for name in TOKENIZER_FILES if (path / name).is_file()]
    if not any(all(name in present for name in source) for source in TOKENIZER_SOURCES):
        raise MissingArtifactError(
            f"{path} has no tokenizer (tokenizer.json, tokenizer.model, or vocab.json + merges.txt)",
            hint="copy the tokenizer files of the base model into the checkpoint folder",
        )
    return present


def _matching(path: Path, patterns: tuple[str, ...]) -> list[str]:
    return sorted({p.name for pattern in patterns for p in path.glob(pattern) if p.is_file()})
