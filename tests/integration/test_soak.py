"""Soak (scripts/soak.py) against a REAL tritonserver: mixed unary, streaming, cancelled and bad requests;
zero wrong answers, zero leaked KV blocks, RSS of tritonserver + stubs within 10%, healthy at the end.
A ~20 s variant runs in `make test`; `make soak` runs the script for 20 minutes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.serving.server.launcher import TritonServer
from tests.serving_helpers import soak_script

pytestmark = pytest.mark.triton


def test_short_soak_has_no_wrong_answers_leaks_or_growth(
    tiny_server: TritonServer, tiny_engine_dir: Path
) -> None:
    soak = soak_script()
    report = soak.soak(tiny_server, soak.expected_texts(tiny_engine_dir), duration_s=20.0)
    print(report)
    assert report["wrong"] == 0, report["failures"]
    assert report["leaked_kv_blocks"] == 0
    assert report["rss_growth"] <= 0.10, report
    assert report["healthy"]
    assert all(c["tried"] > 0 for c in report["counts"].values()), report["counts"]
    assert report["counts"]["bad"]["rejected"] == report["counts"]["bad"]["tried"]
