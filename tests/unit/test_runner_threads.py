"""The model runner's thread policy: one-row steps run on `single_row_threads` (given, or measured at load
as the faster of one thread and all), every other step on all threads, and the thread count is restored
after each step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.engine_args import EngineArgs, RunnerArgs
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.kernels import build
from pipeline.runtime.kernels import ops as kernels


def _threads_per_forward(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(token rows, torch threads) of every forward of two generate calls run with 2 torch threads."""
    model = engine.runner.model  # type: ignore[attr-defined]
    forward = model.forward
    seen: list[tuple[int, int]] = []

    def spy(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((int(input_ids.numel()), torch.get_num_threads()))
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    params = SamplingParams(max_tokens=3)  # no end_id: exactly 3 tokens each
    engine.generate([[5, 6, 7, 8, 9]], params)  # a 5-row prefill, then one-row decodes
    engine.generate([[5, 6, 7], [10, 11, 12]], params)  # two rows per decode step
    assert torch.get_num_threads() == 2
    return seen


@pytest.fixture
def two_threads() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _engine(tiny_engine_dir: Path, single_row_threads: int | None) -> LLMEngine:
    args = EngineArgs(runner=RunnerArgs(device="cpu", single_row_threads=single_row_threads))
    return LLMEngine.from_engine_dir(tiny_engine_dir, args)


def test_one_row_steps_run_on_the_chosen_thread_count(
    tiny_engine_dir: Path, two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _threads_per_forward(_engine(tiny_engine_dir, 1), monkeypatch)
    assert seen == [(5, 2), (1, 1), (1, 1), (6, 2), (2, 2), (2, 2)]


def test_all_threads_when_chosen(
    tiny_engine_dir: Path, two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _threads_per_forward(_engine(tiny_engine_dir, 2), monkeypatch)
    assert all(threads == 2 for _, threads in seen)


def test_the_measured_choice_is_one_or_all_and_is_applied(
    tiny_engine_dir: Path, two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(tiny_engine_dir, None)
    chosen = engine.runner.single_row_threads  # type: ignore[attr-defined]
    assert chosen in (1, 2)
    assert torch.get_num_threads() == 2  # the measurement restored it
    one_row = [threads for rows, threads in _threads_per_forward(engine, monkeypatch) if rows == 1]
    assert one_row == [chosen, chosen]


def test_the_one_row_vector_form_is_measured_and_applied(tiny_engine_dir: Path, two_threads: None) -> None:
    engine = _engine(tiny_engine_dir, None)
    chosen = engine.runner.wide_single_row  # type: ignore[attr-defined]
    if not (kernels.kernels_available() and build.has_wide_vectors()):
        assert chosen is False
        return
    assert kernels.set_wide_single_row(chosen) is chosen  # the runner left its choice in place


def test_the_prefetch_distance_is_measured_and_applied(tiny_engine_dir: Path, two_threads: None) -> None:
    engine = _engine(tiny_engine_dir, None)
    chosen = engine.runner.far_prefetch  # type: ignore[attr-defined]
    if not kernels.kernels_available():
        assert chosen is False
        return
    assert kernels.set_far_prefetch(chosen) is chosen  # the runner left its choice in place
