"""The stand-in `tensorrt_llm` package (TensorRT-LLM 1.x signatures, calls recorded) for the contract tests."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

STAND_IN = Path(__file__).resolve().parents[1] / "stand_in_tensorrt_llm"


def drop_trtllm_modules() -> None:
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture
def trtllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The stand-in `tensorrt_llm` on sys.path; yields its module (CALLS holds the recorded calls)."""
    drop_trtllm_modules()
    monkeypatch.syspath_prepend(str(STAND_IN))
    importlib.invalidate_caches()
    module = importlib.import_module("tensorrt_llm")
    module.CALLS.clear()
    yield module
    drop_trtllm_modules()
