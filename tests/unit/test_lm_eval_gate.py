"""The lm-eval gate's own logic without lm-eval: its results parsed, scores compared within stderr, the runs
it plans, its config section's checks, and the CLI's one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from pydantic import ValidationError

from pipeline.cli.main import cli
from pipeline.config.build_config import LmEvalSection
from pipeline.validate.lm_eval_gate import compare, plan_runs
from pipeline.validate.lm_eval_run import TASKS_DIR, Score, parse_results

# the shape lm-eval 0.4.13 writes (results_<time>.json), from a run of llmpipe_choice
RESULTS = {
    "results": {
        "llmpipe_choice": {
            "name": "llmpipe_choice", "alias": "llmpipe_choice", "sample_len": 40,
            "acc,none": 0.825, "acc_stderr,none": 0.0608, "acc_norm,none": 0.725, "acc_norm_stderr,none": 0.0715,
        },
        "llmpipe_qa": {"exact_match,none": 0.5, "exact_match_stderr,none": "N/A", "sample_len": 27},
    }
}  # fmt: skip


def test_results_are_parsed_per_task_and_metric() -> None:
    scores = parse_results(RESULTS, ["llmpipe_choice", "llmpipe_qa"])
    assert scores["llmpipe_choice"] == {"acc": Score(0.825, 0.0608), "acc_norm": Score(0.725, 0.0715)}
    assert scores["llmpipe_qa"] == {"exact_match": Score(0.5, None)}


def test_scores_agree_within_the_larger_stderr() -> None:
    hf = {"t": {"acc": Score(0.80, 0.06), "em": Score(0.5, 0.0), "same": Score(1.0, 0.0)}}
    served = {"t": {"acc": Score(0.85, 0.05), "em": Score(0.45, 0.0), "same": Score(1.0, 0.0)}}
    rows = {r["metric"]: r for r in compare(served, hf, max_stderr=1.0)}
    assert rows["acc"]["status"] == "pass" and rows["acc"]["allowed"] == pytest.approx(0.06)
    assert rows["em"]["status"] == "fail"  # no stderr: the scores must be equal
    assert rows["same"]["status"] == "pass"
    assert compare(served, hf, max_stderr=0.5)[0]["status"] == "fail"  # 0.05 > 0.5 * 0.06


def test_runs_use_chat_for_generation_and_token_ids_for_log_likelihood(tmp_path: Path) -> None:
    runs = {r.name: r for r in plan_runs(LmEvalSection(), "http://h:9000/v1", "m", tmp_path)}
    assert set(runs) == {"endpoint-chat", "hf-chat", "endpoint-completions", "hf-completions"}
    assert runs["endpoint-chat"].chat and runs["hf-chat"].chat and not runs["hf-completions"].chat
    assert runs["endpoint-chat"].model_args["base_url"] == "http://h:9000/v1/chat/completions"
    completions = runs["endpoint-completions"].model_args
    assert completions["tokenized_requests"] == "True" and completions["tokenizer"] == str(tmp_path.resolve())
    assert runs["hf-completions"].model_args["pretrained"] == str(tmp_path.resolve())
    assert {t.stem for t in TASKS_DIR.glob("*.yaml")} == {"llmpipe_qa", "llmpipe_choice"}


def test_config_names_the_fields_it_refuses() -> None:
    with pytest.raises(ValidationError, match="chat_tasks and validation.lm_eval.completion_tasks both"):
        LmEvalSection(chat_tasks=["llmpipe_qa"], completion_tasks=["llmpipe_qa"])
    with pytest.raises(ValidationError, match="set validation.lm_eval.include_path"):
        LmEvalSection(chat_tasks=["mmlu"])
    assert LmEvalSection(chat_tasks=["mine"], include_path="tasks").chat_tasks == ["mine"]


def test_cli_says_how_to_install_lm_eval(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"name": "c", "source": {"kind": "local", "path": str(tmp_path)}}))
    venv = tmp_path / "no-venv"
    result = CliRunner().invoke(
        cli,
        ["validate", str(config), "--openai-endpoint", "http://127.0.0.1:1/v1", "--set", f"validation.lm_eval.venv={venv}"],
    )  # fmt: skip
    assert result.exit_code == 1
    assert "lm-eval is not installed" in result.output and "make eval-deps" in result.output
    both = CliRunner().invoke(
        cli, ["validate", str(config), "--endpoint", "http://a:1", "--openai-endpoint", "http://b:2/v1"]
    )
    assert both.exit_code == 2 and "give one of them" in both.output
