"""The lm-eval endpoint gate: lm-evaluation-harness scores a served OpenAI API (`llmpipe serve`'s, or any
OpenAI-compatible server of the same checkpoint) and its own `hf` model on the build's checkpoint, on the
tasks shipped in pipeline/data/eval/lm_eval/; every score must equal hf's within the stderr lm-eval
reports (the larger of the two, times validation.lm_eval.max_stderr).

Generation tasks go through `local-chat-completions` with the chat template on both sides; log-likelihood
tasks through `local-completions`, which sends token-id prompts with echo and logprobs."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.config.build_config import BuildConfig, LmEvalSection
from pipeline.errors import AccuracyRegression, ServingError
from pipeline.validate.lm_eval_run import LmEvalRun, Score, run_lm_eval

REPORT_FILE = "lm_eval.json"
# What counts as the same score when lm-eval reports a stderr of 0 (every document scored alike).
_EQUAL = 1e-9


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model id GET {base_url}/models lists; ServingError when nothing answers."""
    request = urllib.request.Request(f"{base_url}/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return str(json.load(reply)["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError) as err:
        raise ServingError(
            f"no OpenAI API answers at {base_url}/models: {err}",
            hint="start one with `llmpipe serve CONFIG` (its API is at http://127.0.0.1:9000/v1)",
        ) from None


def plan_runs(section: LmEvalSection, base_url: str, model: str, checkpoint: Path) -> list[LmEvalRun]:
    """The endpoint's runs and hf's, one per kind of task (chat / completions) that has tasks."""
    tokenizer = str(checkpoint.resolve())
    api = {"model": model, "num_concurrent": "1", "max_retries": "2", "timeout": "600"}
    hf_args = {"pretrained": tokenizer, "dtype": "float32"}
    hf_extra = ("--device", "cpu", "--batch_size", "1")
    runs = []
    if section.chat_tasks:
        chat = {**api, "base_url": f"{base_url}/chat/completions"}
        runs.append(LmEvalRun("endpoint-chat", "local-chat-completions", chat, section.chat_tasks, True))
        runs.append(LmEvalRun("hf-chat", "hf", hf_args, section.chat_tasks, True, hf_extra))
    if section.completion_tasks:
        completions = {
            **api,
            "base_url": f"{base_url}/completions",
            "tokenizer": tokenizer,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": "True",
        }
        tasks = section.completion_tasks
        runs.append(LmEvalRun("endpoint-completions", "local-completions", completions, tasks, False))
        runs.append(LmEvalRun("hf-completions", "hf", hf_args, tasks, False, hf_extra))
    return runs


def compare(
    endpoint: dict[str, dict[str, Score]], hf: dict[str, dict[str, Score]], max_stderr: float
) -> list[dict[str, Any]]:
    """One row per task and metric: both scores, the allowed difference and the verdict."""
    rows = []
    for task, metrics in endpoint.items():
        for metric, served in metrics.items():
            reference = hf[task].get(metric)
            if reference is None:
                continue
            stderrs = [s for s in (served.stderr, reference.stderr) if s is not None]
            allowed = max_stderr * max(stderrs, default=0.0)
            difference = abs(served.value - reference.value)
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "endpoint": served.value,
                    "hf": reference.value,
                    "stderr": max(stderrs, default=None),
                    "allowed": allowed,
                    "status": "pass" if difference <= allowed + _EQUAL else "fail",
                }
            )
    return rows


def run_gate(cfg: BuildConfig, python: Path, base_url: str, checkpoint: Path, out: Path) -> dict[str, Any]:
    """Run every lm-eval pass with `python` (lm_eval_python's), write out/lm_eval.json, return the report
    (not raising on failure)."""
    section = cfg.validation.lm_eval
    base_url = base_url.rstrip("/")
    api_key = os.environ.get("LLMPIPE_API_KEY")
    model = served_model(base_url, api_key)
    endpoint: dict[str, dict[str, Score]] = {}
    hf: dict[str, dict[str, Score]] = {}
    seconds: dict[str, float] = {}
    # lm-eval's API models send OPENAI_API_KEY as the bearer token: the server's key, when it has one.
    os.environ.setdefault("OPENAI_API_KEY", api_key or "unused")
    for run in plan_runs(section, base_url, model, checkpoint):
        start = time.monotonic()
        scores = run_lm_eval(python, run, out, section.include_path, section.limit)
        seconds[run.name] = round(time.monotonic() - start, 1)
        (hf if run.model == "hf" else endpoint).update(scores)
    rows = compare(endpoint, hf, section.max_stderr)
    report = {
        "build": cfg.name,
        "endpoint": base_url,
        "model": model,
        "checkpoint": str(checkpoint),
        "limit": section.limit,
        "max_stderr": section.max_stderr,
        "passed": bool(rows) and all(r["status"] == "pass" for r in rows),
        "rows": rows,
        "seconds": seconds,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report


def format_table(report: dict[str, Any]) -> list[str]:
    lines = [f"lm-eval of {report['endpoint']} ({report['model']}) vs hf on {report['checkpoint']}"]
    lines.append(f"  {'task':<18} {'metric':<22} {'endpoint':>9} {'hf':>9} {'allowed':>9}  status")
    for row in report["rows"]:
        status = row["status"].upper() if row["status"] == "fail" else row["status"]
        lines.append(
            f"  {row['task']:<18} {row['metric']:<22} {row['endpoint']:>9.4f} {row['hf']:>9.4f} "
            f"{row['allowed']:>9.4f}  {status}"
        )
    lines.append("PASSED" if report["passed"] else "FAILED")
    return lines


def raise_for_failure(report: dict[str, Any], path: Path) -> None:
    failed = [r for r in report["rows"] if r["status"] == "fail"]
    if report["passed"]:
        return
    details = "; ".join(
        f"{r['task']} {r['metric']}: endpoint {r['endpoint']:.4f} vs hf {r['hf']:.4f}, allowed ±{r['allowed']:.4f}"
        for r in failed
    )
    raise AccuracyRegression(
        f"lm-eval scores of {report['endpoint']} differ from hf's beyond their stderr: {details or 'no scores'}",
        hint=f"per-run logs and lm-eval's results are in {path.parent}; the bound is "
        "validation.lm_eval.max_stderr",
    )
