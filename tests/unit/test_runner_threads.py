"""The model runner's thread policy: one-row steps of a model with small layers run single-threaded, every
other step on all threads, and the thread count is restored after each step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.worker import model_runner


def _threads_per_forward(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(token rows, torch threads) of every forward of two generate calls run with 2 torch threads."""
    model = engine.runner.model  # type: ignore[attr-defined]
    forward = model.forward
    seen: list[tuple[int, int]] = []

    def spy(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((int(input_ids.numel()), torch.get_num_threads()))
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = SamplingParams(max_tokens=3)  # no end_id: exactly 3 tokens each
        engine.generate([[5, 6, 7, 8, 9]], params)  # a 5-row prefill, then one-row decodes
        engine.generate([[5, 6, 7], [10, 11, 12]], params)  # two rows per decode step
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    return seen


def test_small_layers_decode_one_row_on_one_thread(
    tiny_engine_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)
    assert engine.runner.layer_weight_bytes < model_runner.SINGLE_THREAD_MAX_LAYER_BYTES  # type: ignore[attr-defined]
    seen = _threads_per_forward(engine, monkeypatch)
    assert seen == [(5, 2), (1, 1), (1, 1), (6, 2), (2, 2), (2, 2)]


def test_big_layers_keep_every_thread(tiny_engine_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)
    monkeypatch.setattr(model_runner, "SINGLE_THREAD_MAX_LAYER_BYTES", engine.runner.layer_weight_bytes - 1)  # type: ignore[attr-defined]
    assert all(threads == 2 for _, threads in _threads_per_forward(engine, monkeypatch))
