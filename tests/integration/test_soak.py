"""Soak (scripts/soak.py) against a REAL tritonserver: mixed unary, streaming, cancelled and bad requests;
zero wrong answers, zero leaked KV blocks, RSS of tritonserver + stubs within 10%, healthy at the end.
A ~20 s variant runs in `make test`; `make soak` runs the script for 20 minutes."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from pipeline.serving.repository.render import render_model_repository
from pipeline.serving.server.command import ServerOptions
from pipeline.serving.server.launcher import TritonServer
from tests.serving_helpers import build_tiny_engine, require_tritonserver, tiny_config

pytestmark = pytest.mark.triton
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def _soak_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llmpipe_soak", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def served(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TritonServer, Path]]:
    require_tritonserver()
    root = tmp_path_factory.mktemp("soak")
    engine_dir = build_tiny_engine(tiny_llama_dir, root)
    render_model_repository(tiny_config(tiny_llama_dir), engine_dir, root / "model_repo")
    options = ServerOptions(root / "model_repo", http_port=0, grpc_port=0, metrics_port=0, exit_timeout_s=20)
    with TritonServer(options, ready_timeout_s=240) as server:
        yield server, engine_dir


def test_short_soak_has_no_wrong_answers_leaks_or_growth(served: tuple[TritonServer, Path]) -> None:
    soak = _soak_module()
    server, engine_dir = served
    report = soak.soak(server, soak.expected_texts(engine_dir), duration_s=20.0)
    print(report)
    assert report["wrong"] == 0, report["failures"]
    assert report["leaked_kv_blocks"] == 0
    assert report["rss_growth"] <= 0.10, report
    assert report["healthy"]
    assert all(c["tried"] > 0 for c in report["counts"].values()), report["counts"]
    assert report["counts"]["bad"]["rejected"] == report["counts"]["bad"]["tried"]
