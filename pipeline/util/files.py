"""Checksums, hard links and JSONL records."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, UnsupportedModelError

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def link_or_copy(src: Path, dst: Path) -> bool:
    """Put `src` at `dst`, replacing what is there: a hard link (no second copy on disk) where the file
    system allows one, else a copy. True when linked."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst)
        return False
    return True


def read_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The JSON object on each non-blank line of `path`, with where it stands (`path:line`) for the
    caller's own errors about its fields. A line that is not a JSON object is a ConfigError naming it."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: each line must be a JSON object, got {type(record).__name__}")
        records.append((where, record))
    return records


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold one object (a checkpoint's or an engine's config.json)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UnsupportedModelError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data
