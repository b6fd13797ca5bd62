"""Hugging Face Hub snapshot at a pinned revision -> a plain checkpoint folder, with one-line errors.

Files go through the shared HF cache (so an offline machine with a pre-filled HF_HOME works) and are then
hard-linked (or copied) into `out_dir`; the cache's snapshot folder name is the resolved commit sha."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import filter_repo_objects

from pipeline.errors import ConfigError, MissingArtifactError, PipelineError
from pipeline.sources import PICKLE_WEIGHTS, SAFETENSORS_WEIGHTS, TOKENIZER_FILES
from pipeline.util.files import link_or_copy, read_json_object

CONFIG_FILES = ("config.json", "generation_config.json")
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


def allow_patterns(allow_pickle: bool) -> list[str]:
    """The files fetch downloads: config, weights, tokenizer; never README/onnx/gguf/other formats."""
    patterns = [*CONFIG_FILES, *SAFETENSORS_WEIGHTS, *TOKENIZER_FILES]
    return patterns + list(PICKLE_WEIGHTS) if allow_pickle else patterns


def download_snapshot(
    repo_id: str,
    revision: str,
    out_dir: Path,
    token_env: str = "HF_TOKEN",
    allow_pickle: bool = False,
) -> tuple[str, list[str]]:
    """Download `repo_id` at `revision` into `out_dir`; return (resolved commit sha, file names).

    Honours HF_HOME / HF_HUB_CACHE and HF_HUB_OFFLINE as set when called (not only at import). The token
    is read from the environment variable `token_env` and never appears in results or errors.
    """
    token = os.environ.get(token_env) or None
    patterns = allow_patterns(allow_pickle)
    snapshot = _download(repo_id, revision, patterns, token_env, token)
    files = _materialize(snapshot, Path(out_dir), patterns)
    if "config.json" not in files:
        raise _no_config(repo_id, revision)
    return snapshot.name, files


def download_config(repo_id: str, revision: str, token_env: str = "HF_TOKEN") -> dict[str, Any]:
    """`repo_id`'s config.json at `revision` alone (a few KB through the same cache), so a model that cannot
    be built is refused before its weights are downloaded."""
    snapshot = _download(repo_id, revision, ["config.json"], token_env, os.environ.get(token_env) or None)
    path = snapshot / "config.json"
    if not path.is_file():
        raise _no_config(repo_id, revision)
    return read_json_object(path)


def _no_config(repo_id: str, revision: str) -> MissingArtifactError:
    return MissingArtifactError(
        f"{repo_id}@{revision} has no config.json: not a transformers checkpoint",
        hint="use a repository in the transformers layout, or `source.kind: gguf` for a GGUF file",
    )


def _download(repo_id: str, revision: str, patterns: list[str], token_env: str, token: str | None) -> Path:
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=_cache_dir(),
                allow_patterns=patterns,
                local_files_only=_offline(),
                token=token,
            )
        )
    except Exception as err:  # translated, or re-raised if unknown
        failure = _translate(err, repo_id, revision, token_env, token)
        if not token:
            raise failure from err
    # NOTE: raised outside the handler on purpose: the original error holds the HTTP request, Authorization
    # header included, so with a token set it must travel neither as __cause__ nor as __context__.
    raise failure


def _cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def _offline() -> bool:
    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE_VALUES


def _materialize(snapshot: Path, out_dir: Path, patterns: list[str]) -> list[str]:
    """Place the snapshot's wanted files in `out_dir`; hard links share the cache's blobs without copying."""
    names = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    wanted = sorted(filter_repo_objects(names, allow_patterns=patterns))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in wanted:
        link_or_copy((snapshot / name).resolve(), out_dir / name)
    return wanted


def _translate(
    err: Exception, repo_id: str, revision: str, token_env: str, token: str | None
) -> PipelineError:
    """One line per known huggingface_hub failure; anything else is a bug and keeps its traceback."""
    where = f"{repo_id}@{revision}"
    # Order matters: GatedRepoError is a RepositoryNotFoundError, and all three are HfHubHTTPErrors.
    if isinstance(err, GatedRepoError) or _http_status(err) in (401, 403):
        return ConfigError(
            f"{where}: access denied (gated or private repository)",
            hint=f"accept the model's licence on huggingface.co, then export {token_env}=<a read token>",
        )
    if isinstance(err, RepositoryNotFoundError):
        return ConfigError(
            f"{where}: repository not found",
            hint=f"check `source.repo_id`; a private repository also needs {token_env}",
        )
    if isinstance(err, RevisionNotFoundError):
        return ConfigError(
            f"{where}: revision not found", hint="check `source.revision` (a commit sha, tag or branch)"
        )
    if isinstance(err, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        offline = "HF_HUB_OFFLINE is set" if _offline() else "the Hub is unreachable"
        return MissingArtifactError(
            f"{where}: not (completely) in the local Hugging Face cache ({_cache_dir()}) and {offline}",
            hint="download it once on a connected machine and copy HF_HOME here, or use `source.kind: local`/`gguf`",
        )
    if isinstance(err, HFValidationError):
        return ConfigError(f"invalid source.repo_id or source.revision: {_first_line(err, token)}")
    if isinstance(err, HfHubHTTPError):
        return MissingArtifactError(
            f"{where}: the Hub answered {_first_line(err, token)}", hint="retry later, or check HF_ENDPOINT"
        )
    raise err


def _http_status(err: Exception) -> int | None:
    response = getattr(err, "response", None)
    return getattr(response, "status_code", None) if response is not None else None


def _first_line(err: Exception, token: str | None) -> str:
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return line.replace(token, "***") if token else line
