"""Runs the eval set through the reference and a target (in-process engine or Triton endpoint) and turns
the outputs into metrics. Only this module knows which model call each metric needs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from pipeline.validate import metrics as M
from pipeline.validate.data import EvalSet, text_windows
from pipeline.validate.reference import ReferenceModel

logger = logging.getLogger(__name__)

# Answers are a few words: 16 tokens hold any of them; more only adds rambling after the answer line.
QA_MAX_NEW_TOKENS = 16
HELDOUT_WINDOW = 128  # tokens per held-out window: a paragraph of context, cheap on any engine

SKIP_REASON_ENDPOINT = (
    "needs the logits of every position of a given token sequence; the Triton ensemble returns generated "
    "text and the log-probs of sampled tokens only (TensorRT-LLM exposes context logits only with "
    "gather_context_logits, which the ensemble does not pass through)"
)
# The held-out text's metrics (_heldout); with greedy_agreement, every metric that needs the target's logits.
HELDOUT_METRICS = ("top1_agreement", "mean_kl", "ppl_delta_pct")
TOKEN_METRICS = ("greedy_agreement", *HELDOUT_METRICS)


@runtime_checkable
class TextTarget(Protocol):
    name: str

    def generate_text(self, prompts: list[str], max_new_tokens: int, stop_ids: list[int]) -> list[str]:
        """Greedy completions of text prompts (prompt not included), ending at any of `stop_ids`."""
        ...


@runtime_checkable
class TokenTarget(Protocol):
    name: str
    max_input_len: int  # longest sequence `score` and a prompt may have

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position: row i predicts token i+1. [len(token_ids), vocab]."""
        ...

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        """Greedy continuations (stop id included when reached)."""
        ...


@dataclass
class Measurement:
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # positions/items behind each metric
    skipped: dict[str, str] = field(default_factory=dict)  # metric -> why it was not measured
    samples: list[dict[str, Any]] = field(default_factory=list)  # per generation: prompt id, texts, scores
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Settings:
    num_samples: int
    max_new_tokens: int


def measure(
    evalset: EvalSet, reference: ReferenceModel, target: TokenTarget | TextTarget, settings: Settings
) -> Measurement:
    result = Measurement()
    summaries = evalset.summaries[: settings.num_samples]
    questions = evalset.questions[: settings.num_samples]
    groups = [
        ("summarize", [evalset.summarize_prompt(s) for s in summaries], settings.max_new_tokens),
        ("qa", [evalset.qa_prompt(q) for q in questions], min(QA_MAX_NEW_TOKENS, settings.max_new_tokens)),
    ]
    generations = _generate(reference, target, groups, result)
    _score_texts(evalset, summaries, questions, generations, result)
    if not isinstance(target, TokenTarget):
        for name in TOKEN_METRICS:
            result.skipped[name] = SKIP_REASON_ENDPOINT
        return result
    _teacher_forced(target, generations, result)
    _heldout(evalset, reference, target, settings.num_samples, result)
    return result


@dataclass
class _Generation:
    task: str
    prompt_ids: list[int]
    reference_ids: list[int]
    reference_text: str
    engine_text: str


def _generate(
    reference: ReferenceModel,
    target: TokenTarget | TextTarget,
    groups: list[tuple[str, list[str], int]],
    result: Measurement,
) -> list[_Generation]:
    tokenizer = reference.tokenizer
    out: list[_Generation] = []
    ref_seconds = eng_seconds = 0.0
    for task, prompts, max_new in groups:
        if not prompts:
            continue
        prompt_ids = [tokenizer(p).input_ids for p in prompts]
        logger.info(
            "%s: %d prompts x up to %d new tokens, reference then engine", task, len(prompts), max_new
        )
        start = time.monotonic()
        ref_ids = reference.generate(prompt_ids, max_new)
        ref_seconds += time.monotonic() - start
        start = time.monotonic()
        if isinstance(target, TokenTarget):
            eng_ids = target.generate(prompt_ids, max_new, reference.stop_ids)
            eng_texts = [_decode(tokenizer, ids) for ids in eng_ids]
        else:
            eng_texts = target.generate_text(prompts, max_new, reference.stop_ids)
        eng_seconds += time.monotonic() - start
        for p_ids, r_ids, e_text in zip(prompt_ids, ref_ids, eng_texts, strict=True):
            out.append(_Generation(task, p_ids, r_ids, _decode(tokenizer, r_ids), e_text))
    result.seconds.update(reference_generate=ref_seconds, engine_generate=eng_seconds)
    return out


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def _score_texts(
    evalset: EvalSet,
    summaries: list[Any],
    questions: list[Any],
    generations: list[_Generation],
    result: Measurement,
) -> None:
    items = list(summaries) + list(questions)
    totals: dict[str, float] = {}
    same = 0
    for item, gen in zip(items, generations, strict=True):
        sample: dict[str, Any] = {
            "id": item.id,
            "task": gen.task,
            "reference_output": gen.reference_text,
            "engine_output": gen.engine_text,
        }
        same += gen.reference_text.strip() == gen.engine_text.strip()
        if gen.task == "summarize":
            for side, text in (("reference", gen.reference_text), ("engine", gen.engine_text)):
                for name, value in M.rouge_scores(text, item.summary).items():
                    sample[f"{name}_{side}"] = round(value, 3)
                    totals[f"{name}_{side}"] = totals.get(f"{name}_{side}", 0.0) + value
        else:
            for side, text in (("reference", gen.reference_text), ("engine", gen.engine_text)):
                hit = M.exact_match(text, item.answers)
                sample[f"exact_match_{side}"] = hit
                totals[f"exact_match_{side}"] = totals.get(f"exact_match_{side}", 0.0) + hit
        result.samples.append(sample)
    if summaries:
        for key in [k for k in totals if k.startswith("rouge")]:
            result.metrics[key] = totals[key] / len(summaries)
        result.metrics["rougeL_drop"] = result.metrics["rougeL_reference"] - result.metrics["rougeL_engine"]
        result.counts["rougeL_drop"] = len(summaries)
    else:
        result.skipped["rougeL_drop"] = f"the eval set ({evalset.origin}) has no summarize items"
    if questions:
        for side in ("reference", "engine"):
            result.metrics[f"exact_match_{side}"] = totals[f"exact_match_{side}"] / len(questions)
        result.counts["exact_match_engine"] = len(questions)
    if generations:
        result.metrics["output_match"] = same / len(generations)
        result.counts["output_match"] = len(generations)


def _teacher_forced(target: TokenTarget, generations: list[_Generation], result: Measurement) -> None:
    """Feed the engine each prompt plus the reference's greedy continuation; count matching argmaxes. One
    early divergence then costs one position, not the rest of the sequence."""
    logger.info("teacher-forced greedy agreement: scoring %d continuations on the engine", len(generations))
    start = time.monotonic()
    matches = positions = 0
    for gen in generations:
        if not gen.reference_ids:
            continue
        sequence = gen.prompt_ids + gen.reference_ids[:-1]
        logits = target.score(sequence)[len(gen.prompt_ids) - 1 :]  # [len(reference_ids), vocab]
        matches += M.greedy_matches(logits, gen.reference_ids)
        positions += len(gen.reference_ids)
    if positions:
        result.metrics["greedy_agreement"] = matches / positions
        result.counts["greedy_agreement"] = positions
    else:
        result.skipped["greedy_agreement"] = "no prompts in the eval set"
    result.seconds["teacher_forced"] = time.monotonic() - start


def leading_special_ids(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before every text (Llama's and Gemma's BOS). Each held-out
    window starts with them as a prompt would: Gemma scored without its BOS is far off its trained
    distribution (perplexity in the hundreds on English prose)."""
    marked = tokenizer("a", verbose=False).input_ids
    plain = tokenizer("a", add_special_tokens=False, verbose=False).input_ids
    if not plain or plain[0] not in marked:
        return []
    return list(marked[: marked.index(plain[0])])


def _heldout(
    evalset: EvalSet, reference: ReferenceModel, target: TokenTarget, num_windows: int, result: Measurement
) -> None:
    logger.info("held-out text: up to %d windows of %d tokens on both models", num_windows, HELDOUT_WINDOW)
    start = time.monotonic()
    token_ids = reference.tokenizer(evalset.text, add_special_tokens=False, verbose=False).input_ids
    lead = leading_special_ids(reference.tokenizer)
    window = min(HELDOUT_WINDOW, target.max_input_len) - len(lead)
    stats = M.TokenStats()
    for chunk in text_windows(token_ids, window, num_windows):
        ids = [*lead, *chunk]
        ref_logits = reference.score(ids)[:-1]  # [len(ids)-1, vocab]
        eng_logits = target.score(ids)[:-1]
        stats = stats.merge(M.next_token_stats(ref_logits, eng_logits, ids[1:]))
    result.seconds["heldout"] = time.monotonic() - start
    if not stats.num_positions:
        for name in HELDOUT_METRICS:
            result.skipped[name] = f"the held-out text of {evalset.origin} is shorter than 2 tokens"
        return
    result.metrics.update(
        top1_agreement=stats.top1_agreement,
        mean_kl=stats.mean_kl,
        ppl_reference=stats.ref_perplexity,
        ppl_engine=stats.engine_perplexity,
        ppl_delta_pct=M.delta_pct(stats.ref_perplexity, stats.engine_perplexity),
    )
    for name in HELDOUT_METRICS:
        result.counts[name] = stats.num_positions
