"""Session-scoped serving fixtures for the tiny random Llama (registered from tests/conftest.py).

Both are shared by every module that asks for them, so tests only read them: a test that edits engine files
works on a copy, and one that needs another configuration, a server it may stop or kill, or metrics counted
from a fresh start builds its own with tests.serving_helpers (build_tiny_engine, serve_tiny).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.serving_helpers import build_tiny_engine, serve_tiny

if TYPE_CHECKING:
    from pipeline.serving.server.launcher import TritonServer


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The torch engine of tiny_config's defaults."""
    return build_tiny_engine(tiny_llama_dir, tmp_path_factory.mktemp("tiny-engine"))


@pytest.fixture(scope="session")
def tiny_server(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """tritonserver serving tiny_engine_dir packaged with tiny_config's defaults (decoupled)."""
    repo = tmp_path_factory.mktemp("tiny-served") / "model_repo"
    with serve_tiny(tiny_llama_dir, tiny_engine_dir, repo) as server:
        yield server
