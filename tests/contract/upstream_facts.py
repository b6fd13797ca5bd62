"""TensorRT-LLM's recorded interface, read from the data files in upstream/ (one file per fact; each opens
with a line naming the upstream source as repo:path@commit and how it was read). The contract tests and
the fake trtllm-build take their facts from here, never from llmpipe's own output."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

UPSTREAM_DIR = Path(__file__).resolve().parent / "upstream"
# The release these files describe; the flag file also names the other releases' flag sets.
RELEASE = "1.1.0"
# A source citation: owner/repo (or "owner/repo gh-pages"):path@commit
CITATION = re.compile(r"[\w.-]+/[\w.-]+( gh-pages)?:\S+@[0-9a-f]{7,40}")


def fact_files() -> list[Path]:
    return sorted(p for p in UPSTREAM_DIR.iterdir() if p.suffix in (".tsv", ".txt"))


def _rows(name: str) -> Iterator[list[str]]:
    for line in (UPSTREAM_DIR / name).read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            yield line.split("\t")


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str  # TYPE_* or a template placeholder such as ${logits_datatype}
    dims: tuple[int, ...]
    optional: bool


@cache
def model_tensors(model: str) -> dict[str, dict[str, Tensor]]:
    """direction ("input" / "output") -> name -> Tensor of a Triton model of upstream's repository
    (`tensorrt_llm`, `ensemble`)."""
    tensors: dict[str, dict[str, Tensor]] = {"input": {}, "output": {}}
    for direction, name, data_type, dims, optional in _rows(f"{model}_io.tsv"):
        shape = tuple(int(d) for d in dims.split(","))
        tensors[direction][name] = Tensor(name, data_type, shape, optional == "optional")
    return tensors


@cache
def tensorrt_llm_parameter_keys() -> tuple[str, ...]:
    return tuple(row[0] for row in _rows("tensorrt_llm_parameters.txt"))


@dataclass(frozen=True)
class Flag:
    """One trtllm-build option: its value kind ("switch", "int", "str") or closed choice set, and whether
    it takes one or more values."""

    name: str
    aliases: tuple[str, ...]
    kind: str
    choices: tuple[str, ...] | None
    many: bool
    releases: tuple[str, ...] | None  # None = every release


def _flag(name: str, aliases: str, value: str, releases: str) -> Flag:
    many = value.endswith("+")
    value = value.rstrip("+")
    choices = tuple(value.strip("{}").split(",")) if value.startswith("{") else None
    return Flag(
        name=name,
        aliases=() if aliases == "-" else tuple(aliases.split(",")),
        kind="choice" if choices else value,
        choices=choices,
        many=many,
        releases=None if releases == "all" else tuple(releases.split(",")),
    )


@cache
def all_trtllm_build_flags() -> tuple[Flag, ...]:
    return tuple(_flag(*row) for row in _rows("trtllm_build_flags.tsv"))


def trtllm_build_flags(release: str = RELEASE) -> dict[str, Flag]:
    """Option string (aliases included) -> Flag, for one release."""
    flags = {}
    for flag in all_trtllm_build_flags():
        if flag.releases is None or release in flag.releases:
            for option in (flag.name, *flag.aliases):
                flags[option] = flag
    return flags


@cache
def engine_config_layout() -> dict[str, str]:
    """Dotted key path of the engine config.json -> its recorded value form."""
    return {key: value for key, value in _rows("engine_config_layout.tsv")}


def layout_children(prefix: str) -> set[str]:
    """The keys recorded directly under `prefix` ("" = the top level)."""
    depth = prefix.count(".") + 1 if prefix else 0
    start = f"{prefix}." if prefix else ""
    return {
        key.split(".")[depth]
        for key in engine_config_layout()
        if key.startswith(start) and key.count(".") == depth
    }


def key_paths(data: dict[str, Any], prefix: str = "") -> set[str]:
    """Every dotted key path of a nested dict (a.b.c), to compare a config.json with the layout."""
    paths = set()
    for key, value in data.items():
        paths.add(prefix + key)
        if isinstance(value, dict):
            paths |= key_paths(value, f"{prefix}{key}.")
    return paths


@cache
def engine_model_classes() -> dict[str, str | None]:
    """HF architecture -> the TensorRT-LLM 1.1.0 engine-route model class (MODEL_MAP); None: it has none."""
    return {arch: None if cls == "-" else cls for arch, cls in _rows("engine_model_classes.tsv")}


@cache
def pytorch_backend_architectures() -> dict[str, bool]:
    """HF architecture -> whether TensorRT-LLM 1.1.0's PyTorch backend registers it."""
    return {arch: supported == "yes" for arch, supported in _rows("pytorch_backend_architectures.tsv")}


@dataclass(frozen=True)
class ModelOptExport:
    decoder_type: str | None  # get_model_type's answer
    trtllm_checkpoint: bool  # export_tensorrt_llm_checkpoint works where llmpipe runs ModelOpt
    unified_hf: bool  # export_hf_checkpoint works


@cache
def modelopt_exports() -> dict[str, ModelOptExport]:
    return {
        arch: ModelOptExport(
            None if decoder == "-" else decoder, trtllm.startswith("yes"), unified.startswith("yes")
        )
        for arch, decoder, trtllm, unified in _rows("modelopt_export.tsv")
    }
