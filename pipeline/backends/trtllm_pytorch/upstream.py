"""TensorRT-LLM's recorded interface (pipeline/data/llm_api_args_fields.txt) and the check that everything
llmpipe writes for the PyTorch backend uses only names in it.

The LLM API classes forbid unknown fields, so a misspelt or renamed key would only fail on the GPU host
when the model loads; checked here, it fails when the arguments are generated, naming the key.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError
from pipeline.util.package_data import DATA_DIR

FIELDS_FILE = DATA_DIR / "llm_api_args_fields.txt"
_LISTED = 8
_SECTION = re.compile(r"^\[(class|choice|options) (.+)\]$")


@dataclass(frozen=True)
class Field:
    target: str | None = None  # the class or choice a mapping value is checked against
    values: tuple[str, ...] | None = None  # the values upstream accepts, where it lists them


@dataclass
class Interface:
    """The parsed file: classes (name -> field -> Field), choices (key -> value -> class) and command options."""

    source: str  # the file's first line: upstream's repo:path@commit
    classes: dict[str, dict[str, Field]] = field(default_factory=dict)
    choices: dict[str, dict[str, str]] = field(default_factory=dict)
    options: dict[str, dict[str, Field]] = field(default_factory=dict)


def _parse_field(line: str) -> tuple[str, Field]:
    name, arrow, target = (part.strip() for part in line.partition("->"))
    if arrow:
        return name, Field(target=target)
    name, eq, values = (part.strip() for part in line.partition("="))
    return name, Field(values=tuple(v.strip() for v in values.split("|")) if eq else None)


def parse_interface(text: str) -> Interface:
    lines = text.splitlines()
    interface = Interface(source=lines[0].lstrip("# ").strip())
    includes: dict[str, list[str]] = {}
    current: dict[str, Any] | None = None
    kind = ""
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        section = _SECTION.match(line)
        if section:
            kind, name = section.groups()
            tables: dict[str, dict[str, Any]] = {
                "class": interface.classes,
                "choice": interface.choices,
                "options": interface.options,
            }
            current = tables[kind].setdefault(name, {})
            if kind == "class":
                includes.setdefault(name, [])
            continue
        if current is None:
            raise ValueError(f"{FIELDS_FILE.name}: {line!r} comes before any section")
        if kind == "class" and line.startswith("+"):
            includes[name].append(line[1:].strip())
        elif kind == "choice":
            value, _, target = (part.strip() for part in line.partition("->"))
            current[value] = target
        else:
            key, spec = _parse_field(line)
            current[key] = spec
    for name in includes:
        interface.classes[name] = _expanded(name, interface.classes, includes)
    return interface


def _expanded(
    name: str, classes: dict[str, dict[str, Field]], includes: dict[str, list[str]]
) -> dict[str, Field]:
    fields: dict[str, Field] = {}
    for base in includes[name]:
        fields |= _expanded(base, classes, includes)
    return fields | classes[name]


@functools.cache
def interface(path: Path = FIELDS_FILE) -> Interface:
    return parse_interface(path.read_text(encoding="utf-8"))


def _error(path: str, problem: str, allowed: Iterable[str], source: str) -> ConfigError:
    names = sorted(allowed)
    if len(names) > _LISTED:  # a class's whole field list would drown the line: the nearest names instead
        wrong = path.rsplit(".", 1)[-1].rsplit(" ", 1)[-1]
        names = difflib.get_close_matches(wrong, names, n=3, cutoff=0.5) or names[:_LISTED]
        offer = f"nearest upstream names: {', '.join(names)}"
    else:
        offer = f"upstream allows {', '.join(names)}"
    return ConfigError(
        f"generated TensorRT-LLM argument {path}: {problem}; {offer}",
        hint=f"llmpipe's trtllm_pytorch backend writes only names recorded from {source} "
        f"({FIELDS_FILE.name}): the generator and the record disagree",
    )


def check_mapping(args: Mapping[str, Any], cls: str = "TorchLlmArgs", path: str = "") -> None:
    """Raise ConfigError for the first key, at any depth, that `cls` does not have (or a listed value it
    does not accept)."""
    spec = interface()
    fields = spec.classes[cls]
    for key, value in args.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            raise _error(where, f"{cls} has no field {key!r}", fields, spec.source)
        target, values = fields[key].target, fields[key].values
        if values is not None and value not in values:
            raise _error(where, f"{value!r} is not a value {cls}.{key} takes", values, spec.source)
        if target is None or value is None:
            continue
        if not isinstance(value, Mapping):
            raise _error(where, f"{cls}.{key} takes a mapping ({target}), not {value!r}", fields, spec.source)
        if target in spec.choices:
            choice = spec.choices[target]
            picked = value.get(target)
            if picked not in choice:
                raise _error(f"{where}.{target}", f"{picked!r} selects no class", choice, spec.source)
            check_mapping(value, choice[picked], where)
        else:
            check_mapping(value, target, where)


def check_argv(argv: list[str], command: str = "trtllm-serve serve") -> None:
    """Raise ConfigError for an option of `argv` that `command` does not have, or a value it does not list."""
    spec = interface()
    options = spec.options[command]
    for index, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        if arg not in options:
            raise _error(f"{command} {arg}", "no such option", options, spec.source)
        values = options[arg].values
        if values is not None and argv[index + 1] not in values:
            raise _error(
                f"{command} {arg}", f"{argv[index + 1]!r} is not one of its values", values, spec.source
            )
