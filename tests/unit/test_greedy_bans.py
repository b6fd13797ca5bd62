"""Greedy requests with token bans (min_tokens' end id, bad words) take the one-op greedy head and redo only
the rows whose argmax is banned: same tokens as the full-logits path."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.llm_engine import LLMEngine

PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 42], [7, 7, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def engine(tiny_engine_dir: Path) -> LLMEngine:
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)
    if engine.runner.model.greedy_head is None:  # type: ignore[attr-defined]
        pytest.skip("no compiled greedy head on this machine")
    return engine


def _outputs(engine: LLMEngine, params: list[SamplingParams]) -> list[list[int]]:
    return [r.output_token_ids for r in engine.generate(PROMPTS, params)]


def test_banned_argmax_rows_are_redone_and_match_the_logits_path(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = _outputs(engine, [SamplingParams(max_tokens=6, temperature=0.0)] * len(PROMPTS))
    # Each request bans what it would pick second (as its end id, before min_tokens) and fourth (a bad word).
    params = [
        SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0, end_id=out[1], bad_token_ids=((out[3],),))
        for out in plain
    ]
    runner = engine.runner  # type: ignore[attr-defined]
    redone_rows: list[int] = []
    compute_logits = runner.model.compute_logits

    def counting(rows):  # type: ignore[no-untyped-def]
        redone_rows.append(rows.shape[0])
        return compute_logits(rows)

    monkeypatch.setattr(runner.model, "compute_logits", counting)
    fast = _outputs(engine, params)
    # the three second tokens clash in the same decode step; most rows never need the logits
    assert redone_rows[0] == len(PROMPTS) and sum(redone_rows) < 6 * len(PROMPTS) // 2
    monkeypatch.setattr(runner.model, "greedy_tokens", lambda hidden: None)  # the full-logits path
    reference = _outputs(engine, params)
    assert fast == reference
    for out, p, ref in zip(fast, params, plain, strict=True):
        assert out[0] == ref[0] and out[1] != p.end_id and p.bad_token_ids[0][0] not in out
