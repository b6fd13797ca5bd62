"""Benchmark workloads (seeded synthetic lengths, JSONL datasets, the shipped prompts) and report files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.bench import workloads as w
from pipeline.bench.load import RunResult
from pipeline.bench.metrics import RequestRecord
from pipeline.errors import ConfigError, MissingArtifactError


def test_synthetic_is_seeded_and_respects_length_specs() -> None:
    spec_in, spec_out = w.LengthSpec(100, 30, low=10, high=150), w.LengthSpec.between(16, 64)
    first = w.synthetic(50, spec_in, spec_out, seed=3, vocab_size=500)
    assert first == w.synthetic(50, spec_in, spec_out, seed=3, vocab_size=500)
    assert first != w.synthetic(50, spec_in, spec_out, seed=4, vocab_size=500)
    assert all(10 <= r.num_input_tokens <= 150 and 16 <= r.output_tokens <= 64 for r in first)
    assert len({r.output_tokens for r in first}) > 10  # uniform, not fixed
    assert all(100 <= t < 500 for r in first for t in r.input_ids or ())
    fixed = w.synthetic(3, w.LengthSpec(7), w.LengthSpec(5), seed=0)
    assert [(r.num_input_tokens, r.output_tokens) for r in fixed] == [(7, 5)] * 3


def test_synthetic_with_tokenizer_cuts_windows_of_real_text(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    requests = w.tokenize(
        w.synthetic(4, w.LengthSpec(40), w.LengthSpec(8), seed=1, tokenizer=tokenizer), tokenizer
    )
    corpus = tokenizer.encode(
        "\n\n".join(json.loads(line)["prompt"] for line in w.SHIPPED_PROMPTS.read_text().splitlines()),
        add_special_tokens=False,
    )
    text = " ".join(map(str, corpus))
    for r in requests:
        assert r.num_input_tokens == 40 and r.prompt
        assert " ".join(map(str, r.input_ids or ())) in text


def test_shipped_prompts_are_valid_and_overridable() -> None:
    prompts = w.shipped_prompts()
    assert len(prompts) >= 40
    assert all(r.prompt and r.output_tokens >= 16 for r in prompts)
    assert {r.output_tokens for r in w.shipped_prompts(output_tokens=32)} == {32}


def test_jsonl_dataset_reads_prompts_and_ids(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(
        '{"prompt": "hello there", "output_tokens": 5}\n\n{"input_ids": [1, 2, 3], "output_tokens": 7}\n'
    )
    first, second = w.load_jsonl(path)
    assert (first.prompt, first.output_tokens, first.input_ids) == ("hello there", 5, None)
    assert (second.input_ids, second.output_tokens) == ((1, 2, 3), 7)
    assert [r.index for r in w.cycle_to([first, second], 5)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x"}', "output_tokens must be an integer >= 1"),
        ('{"output_tokens": 3}', r'needs "prompt" \(text\) or "input_ids"'),
        ('{"input_ids": [], "output_tokens": 3}', "input_ids must be a non-empty list"),
        ("not json", "not valid JSON"),
        ("[1, 2]", "each line must be a JSON object"),
    ],
)
def test_jsonl_dataset_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "output_tokens": 4}\n' + line + "\n")
    with pytest.raises(ConfigError, match=message) as info:
        w.load_jsonl(path)
    assert ":2" in str(info.value)


def test_missing_dataset_and_untokenizable_text_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(MissingArtifactError, match="dataset not found"):
        w.load_jsonl(tmp_path / "none.jsonl")
    with pytest.raises(ConfigError, match="no tokenizer"):
        w.tokenize([w.BenchRequest(index=0, output_tokens=3, prompt="hi")], None)


def _fake_run(system: str, concurrency: int, gap: float) -> RunResult:
    records = [
        RequestRecord(i, 10, 0.0, 0.2 + gap * 4, [0.2 + gap * k for k in range(5)], [1] * 5, 5)
        for i in range(concurrency)
    ]
    return RunResult(
        system, "closed", concurrency, None, records, extra={"engine": "llmpipe", "precision": "fp32"}
    )


def test_finish_writes_json_csv_plots_and_a_markdown_page(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from pipeline.bench import report, suite

    results = [_fake_run("a", 1, 0.02), _fake_run("a", 4, 0.03), _fake_run("b", 4, 0.05)]
    text, files = suite.finish(results, tmp_path, {"note": "test"})
    names = {f.name for f in files}
    assert {"results.json", "results.csv", "throughput_vs_concurrency.png", "latency_cdf.png"} <= names
    assert all(f.stat().st_size > 0 for f in files)
    assert "TTFT p95" in text and "c=4" in text
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["note"] == "test" and len(data["runs"]) == 3
    assert data["runs"][0]["ttft_mean_ms"] == pytest.approx(200.0)
    page = report.markdown_document("T", "cmd", ["a note"], results, [], ["x/latency_cdf.png"])
    assert "| system | load |" in page and "![latency_cdf](x/latency_cdf.png)" in page


def test_make_workload_sizes_overrides_and_distinct_warmup(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    requests, warmup = w.make_workload("builtin", 50, 2, None, w.LengthSpec(9), seed=0, tokenizer=tokenizer)
    assert len(requests) == 50 and {r.output_tokens for r in requests} == {9}
    assert all(r.input_ids and r.prompt for r in requests)
    assert len(warmup) == 2 and not {r.input_ids for r in warmup} & {r.input_ids for r in requests}
    synthetic_requests, no_warmup = w.make_workload(None, 3, 0, w.LengthSpec(20), None, 0, tokenizer)
    assert [r.num_input_tokens for r in synthetic_requests] == [20] * 3 and no_warmup == []
    assert {r.output_tokens for r in synthetic_requests} == {64}
    with pytest.raises(ConfigError, match="--input-mean shapes synthetic prompts"):
        w.make_workload("builtin", 3, 0, w.LengthSpec(20), None, 0, tokenizer)
