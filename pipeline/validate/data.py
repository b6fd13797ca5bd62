"""The evaluation set: held-out text (perplexity, KL, top-1), summarization items (ROUGE) and short factual
questions (exact match), plus the prompts both the engine and the reference are given.

`validation.dataset: builtin` reads pipeline/data/eval/ (written for llmpipe, Apache-2.0; see its README).
Any other value is a JSONL file, one object per line tagged by "task":
  {"task": "text", "text": "..."}                                  held-out text (concatenated in order)
  {"task": "summarize", "article": "...", "summary": "..."}         reference summary
  {"task": "qa", "question": "...", "answers": ["...", ...]}        any answer counts as exact
  {"task": "qa", ..., "shot": true}                                 a worked example put before every question
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, MissingArtifactError
from pipeline.util.files import read_jsonl
from pipeline.util.package_data import DATA_DIR

BUILTIN_DIR = DATA_DIR / "eval"


@dataclass(frozen=True)
class SummaryItem:
    id: str
    article: str
    summary: str  # the human-written reference summary


@dataclass(frozen=True)
class QAItem:
    id: str
    question: str
    answers: tuple[str, ...]  # an output matching any of these (after normalisation) is correct


@dataclass(frozen=True)
class EvalSet:
    origin: str  # "builtin" or the JSONL path, recorded in validation.json
    text: str
    summaries: list[SummaryItem] = field(default_factory=list)
    questions: list[QAItem] = field(default_factory=list)
    shots: list[QAItem] = field(default_factory=list)  # few-shot examples, never scored

    def summarize_prompt(self, item: SummaryItem) -> str:
        return f"Article: {item.article}\n\nA one-sentence summary of the article above:\n"

    def qa_prompt(self, item: QAItem) -> str:
        # Few-shot "Question/Answer" lines make models answer in a word or two on one line, which is what
        # exact match scores; the answer is read up to the first newline.
        examples = "".join(f"Question: {s.question}\nAnswer: {s.answers[0]}\n\n" for s in self.shots)
        return f"{examples}Question: {item.question}\nAnswer:"


def load_eval_set(dataset: str) -> EvalSet:
    """The builtin set, or a task-tagged JSONL file (relative paths are relative to the current directory)."""
    if dataset == "builtin":
        return _load_builtin()
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise MissingArtifactError(
            f"validation.dataset={dataset}: file not found",
            hint='Use `builtin` or a JSONL file with one {"task": "text"|"summarize"|"qa", ...} per line.',
        )
    return _from_records(_read_jsonl(path), origin=str(path))


def _load_builtin() -> EvalSet:
    records: list[dict[str, Any]] = [
        {"task": "text", "text": (BUILTIN_DIR / "heldout.txt").read_text("utf-8")}
    ]
    records += [{"task": "summarize", **r} for r in _read_jsonl(BUILTIN_DIR / "summarize.jsonl")]
    records += [{"task": "qa", **r} for r in _read_jsonl(BUILTIN_DIR / "qa.jsonl")]
    return _from_records(records, origin="builtin")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [{"_where": where, **record} for where, record in read_jsonl(path)]


def _from_records(records: list[dict[str, Any]], origin: str) -> EvalSet:
    texts: list[str] = []
    summaries: list[SummaryItem] = []
    questions: list[QAItem] = []
    shots: list[QAItem] = []
    for index, record in enumerate(records):
        where = record.get("_where", f"{origin} record {index + 1}")
        task = record.get("task")
        item_id = str(record.get("id", f"{task}-{index + 1}"))
        if task == "text":
            texts.append(_field(record, "text", where))
        elif task == "summarize":
            summaries.append(
                SummaryItem(item_id, _field(record, "article", where), _field(record, "summary", where))
            )
        elif task == "qa":
            answers = record.get("answers")
            if (
                not isinstance(answers, list)
                or not answers
                or not all(isinstance(a, str) and a for a in answers)
            ):
                raise ConfigError(f"{where}: qa needs a non-empty list of non-empty strings in `answers`")
            qa = QAItem(item_id, _field(record, "question", where), tuple(answers))
            (shots if record.get("shot") else questions).append(qa)
        else:
            raise ConfigError(f"{where}: task={task!r} is invalid: must be one of text, summarize, qa")
    if not texts:
        raise ConfigError(f'{origin}: no {{"task": "text"}} record: perplexity needs held-out text')
    return EvalSet(origin, "\n\n".join(texts), summaries, questions, shots)


def _field(record: dict[str, Any], name: str, where: str) -> str:
    value = record.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: field `{name}` must be a non-empty string")
    return value


def text_windows(token_ids: list[int], window: int, max_windows: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows of `window` tokens (the tail shorter than 2 tokens is dropped)."""
    windows = [token_ids[i : i + window] for i in range(0, len(token_ids), window)]
    return [w for w in windows if len(w) >= 2][:max_windows]
