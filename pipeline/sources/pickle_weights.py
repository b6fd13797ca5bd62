"""Pickle weights (`source.allow_pickle: true`) opened at fetch the way convert opens them: torch's
weights-only unpickler, memory-mapped, so a file that imports anything but tensors (a pickle that would run
code), or that convert could not read, is refused here in one line instead of failing convert."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path

from pipeline.errors import UnsupportedModelError

PICKLE_SUFFIX = ".bin"


def check_pickle_weights(path: Path, weight_files: Sequence[str]) -> None:
    """Raise UnsupportedModelError naming the first of `weight_files` (names in `path`) that torch's
    weights-only loader refuses. Tensor data is memory-mapped, not read."""
    import torch

    for name in weight_files:
        if not name.endswith(PICKLE_SUFFIX):
            continue
        try:
            torch.load(path / name, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
            raise UnsupportedModelError(
                f"{path / name} is not a plain tensor checkpoint: {_reason(err)}",
                hint="convert the weights to safetensors with a tool you trust (the file was not executed)",
            ) from None


def _reason(err: Exception) -> str:
    """The line of torch's message that says what it refused (its messages run over several paragraphs)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (named or lines or [type(err).__name__])[0]
