"""Accuracy metrics as pure functions: token-level comparisons of engine and reference logits, perplexity,
ROUGE-1/2/L and exact match.

Token-level functions return sums and counts, not means, so samples of different lengths aggregate into
one micro-average (every scored position weighs the same), the way perplexity is defined over a corpus.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from dataclasses import dataclass

import torch


@dataclass
class TokenStats:
    """Sums over scored positions of held-out text; `merge` to aggregate windows."""

    num_positions: int = 0
    kl_sum: float = 0.0  # sum of KL(reference || engine) in nats
    top1_matches: int = 0  # positions where both argmaxes agree
    ref_nll_sum: float = 0.0  # sum of -log p_reference(actual next token)
    engine_nll_sum: float = 0.0

    def merge(self, other: TokenStats) -> TokenStats:
        return TokenStats(
            self.num_positions + other.num_positions,
            self.kl_sum + other.kl_sum,
            self.top1_matches + other.top1_matches,
            self.ref_nll_sum + other.ref_nll_sum,
            self.engine_nll_sum + other.engine_nll_sum,
        )

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.num_positions

    @property
    def top1_agreement(self) -> float:
        return self.top1_matches / self.num_positions

    @property
    def ref_perplexity(self) -> float:
        return perplexity(self.ref_nll_sum, self.num_positions)

    @property
    def engine_perplexity(self) -> float:
        return perplexity(self.engine_nll_sum, self.num_positions)


def next_token_stats(
    ref_logits: torch.Tensor, engine_logits: torch.Tensor, next_ids: list[int]
) -> TokenStats:
    """Compare two models' next-token distributions at the same positions of the same text.

    ref_logits, engine_logits: [num_positions, vocab], row i predicting next_ids[i].
    """
    if ref_logits.shape != engine_logits.shape or ref_logits.shape[0] != len(next_ids):
        raise ValueError(
            f"shape mismatch: reference {tuple(ref_logits.shape)}, engine {tuple(engine_logits.shape)}, "
            f"{len(next_ids)} next tokens"
        )
    # float64: the KL of two fp32 runs that differ only in summation order is ~1e-9 and must not drown in
    # rounding noise of the subtraction below.
    ref_logp = torch.log_softmax(ref_logits.double(), dim=-1)  # [N, V]
    eng_logp = torch.log_softmax(engine_logits.double(), dim=-1)  # [N, V]
    kl = (ref_logp.exp() * (ref_logp - eng_logp)).sum(dim=-1)  # [N]
    targets = torch.tensor(next_ids, dtype=torch.long).unsqueeze(1)  # [N, 1]
    return TokenStats(
        num_positions=len(next_ids),
        kl_sum=float(kl.sum()),
        top1_matches=int((ref_logits.argmax(-1) == engine_logits.argmax(-1)).sum()),
        ref_nll_sum=float(-ref_logp.gather(1, targets).sum()),
        engine_nll_sum=float(-eng_logp.gather(1, targets).sum()),
    )


def greedy_matches(engine_logits: torch.Tensor, reference_ids: list[int]) -> int:
    """Teacher-forced greedy agreement, count form: positions where the engine's argmax, fed the reference's
    greedy continuation so far, equals the reference's next token. engine_logits: [N, vocab]."""
    if engine_logits.shape[0] != len(reference_ids):
        raise ValueError(f"{engine_logits.shape[0]} logit rows for {len(reference_ids)} reference tokens")
    return int((engine_logits.argmax(-1) == torch.tensor(reference_ids, dtype=torch.long)).sum())


def perplexity(nll_sum: float, num_positions: int) -> float:
    return math.exp(nll_sum / num_positions)


def delta_pct(reference: float, engine: float) -> float:
    """Relative change of the engine's value from the reference's, in percent (positive = engine higher)."""
    return (engine - reference) / reference * 100.0


# --- text metrics -------------------------------------------------------------------------------------

_WORD = re.compile(r"[^\W_]+")  # runs of letters/digits in any script; punctuation and "_" separate words


def words(text: str) -> list[str]:
    """ROUGE tokenisation: lowercase words; punctuation and whitespace only separate them (no stemming)."""
    return _WORD.findall(text.lower())


def f_measure(matches: int, num_predicted: int, num_reference: int) -> float:
    """Harmonic mean of precision matches/num_predicted and recall matches/num_reference (0 when empty)."""
    if matches == 0:
        return 0.0
    precision, recall = matches / num_predicted, matches / num_reference
    return 2 * precision * recall / (precision + recall)


def rouge_n(prediction: str, reference: str, n: int) -> float:
    """ROUGE-N F-measure: clipped n-gram overlap, each reference n-gram matching at most as often as it occurs."""
    pred, ref = _ngrams(words(prediction), n), _ngrams(words(reference), n)
    matches = sum((pred & ref).values())
    return f_measure(matches, sum(pred.values()), sum(ref.values()))


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure: longest common subsequence of words (in order, gaps allowed)."""
    pred, ref = words(prediction), words(reference)
    return f_measure(lcs_length(pred, ref), len(pred), len(ref))


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F-measures in points (x100), the scale TensorRT-LLM's summarize.py reports and gates on."""
    return {
        "rouge1": 100.0 * rouge_n(prediction, reference, 1),
        "rouge2": 100.0 * rouge_n(prediction, reference, 2),
        "rougeL": 100.0 * rouge_l(prediction, reference),
    }


def _ngrams(tokens: list[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def lcs_length(a: list[str], b: list[str]) -> int:
    # One row of the classic dynamic programme: row[j] = LCS of a[:i] and b[:j].
    row = [0] * (len(b) + 1)
    for token in a:
        diagonal = 0
        for j, other in enumerate(b, 1):
            diagonal, row[j] = row[j], diagonal + 1 if token == other else max(row[j], row[j - 1])
    return row[-1]


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD-style: lowercase, drop punctuation and English articles, collapse whitespace."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def first_line(text: str) -> str:
    """The answer part of a generated completion: up to the first newline, surrounding spaces removed."""
    return text.strip().split("\n", 1)[0].strip()


def exact_match(prediction: str, answers: tuple[str, ...] | list[str]) -> bool:
    """The first line of `prediction`, normalised, equals one of the normalised answers."""
    predicted = normalize_answer(first_line(prediction))
    return any(predicted == normalize_answer(answer) for answer in answers)
