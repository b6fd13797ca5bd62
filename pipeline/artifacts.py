"""Stage outputs on disk: atomic writes, manifests with checksums, and the skip-if-fresh check.

Every stage writes into a sibling temporary folder and renames it into place only once its manifest is
written, so a run killed at any point leaves nothing under the final name that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.errors import IntegrityError, MissingArtifactError
from pipeline.util.files import link_or_copy, sha256_file

MANIFEST_NAME = "manifest.json"
_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"


@dataclass
class FileEntry:
    path: str  # relative to the stage directory
    size: int
    sha256: str


@dataclass
class Manifest:
    stage: str
    config_hash: str
    inputs: dict[str, str]  # input stage name -> that manifest's digest
    files: list[FileEntry]
    tool_versions: dict[str, str]
    facts: dict[str, Any] = field(default_factory=dict)  # what the stage wants later stages and users to know
    created_at: float = field(default_factory=time.time)
    llmpipe_version: str = __version__

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @property
    def digest(self) -> str:
        """Identity of this output: changes whenever its config, inputs or any file changes."""
        payload = json.dumps(
            {
                "stage": self.stage,
                "config": self.config_hash,
                "inputs": self.inputs,
                "files": [asdict(f) for f in self.files],
            },
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        data["files"] = [FileEntry(**f) for f in data.get("files", [])]
        return cls(**data)


def list_files(root: Path) -> list[FileEntry]:
    entries = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
        if "__pycache__" in path.parts:  # Triton's Python stub writes these into served repositories
            continue
        entries.append(FileEntry(str(path.relative_to(root)), path.stat().st_size, sha256_file(path)))
    return entries


def read_manifest(stage_dir: Path) -> Manifest | None:
    path = stage_dir / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return Manifest.from_json(path.read_text())
    except (json.JSONDecodeError, TypeError, KeyError):
        return None


def require_manifest(stage_dir: Path, stage: str) -> Manifest:
    manifest = read_manifest(stage_dir)
    if manifest is None:
        raise MissingArtifactError(
            f"no {stage} output at {stage_dir}",
            hint=f"Run `llmpipe {stage} CONFIG` (or `llmpipe build CONFIG`) first.",
        )
    return manifest


def verify_files(stage_dir: Path, manifest: Manifest, extra_roots: dict[str, Path] | None = None) -> None:
    """Raise IntegrityError naming the first file that is missing, resized or altered."""
    for entry in manifest.files:
        root = stage_dir
        rel = entry.path
        for prefix, other in (extra_roots or {}).items():
            if rel.startswith(prefix + "/"):
                root, rel = other, rel[len(prefix) + 1 :]
        path = root / rel
        if not path.is_file():
            raise IntegrityError(
                f"{path} is missing (listed in {stage_dir / MANIFEST_NAME})",
                hint="Rerun the stage with --force.",
            )
        if path.stat().st_size != entry.size:
            raise IntegrityError(
                f"{path} is {path.stat().st_size} bytes, manifest says {entry.size}: truncated or replaced",
                hint="Rerun the stage with --force.",
            )
        if sha256_file(path) != entry.sha256:
            raise IntegrityError(
                f"{path} does not match its sha256 in the manifest: it was modified",
                hint="Rerun the stage with --force.",
            )


def is_fresh(stage_dir: Path, config_hash: str, inputs: dict[str, str]) -> Manifest | None:
    """The existing manifest if it was made from this config and these inputs, and its files are intact."""
    manifest = read_manifest(stage_dir)
    if manifest is None or manifest.config_hash != config_hash or manifest.inputs != inputs:
        return None
    verify_files(stage_dir, manifest, _external_roots(manifest))
    return manifest


def _external_roots(manifest: Manifest) -> dict[str, Path]:
    # A stage may record files that live outside its folder (a local checkpoint validated in place).
    external = manifest.facts.get("external_root")
    return {"@external": Path(external)} if external else {}


def clean_leftovers(stage_dir: Path) -> None:
    """Remove temporary folders of earlier runs that were killed before their rename."""
    parent = stage_dir.parent
    if not parent.is_dir():
        return
    for marker in (_TMP_MARK, _OLD_MARK):
        for stale in parent.glob(f"{stage_dir.name}{marker}*"):
            shutil.rmtree(stale, ignore_errors=True)


def write_atomically(
    stage_dir: Path,
    produce: Callable[[Path], Manifest],
) -> Manifest:
    """Run `produce(tmp_dir)`, write its manifest into tmp_dir, then swap tmp_dir into `stage_dir`."""
    stage_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(stage_dir)
    tmp = stage_dir.with_name(f"{stage_dir.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        manifest = produce(tmp)
        # NOTE: the manifest is written last; its presence under the final name is what later runs trust.
        (tmp / MANIFEST_NAME).write_text(manifest.to_json())
        _fsync_tree(tmp)
        old = None
        if stage_dir.exists():
            old = stage_dir.with_name(f"{stage_dir.name}{_OLD_MARK}{uuid.uuid4().hex[:8]}")
            stage_dir.rename(old)
        tmp.rename(stage_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())


def link_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """Mirror `src` into `dst`, less its top-level entries named in `skip`. A symlink whose target lies
    outside `src` is refused: packaging must not carry files from elsewhere on the machine into an artifact
    (a served repository, say)."""
    root = src.resolve()
    for path in sorted(src.rglob("*")):
        if path.relative_to(src).parts[0] in skip:
            continue
        if path.is_symlink() and not path.resolve().is_relative_to(root):
            raise IntegrityError(
                f"{path} is a symlink to {path.resolve()}, outside {root}",
                hint="Replace the link with the file itself.",
            )
        if path.is_file() and path.name != MANIFEST_NAME and "__pycache__" not in path.parts:
            link_or_copy(path, dst / path.relative_to(src))


def tool_versions(*extra: str) -> dict[str, str]:
    """Versions of the libraries a stage's output depends on; missing ones are omitted."""
    from importlib import metadata

    versions = {"llmpipe": __version__}
    for dist in ("torch", "transformers", "safetensors", *extra):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions
