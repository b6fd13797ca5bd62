"""How `llmpipe bench` counts the tokens of the Triton ensemble's streamed responses: exactly by their
log-probs when a run asks for them, else as genai-perf does, each response's text tokenized on its own."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from pipeline.bench.clients.triton import EnsembleCounting


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _response(text: str, log_probs: list[float] | None = None) -> Any:
    outputs = {
        "text_output": np.array([text.encode()], dtype=object),
        "output_log_probs": None if log_probs is None else np.array([[log_probs]], np.float32),
    }
    return outputs.get


def _token_texts(tokenizer: Any, text: str) -> list[str]:
    """The text of each of `text`'s tokens, as an engine streams them one a step."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])) :] for i in range(len(ids))]


TEXT = "The quick brown fox jumps over the lazy dog, twice."


def test_a_stream_of_one_token_a_response_counts_every_token(tokenizer: Any) -> None:
    pieces = _token_texts(tokenizer, TEXT)
    assert len(pieces) > 5 and "".join(pieces) == TEXT
    counting = EnsembleCounting(tokenizer=tokenizer)
    assert [counting.tokens(_response(p)) for p in pieces] == [1] * len(pieces)


def test_a_response_of_several_steps_counts_each_of_them(tokenizer: Any) -> None:
    pieces = _token_texts(tokenizer, TEXT)
    steps = ["".join(pieces[i : i + 4]) for i in range(0, len(pieces), 4)]  # a stream interval of 4
    counts = [EnsembleCounting(tokenizer=tokenizer).tokens(_response(step)) for step in steps]
    assert counts[:-1] == [4] * (len(steps) - 1) and sum(counts) == len(pieces)


def test_a_word_split_over_two_responses_counts_as_generated(tokenizer: Any) -> None:
    # "Hello" sent a character a response: five tokens generated, though the word re-tokenizes to fewer
    assert len(tokenizer("Hello", add_special_tokens=False)["input_ids"]) < 5
    counting = EnsembleCounting(tokenizer=tokenizer)
    assert [counting.tokens(_response(c)) for c in "Hello"] == [1] * 5


def test_a_response_without_text_counts_nothing(tokenizer: Any) -> None:
    # a character held back over a split, or a stream's closing response
    assert EnsembleCounting(tokenizer=tokenizer).tokens(_response("")) == 0


def test_without_a_tokenizer_each_response_with_text_is_one_token() -> None:
    counting = EnsembleCounting()
    assert [counting.tokens(_response(t)) for t in ("ab cd ef", "", "g")] == [1, 0, 1]


def test_with_log_probs_their_values_count_and_the_text_does_not(tokenizer: Any) -> None:
    counting = EnsembleCounting(log_probs=True, tokenizer=tokenizer)
    assert counting.tokens(_response("three tokens here and more", [-0.1, -0.2, -0.3])) == 3
    assert counting.tokens(_response("flushed", [])) == 0  # a closing response that only flushes text


def test_streams_share_the_tokenizer_from_many_threads(tokenizer: Any) -> None:
    counting = EnsembleCounting(tokenizer=tokenizer)
    pieces = _token_texts(tokenizer, TEXT * 8)
    steps = ["".join(pieces[i : i + 2]) for i in range(0, len(pieces), 2)]
    totals: list[int] = []

    def stream() -> None:
        totals.append(sum(counting.tokens(_response(step)) for step in steps))

    threads = [threading.Thread(target=stream) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert totals == [len(pieces)] * 16
