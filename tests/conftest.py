"""Shared fixtures: an isolated HF cache and work dir for every test, and the model and serving fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.util.openmp import default_wait_policy

# As the CLI does, before the fixture modules load torch (pipeline.util.openmp says why).
default_wait_policy(os.environ)

pytest_plugins = ["tests.fixtures_models", "tests.fixtures_serving"]

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated_hf(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No test may reach the Hub or read the user's cache or token."""
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("LLMPIPE_DEBUG", raising=False)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and on a shared 2-core machine OpenMP's waiting threads can
    slow each op down by orders of magnitude: modules of tiny-model tests opt in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def in_tmp_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a temporary cwd so default work dirs (build/<name>) land there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
