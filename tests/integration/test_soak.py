"""Soak (scripts/soak.py) against a REAL tritonserver: mixed unary, streaming, cancelled and bad requests;
zero wrong answers, zero leaked KV blocks, RSS of tritonserver + stubs within 10%, healthy at the end.
A ~20 s variant runs in `make test`; `make soak` runs the script for 20 minutes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from pipeline.serving.server.launcher import TritonServer

pytestmark = pytest.mark.triton
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def _soak_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llmpipe_soak", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_soak_has_no_wrong_answers_leaks_or_growth(
    tiny_server: TritonServer, tiny_engine_dir: Path
) -> None:
    soak = _soak_module()
    report = soak.soak(tiny_server, soak.expected_texts(tiny_engine_dir), duration_s=20.0)
    print(report)
    assert report["wrong"] == 0, report["failures"]
    assert report["leaked_kv_blocks"] == 0
    assert report["rss_growth"] <= 0.10, report
    assert report["healthy"]
    assert all(c["tried"] > 0 for c in report["counts"].values()), report["counts"]
    assert report["counts"]["bad"]["rejected"] == report["counts"]["bad"]["tried"]
