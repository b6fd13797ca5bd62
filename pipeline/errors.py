"""User-fixable errors. `cli.main` prints these as one line plus a hint; anything else is a bug and keeps
its traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn


class PipelineError(Exception):
    """A problem the user can fix; `hint` says how."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ConfigError(PipelineError):
    """The build config (or an override) is invalid."""


class MissingArtifactError(PipelineError):
    """An input a stage needs is absent: an earlier stage has not run, or a path is wrong."""


class UnsupportedModelError(PipelineError):
    """The checkpoint's architecture or format is not one llmpipe can convert."""


class IntegrityError(PipelineError):
    """A file does not match the checksum its manifest recorded (truncated, tampered, half-written)."""


class AccuracyRegression(PipelineError):
    """`validate` measured a metric outside its threshold."""


class ServingError(PipelineError):
    """Triton could not be started, or a model failed to load or answer."""


class BackendUnavailableError(PipelineError):
    """The chosen backend cannot run on this machine (e.g. TensorRT-LLM without a GPU)."""


def run_script(main: Callable[[], int]) -> NoReturn:
    """Exit with `main()`'s status; a PipelineError prints as the CLI prints it (one line plus the hint)
    and exits with its code. For scripts/ that run outside the Click group."""
    try:
        sys.exit(main())
    except PipelineError as err:
        if os.environ.get("LLMPIPE_DEBUG") == "1":
            raise
        print(f"Error: {err.message}" + (f"\nHint: {err.hint}" if err.hint else ""), file=sys.stderr)
        sys.exit(err.exit_code)
