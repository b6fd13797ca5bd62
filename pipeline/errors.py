"""User-fixable errors. `cli.main` prints these as one line plus a hint; anything else is a bug and keeps
its traceback."""

from __future__ import annotations


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
