"""The per-machine answer to whether torch's fp32 GEMM outruns the fp32 kernel on prefill-sized steps: measured
once, kept in the kernel cache, and read back by every later process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.runtime.kernels import build, gemm_probe
from pipeline.runtime.kernels import ops as kernels

needs_kernels = pytest.mark.skipif(
    not kernels.kernels_available(), reason=f"kernels unavailable: {kernels.kernels_unavailable_reason()}"
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(gemm_probe.CHOICE_ENV, raising=False)
    gemm_probe.torch_outruns_fp32_kernel.cache_clear()
    yield build.cache_dir()
    gemm_probe.torch_outruns_fp32_kernel.cache_clear()


@needs_kernels
def test_the_first_process_measures_both_and_keeps_the_answer(cache: Path) -> None:
    answer = gemm_probe.torch_outruns_fp32_kernel()
    record = json.loads(gemm_probe.record_path().read_text())
    assert gemm_probe.record_path().parent == cache
    assert record["torch_outruns_kernel"] is answer
    assert answer == (record["kernel_ms"] > gemm_probe.MARGIN * record["torch_ms"])
    assert record["kernel_ms"] > 0 and record["torch_ms"] > 0 and record["rows"] == gemm_probe.PROBE_ROWS
    assert not list(cache.glob("*.tmp"))


@pytest.mark.parametrize("kept", [True, False])
def test_later_processes_read_the_kept_answer_without_measuring(
    cache: Path, monkeypatch: pytest.MonkeyPatch, kept: bool
) -> None:
    cache.mkdir(parents=True)
    gemm_probe.record_path().write_text(json.dumps({"torch_outruns_kernel": kept}))
    monkeypatch.setattr(gemm_probe, "_fastest_of_both", lambda: pytest.fail("measured again"))
    assert gemm_probe.torch_outruns_fp32_kernel() is kept


@pytest.mark.parametrize("text", ["", "{not json", "[]", '{"other": 1}'])
def test_an_unreadable_record_is_measured_again(
    cache: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    cache.mkdir(parents=True)
    gemm_probe.record_path().write_text(text)
    monkeypatch.setattr(gemm_probe, "_fastest_of_both", lambda: (3.0, 1.0))  # kernel 3 s, torch 1 s
    assert gemm_probe.torch_outruns_fp32_kernel() is True
    assert json.loads(gemm_probe.record_path().read_text())["torch_outruns_kernel"] is True


def test_torch_takes_the_steps_only_when_clearly_faster(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm_probe, "_fastest_of_both", lambda: (1.2, 1.0))  # within the margin: a near tie
    assert gemm_probe.torch_outruns_fp32_kernel() is False


def test_machines_keep_separate_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    first = gemm_probe.record_path()
    monkeypatch.setattr(gemm_probe, "cpu_model", lambda: "AMD EPYC 9R45 (Zen 5)")
    assert gemm_probe.record_path() != first and "AMD_EPYC" in gemm_probe.record_path().name


@pytest.mark.parametrize(("choice", "on_torch"), [("kernel", False), ("torch", True), (" Torch ", True)])
def test_the_user_can_choose_without_a_probe(
    cache: Path, monkeypatch: pytest.MonkeyPatch, choice: str, on_torch: bool
) -> None:
    monkeypatch.setenv(gemm_probe.CHOICE_ENV, choice)
    monkeypatch.setattr(gemm_probe, "_fastest_of_both", lambda: pytest.fail("measured"))
    assert gemm_probe.torch_outruns_fp32_kernel() is on_torch
    assert not gemm_probe.record_path().exists()


def test_a_bad_choice_is_a_config_error_naming_the_variable(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(gemm_probe.CHOICE_ENV, "onednn")
    with pytest.raises(ConfigError, match="LLMPIPE_FP32_GEMM='onednn' is invalid"):
        gemm_probe.torch_outruns_fp32_kernel()
