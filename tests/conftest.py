"""Shared fixtures: an isolated HF cache and work dir for every test, and the model fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.fixtures_models"]

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated_hf(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No test may reach the Hub or read the user's cache or token."""
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("LLMPIPE_DEBUG", raising=False)


@pytest.fixture
def in_tmp_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a temporary cwd so default work dirs (build/<name>) land there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
