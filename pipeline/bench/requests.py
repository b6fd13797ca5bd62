"""One request of a benchmark workload, as every client and peer receives it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. At least one of `prompt` / `input_ids` is set."""

    index: int
    output_tokens: int  # intended output length (sent as max_tokens, and min_tokens when forced)
    input_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    # The ids are `prompt` as one user turn of the tokenizer's chat template: servers that take text are
    # asked to apply it (apply_chat_template), so every target prefills the same ids.
    chat: bool = False

    @property
    def num_input_tokens(self) -> int:
        return len(self.input_ids) if self.input_ids is not None else 0
