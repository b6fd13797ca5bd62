"""The scaling sweep: its grid and bounds, the engine limits it asks for, and a run over a fake streaming
target that turns into the table and the plot."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.bench import sweep
from pipeline.bench.comparisons import measurements
from pipeline.bench.metrics import DraftCounts
from pipeline.bench.requests import BenchRequest


def test_plan_is_the_grid_with_one_wave_per_point() -> None:
    points, left_out = sweep.plan((4, 1, 64), (2048, 128), max_wave_tokens=None)
    assert left_out == []
    assert [(p.prompt_tokens, p.concurrency) for p in points] == [
        (128, 1),
        (128, 4),
        (128, 64),
        (2048, 1),
        (2048, 4),
        (2048, 64),
    ]
    # one request per user, but never a single sample
    assert [p.num_requests for p in points[:3]] == [2, 4, 64]
    assert points[0].workload == "sweep-p128"


def test_default_plan_covers_1_to_64_users_and_128_to_2048_tokens_within_the_prefill_budget() -> None:
    points, left_out = sweep.plan()
    assert len(points) + len(left_out) == 7 * 4
    assert {p.concurrency for p in points} == {1, 2, 4, 8, 16, 32, 64}
    assert {p.prompt_tokens for p in points} == {128, 512, 1024, 2048}
    assert all(p.num_requests * p.prompt_tokens <= sweep.MAX_WAVE_TOKENS for p in points)
    assert [(p.concurrency, p.prompt_tokens) for p in left_out] == [(64, 1024), (32, 2048), (64, 2048)]
    assert sum(p.num_requests * p.prompt_tokens for p in points) < 250_000


@pytest.mark.parametrize(
    ("concurrencies", "prompts"), [((), (128,)), ((1,), ()), ((0,), (128,)), ((1,), (-5,))]
)
def test_plan_refuses_empty_or_non_positive_values(
    concurrencies: tuple[int, ...], prompts: tuple[int, ...]
) -> None:
    with pytest.raises(ValueError):
        sweep.plan(concurrencies, prompts)


def test_build_overrides_admit_the_largest_point() -> None:
    points, _ = sweep.plan((1, 32), (128, 1024))
    assert sweep.build_overrides(points, 16) == [
        "engine.max_batch_size=32",
        "engine.max_input_len=1024",
        "engine.max_seq_len=1040",
    ]


def test_requests_have_the_points_prompt_length() -> None:
    point = sweep.plan((3,), (300,))[0][0]
    requests = sweep.requests_for(point, 8, tokenizer=None)
    assert len(requests) == 3
    assert all(r.num_input_tokens == 300 and r.output_tokens == 8 for r in requests)


class SlowPrefillTarget:
    """Streams one token per 1 ms after a TTFT that grows with the prompt: enough to tell points apart."""

    name = "fake"

    def stream(self, request: BenchRequest) -> Iterator[int | DraftCounts]:
        time.sleep(request.num_input_tokens / 100_000)
        for _ in range(request.output_tokens):
            time.sleep(0.001)
            yield 1


def test_run_section_and_plot(tmp_path: Path) -> None:
    points, _ = sweep.plan((1, 2), (100, 1000))
    extra: dict[str, object] = {"engine": "fake", "precision": "fp32", "path": "inprocess"}
    results = sweep.run(SlowPrefillTarget(), points, 4, None, extra, progress=False)
    assert [(r.extra["prompt_tokens"], r.concurrency) for r in results] == [
        (100, 1),
        (100, 2),
        (1000, 1),
        (1000, 2),
    ]
    assert all(r.metrics().num_completed == 2 and r.metrics().num_errors == 0 for r in results)
    ttft = {r.extra["prompt_tokens"]: r.metrics().ttft_s for r in results if r.concurrency == 1}
    assert ttft[1000] is not None and ttft[100] is not None and ttft[1000].mean > ttft[100].mean
    # sweep keys carry their workload, so they never stand in for the main rows' keys
    keys = measurements(results)
    assert "fake.fp32.inprocess.sweep-p100.c2_tok_s" in keys and "fake.fp32.single_decode_tok_s" not in keys
    text = sweep.section(results, 4, "run/sweep.png", sweep.plan((8,), (5000,), max_wave_tokens=100)[1])
    assert "| prompt tokens | concurrency |" in text and "![sweep](run/sweep.png)" in text
    assert "Left out (a wave over the prefill budget, --sweep-max-tokens): c=8 x 5000." in text
    assert text.count("\n| 1000 |") == 2
    png = sweep.plot(tmp_path / "run" / "sweep.png", results)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
