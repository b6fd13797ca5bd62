"""lm-evaluation-harness as a subprocess of its own virtual environment (it needs numpy 2; llmpipe's
serving stack needs numpy < 2), on the task YAMLs shipped in pipeline/data/eval/lm_eval/, and the scores it
writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import MissingArtifactError, PipelineError
from pipeline.util.package_data import DATA_DIR

# lm-eval runs here, so the YAMLs' data_files (qa.jsonl, choice.jsonl) resolve to the shipped eval set.
EVAL_DATA_DIR = DATA_DIR / "eval"
TASKS_DIR = EVAL_DATA_DIR / "lm_eval"
INSTALL_HINT = "run `make eval-deps` (lm-eval 0.4.13 with the CPU torch in its own venv)"


@dataclass(frozen=True)
class Score:
    value: float
    stderr: float | None  # lm-eval's bootstrap/analytic stderr; None when it reports none


@dataclass(frozen=True)
class LmEvalRun:
    """One lm-eval invocation: a model (`--model`, `--model_args`) on some tasks."""

    name: str  # the log's and results folder's name
    model: str
    model_args: dict[str, str]
    tasks: list[str]
    chat: bool  # --apply_chat_template --fewshot_as_multiturn
    extra: tuple[str, ...] = ()  # further lm-eval flags


def lm_eval_python(venv: str) -> Path:
    """The eval venv's interpreter, checked to import lm_eval; MissingArtifactError saying how to install."""
    root = Path(venv).absolute()  # not resolve(): the venv's python is a link to the base interpreter
    python = root / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    if not python.is_file():
        raise MissingArtifactError(
            f"lm-eval is not installed: no virtual environment at validation.lm_eval.venv={venv!r}",
            hint=INSTALL_HINT,
        )
    probe = subprocess.run([str(python), "-c", "import lm_eval"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise MissingArtifactError(
            f"the virtual environment {venv} cannot import lm_eval: {probe.stderr.strip().splitlines()[-1:]}",
            hint=INSTALL_HINT,
        )
    return python


def run_lm_eval(
    python: Path, run: LmEvalRun, out: Path, include_path: str | None, limit: int | None
) -> dict[str, dict[str, Score]]:
    """Run lm-eval once; task -> metric -> score. PipelineError naming the log when it fails."""
    result_dir, log = out / run.name, out / f"{run.name}.log"
    argv = [
        str(python), "-m", "lm_eval", "--model", run.model,
        "--model_args", ",".join(f"{k}={v}" for k, v in run.model_args.items()),
        "--tasks", ",".join(run.tasks), "--include_path", str(TASKS_DIR),
        "--output_path", str(result_dir.resolve()), "--seed", "1234", *run.extra,
    ]  # fmt: skip
    if include_path is not None:
        argv += ["--include_path", str(Path(include_path).resolve())]
    if run.chat:
        argv += ["--apply_chat_template", "--fewshot_as_multiturn"]
    if limit is not None:
        argv += ["--limit", str(limit)]
    out.mkdir(parents=True, exist_ok=True)
    # Everything offline: the tasks' data ship with llmpipe, the checkpoint is local.
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w", encoding="utf-8") as sink:
        done = subprocess.run(argv, cwd=EVAL_DATA_DIR, env=env, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
        raise PipelineError(
            f"lm-eval ({run.name}) exited with {done.returncode}: {' '.join(tail)}",
            hint=f"the whole output is in {log}",
        )
    return parse_results(_newest_results(result_dir), run.tasks)


def _newest_results(result_dir: Path) -> dict[str, Any]:
    found = sorted(result_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise PipelineError(f"lm-eval wrote no results_*.json under {result_dir}")
    data: dict[str, Any] = json.loads(found[-1].read_text(encoding="utf-8"))
    return data


def parse_results(data: dict[str, Any], tasks: list[str]) -> dict[str, dict[str, Score]]:
    """lm-eval's `results` ("acc,none": 0.8, "acc_stderr,none": 0.06, ...) -> task -> metric -> Score."""
    scores: dict[str, dict[str, Score]] = {}
    for task in tasks:
        metrics = data["results"].get(task)
        if metrics is None:
            raise PipelineError(f"lm-eval's results have no task {task!r}")
        scores[task] = {}
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or metric.endswith("_stderr") or not isinstance(value, int | float):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filter_name}")
            name = metric if filter_name == "none" else f"{metric}[{filter_name}]"
            scores[task][name] = Score(
                float(value), float(stderr) if isinstance(stderr, int | float) else None
            )
    return scores
