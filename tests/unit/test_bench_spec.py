"""`llmpipe bench` and speculative decoding: acceptance rate and accepted tokens per step from the engine's
draft counts (in-process outputs, Triton outputs), the code-edit / summarize workloads, `--speculation`
sweeps in-process with their measurement keys and ratios, the spec columns of the table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.bench import report, suite
from pipeline.bench.clients.inprocess import InProcessTarget
from pipeline.bench.clients.triton import draft_counts, ensemble_token_count
from pipeline.bench.comparisons import SPECULATION_COMPARISONS, compare, measurements
from pipeline.bench.load import RunResult, run_closed_loop
from pipeline.bench.metrics import DraftCounts, RequestRecord, summarize
from pipeline.bench.requests import BenchRequest
from pipeline.bench.workloads import chat_ids, make_workload
from pipeline.cli.main import main
from pipeline.errors import ConfigError, MissingArtifactError
from pipeline.runtime.engine.engine_args import EngineArgs, SpeculationArgs
from tests.serving_helpers import build_tiny_engine, tiny_config

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = str(REPO_ROOT / "build_configs" / "tiny-llama.yaml")
# room for the code-edit prompts (up to ~600 tiny-tokenizer tokens)
LONG_PROMPTS = {"engine": {"max_input_len": 900, "max_seq_len": 1024, "max_num_tokens": 1024}}


def _record(tokens: list[int], drafts: DraftCounts | None) -> RequestRecord:
    times = [0.1 * (i + 1) for i in range(len(tokens))]
    return RequestRecord(0, 10, 0.0, times[-1], times, tokens, drafts=drafts)


def test_acceptance_rate_and_accepted_tokens_per_step_pool_the_requests() -> None:
    # 9 outputs with 4 accepted drafts: 8 - 4 = 4 decode steps; 5 outputs with 0 accepted: 4 steps
    records = [_record([1, 3, 2, 3], DraftCounts(6, 4)), _record([1, 1, 1, 1, 1], DraftCounts(2, 0))]
    m = summarize(records, 1.0)
    assert m.acceptance_rate == pytest.approx(4 / 8)
    assert m.accepted_tokens_per_step == pytest.approx(4 / 8)
    assert m.to_dict()["acceptance_rate"] == m.acceptance_rate
    nothing_drafted = summarize([_record([1, 1], DraftCounts(0, 0))], 1.0)
    plain = summarize([_record([1, 1], None)], 1.0)
    for metrics in (nothing_drafted, plain):
        assert metrics.acceptance_rate is None and metrics.accepted_tokens_per_step is None


def test_table_shows_the_speculation_columns_only_when_some_run_speculated() -> None:
    speculated = RunResult("a", "closed", 1, None, [_record([1, 2], DraftCounts(2, 1))])
    plain = RunResult("b", "closed", 1, None, [_record([1, 1], None)])
    rows = [report.summary_row(r) for r in (speculated, plain)]
    text = report.format_table(rows, report.columns_for(rows))
    assert "accept rate" in text and "accepted/step" in text and "0.5" in text
    plain_rows = [report.summary_row(plain)]
    assert "accept rate" not in report.format_table(plain_rows, report.columns_for(plain_rows))
    markdown = report.columns_for(rows, report.MARKDOWN_COLUMNS)
    assert [key for key, _ in markdown].count("decode_tok_s_per_user") == 1


def test_triton_outputs_become_token_counts_and_draft_counts() -> None:
    assert ensemble_token_count(np.zeros((1, 1, 3), np.float32)) == 3  # a 3-token speculative step
    assert ensemble_token_count([[[-0.1, -0.2]]]) == 2  # the same, from generate_stream's JSON
    assert ensemble_token_count(None) == 1  # a deployment that returns no log-probs: one per response
    assert ensemble_token_count(np.zeros((1, 1, 0))) == 0  # a closing response that only flushes text
    assert draft_counts(np.array([[7]], np.int32), np.array([[5]], np.int32)) == DraftCounts(7, 5)
    assert draft_counts([7], [5]) == DraftCounts(7, 5)
    assert draft_counts(None, None) is None


def test_speculation_sweep_keys_and_ratios() -> None:
    def run(mode: str, workload: str, gap: float) -> RunResult:
        recs = [_record([1] * 5, DraftCounts(4, 2) if mode != "none" else None)]
        for i, rec in enumerate(recs):
            rec.response_times = [0.1 + gap * k for k in range(5)]
            rec.end = rec.response_times[-1] + i
        extra = {"engine": "llmpipe", "precision": "fp32", "path": "inprocess", "workload": workload}
        return RunResult("x", "closed", 1, None, recs, extra={**extra, "speculation": mode})

    found = measurements(
        [
            run("none", "code-edit", 0.04),
            run("ngram", "code-edit", 0.02),  # 2x the decode speed
            run("none", "builtin", 0.04),
            run("ngram", "builtin", 0.05),  # 0.8x
        ]
    )
    assert found["llmpipe.fp32.inprocess.code-edit.ngram.single_decode_tok_s"] == pytest.approx(50.0)
    assert found["llmpipe.fp32.inprocess.code-edit.ngram.c1_acceptance_rate"] == pytest.approx(0.5)
    assert "llmpipe.fp32.inprocess.code-edit.none.c1_acceptance_rate" not in found
    assert "llmpipe.fp32.single_decode_tok_s" not in found  # a side study never sets the peers' key
    ratios = {r.comparison.key: r.value for r in compare(SPECULATION_COMPARISONS, found)}
    assert ratios["prompt_lookup_on_input_copying"] == pytest.approx(2.0)
    assert ratios["prompt_lookup_when_drafts_are_rejected"] == pytest.approx(0.8)


def test_copying_workloads_are_prompt_text_tokenized_through_the_chat_template(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    edits, _ = make_workload("code-edit", 12, 0, None, None, 0, tokenizer, chat_template=True)
    assert all("```python\n" in (r.prompt or "") and r.output_tokens == 256 for r in edits)
    assert len({r.prompt for r in edits}) == 12  # twelve different functions
    assert list(edits[1].input_ids or ()) == chat_ids(tokenizer, edits[1].prompt or "")
    plain, _ = make_workload("code-edit", 1, 0, None, None, 0, tokenizer)
    assert plain[0].input_ids == tuple(tokenizer.encode(plain[0].prompt, add_special_tokens=False))
    summaries, _ = make_workload("summarize", 3, 0, None, None, 0, tokenizer)
    assert all((r.prompt or "").startswith("Article: ") and r.output_tokens == 64 for r in summaries)


def test_speculation_args_follow_the_config(tiny_llama_dir: Path, in_tmp_workdir: Path) -> None:
    spec = {"mode": "ngram", "max_draft_len": 6, "adaptive": False, "ngram": {"min_match": 2, "max_match": 4}}
    cfg = tiny_config(tiny_llama_dir, speculative=spec)
    assert suite.speculation_args(cfg, "none") == SpeculationArgs(mode="none")
    assert suite.speculation_args(cfg, "ngram") == SpeculationArgs(
        mode="ngram", max_draft_len=6, adaptive=False, ngram_min_match=2, ngram_max_match=4
    )
    with pytest.raises(ConfigError, match="needs speculative.draft_config"):
        suite.speculation_args(cfg, "draft_model")
    with pytest.raises(ConfigError, match="'lookahead' cannot run in-process"):
        suite.speculation_args(cfg, "lookahead")
    (in_tmp_workdir / "draft.yaml").write_text(f"name: d\nsource: {{kind: local, path: {tiny_llama_dir}}}\n")
    drafted = tiny_config(tiny_llama_dir, speculative={**spec, "draft_config": "draft.yaml"})
    with pytest.raises(MissingArtifactError, match="no engine output at build/d/engine"):
        suite.speculation_args(drafted, "draft_model")  # the draft was never built


@pytest.fixture(scope="module")
def engine_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_engine(tiny_llama_dir, tmp_path_factory.mktemp("bench-spec"), **LONG_PROMPTS)


def test_in_process_target_reports_the_engines_drafts(engine_dir: Path) -> None:
    requests = [
        BenchRequest(index=i, output_tokens=24, input_ids=tuple([5, 6, 7, 8] * (3 + i))) for i in range(3)
    ]
    cases = {
        "none": SpeculationArgs(mode="none"),
        "ngram": SpeculationArgs(mode="ngram", max_draft_len=4),
        # the tiny model as its own draft: greedy drafts are always accepted
        "self-draft": SpeculationArgs(mode="draft_model", max_draft_len=3, draft_engine_dir=engine_dir),
    }
    metrics = {}
    for name, speculation in cases.items():
        target = InProcessTarget.from_engine_dir(engine_dir, engine_args=EngineArgs(speculation=speculation))
        try:
            result = run_closed_loop(target, requests, concurrency=2)
        finally:
            target.close()
        assert all(r.ok and r.num_output_tokens == 24 for r in result.records)
        assert all((r.drafts is None) == (name == "none") for r in result.records)
        metrics[name] = result.metrics()
    assert metrics["none"].acceptance_rate is None
    assert metrics["ngram"].acceptance_rate is not None and 0.0 <= metrics["ngram"].acceptance_rate <= 1.0
    assert metrics["self-draft"].acceptance_rate == 1.0
    assert metrics["self-draft"].accepted_tokens_per_step is not None
    assert 1.0 < metrics["self-draft"].accepted_tokens_per_step <= 3.0


def test_bench_command_sweeps_speculation_on_the_code_edit_workload(
    tiny_llama_dir: Path,
    engine_dir: Path,
    capsys: pytest.CaptureFixture[str],
    in_tmp_workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipeline.bench import builds

    monkeypatch.setattr(builds, "fetched_checkpoint", lambda cfg: tiny_llama_dir)
    monkeypatch.setattr(builds, "stage_output", lambda cfg, stage: engine_dir)  # the draft too: a self-draft
    out_dir = in_tmp_workdir / "results"
    argv = [
        "bench", TINY_CONFIG, "--in-process", "--dataset", "code-edit", "--requests", "2", "--output-mean", "12",
        "--concurrency", "1", "--warmup", "0", "--speculation", "none,ngram,draft_model",
        "--set", f"speculative.draft_config={TINY_CONFIG}", "--set", "speculative.max_draft_len=3",
        "--out", str(out_dir), "--no-plots", "--no-progress",
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out = capsys.readouterr().out
    assert exit_info.value.code in (0, None)
    assert "llmpipe-fp32-none" in out and "llmpipe-fp32-ngram" in out and "llmpipe-fp32-draft_model" in out
    assert "accept rate" in out and "accepted/step" in out
    assert "prompt lookup vs without, code-edit workload" in out  # the ratio, judged by no goal
    assert "status" not in out and ">=" not in out
    data = json.loads((out_dir / "results.json").read_text())
    assert data["meta"]["speculation"] == ["none", "ngram", "draft_model"]
    found = data["measurements"]
    assert [r["comparison"] for r in data["ratios"]] == ["prompt_lookup_on_input_copying"]
    assert found["llmpipe.fp32.inprocess.code-edit.draft_model.c1_acceptance_rate"] == 1.0
    assert "llmpipe.fp32.inprocess.code-edit.none.single_decode_tok_s" in found
    assert "llmpipe.fp32.inprocess.code-edit.ngram.single_decode_tok_s" in found


def test_speculation_needs_in_process(capsys: pytest.CaptureFixture[str], in_tmp_workdir: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", TINY_CONFIG, "--speculation", "none,ngram"])
    assert exit_info.value.code == 2 and "--speculation needs --in-process" in capsys.readouterr().err
