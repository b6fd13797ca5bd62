"""`llmpipe bench` counts a served ensemble's tokens by tokenizing each streamed response's text on its own.
With the shipped models' real tokenizers (SmolLM2's byte-level BPE, Gemma 3's SentencePiece), a stream of a
known token sequence, cut into responses as the engine streams them (one token a response, or several under
`serving.stream_interval`), is counted as generated: exactly for Gemma 3; for SmolLM2 within the tokens of
characters split over byte tokens (a held-back character's bytes arrive in one response)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from pipeline.bench.clients.triton import EnsembleCounting

pytestmark = pytest.mark.slow

TEXT = (
    "Serving overhead: the bench streams from the ensemble over gRPC and asks for text only, as a user's "
    "client does. Unbelievably, 16 streams of 128 tokens ran at 644.3 tok/s - 1.12x the rate with log-probs "
    "(x = 2 ** 10; print(f'{x:>8}')). Naïve café déjà vu, ≥ 0.9x, 日本語のテキスト, emoji 🚀 done.\n\n"
    "| system | tok/s |\n|---|---|\n| llmpipe | 60.0 |\n"
)


def _responses(tokenizer: Any, ids: list[int], interval: int) -> list[str]:
    """The texts an engine streams for `ids`, `interval` tokens a response, holding back a character whose
    bytes are not all out yet (its text then arrives with the next response)."""
    texts, sent = [], ""
    for end in [*range(interval, len(ids), interval), len(ids)]:
        text = tokenizer.decode(ids[:end])
        if text.endswith("\ufffd") and end < len(ids):
            texts.append("")
            continue
        texts.append(text[len(sent) :])
        sent = text
    return texts


def _counted(tokenizer: Any, texts: list[str]) -> int:
    counting = EnsembleCounting(tokenizer=tokenizer)
    responses = [{"text_output": np.array([t.encode()], dtype=object)}.get for t in texts]
    return sum(counting.tokens(r) for r in responses)


@pytest.mark.parametrize("interval", [1, 4, 8])
def test_gemma3_streams_are_counted_exactly(gemma3_hf_dir: Path, interval: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gemma3_hf_dir)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert _counted(tokenizer, _responses(tokenizer, ids, interval)) == len(ids)


@pytest.mark.parametrize("interval", [1, 4, 8])
def test_smollm2_streams_are_counted_within_split_characters(smollm2_hf_dir: Path, interval: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    # tokens that decode to part of a character: their response's text re-tokenizes to fewer
    partial = sum(1 for i in ids if "\ufffd" in tokenizer.decode([i]))
    counted = _counted(tokenizer, _responses(tokenizer, ids, interval))
    assert len(ids) - partial <= counted <= len(ids)
