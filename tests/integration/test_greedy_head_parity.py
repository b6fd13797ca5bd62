"""16 concurrent greedy requests without log-probs decode through the int8-screened greedy head (up to 16 rows
per step) and the fused decoder layers, and still equal HF `generate` token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.runtime.engine.engine_args import RunnerArgs
from pipeline.runtime.model.greedy_head import GreedyLMHead
from pipeline.runtime.worker.model_runner import ModelRunner
from tests.integration.test_parity import assert_matches, make_engine_dir, mixed_case, run_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class RowCountingHead:
    """The runner's greedy head, recording how many rows each call screens."""

    def __init__(self, head: GreedyLMHead) -> None:
        self.head = head
        self.max_rows = head.max_rows
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor) -> list[int]:
        self.rows.append(x.shape[0])
        return self.head(x)


def test_16_concurrent_through_the_greedy_head(tiny_llama_dir: Path, tmp_path: Path) -> None:
    runner = ModelRunner.from_engine_dir(
        make_engine_dir(tiny_llama_dir, tmp_path), RunnerArgs(device="cpu", kv_max_tokens=16384)
    )
    if runner.model.greedy_head is None or runner.model.fused is None:
        pytest.skip("the kernels are unavailable here")
    head = RowCountingHead(runner.model.greedy_head)
    runner.model.greedy_head = head  # type: ignore[assignment]
    eos = json.loads((tiny_llama_dir / "config.json").read_text())["eos_token_id"]
    case = mixed_case(tiny_llama_dir, runner.config.model.vocab_size, seed=7)
    assert_matches(run_engine(runner, case, eos, logprobs=False), case)
    assert max(head.rows) > 4, head.rows  # steps of many decodes took the head, not logits + argmax
