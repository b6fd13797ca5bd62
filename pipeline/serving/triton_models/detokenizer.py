"""Incremental detokenization: token ids arrive a few at a time, text leaves only once it is final.

Decoding tokens one by one garbles text: a multi-byte character split over several byte-level tokens
decodes to U+FFFD pieces, and SentencePiece tokenizers drop the space of a word that starts a decode call.
So each step decodes a short window that begins a few tokens back (giving spaces their context) and emits
only what the window adds beyond the text already emitted; text ending in U+FFFD (an incomplete
character) is held back until the next tokens complete it, or until `flush()` at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Tokens of already-emitted context decoded again with each step; enough for any tokenizer's merge rules.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, context_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(context_ids)
        self.num_context = len(self.token_ids)
        # token_ids[prefix_offset:read_offset] is the already-emitted context of the next window;
        # token_ids[read_offset:] are tokens whose text is not emitted yet.
        self.prefix_offset = max(0, len(self.token_ids) - CONTEXT_TOKENS)
        self.read_offset = len(self.token_ids)

    @property
    def num_emitted_tokens(self) -> int:
        """New tokens (beyond the context) whose text has been emitted."""
        return self.read_offset - self.num_context

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) - self.num_context

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens))

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        emitted = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        if not final and (len(text) <= len(emitted) or text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = text[len(emitted) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta

    def add(self, new_ids: Sequence[int]) -> str:
        """Append tokens; the text they complete ('' while a character is still incomplete)."""
        self.token_ids.extend(int(t) for t in new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text of every token not emitted yet, incomplete characters included (end of a request)."""
        return self._advance(final=True)


def decode_all(
    tokenizer: Any,
    token_ids: Sequence[int],
    context_ids: Sequence[int] = (),
    skip_special_tokens: bool = True,
) -> str:
    """The text the incremental path would emit for all of `token_ids`, in one call."""
    detok = IncrementalDetokenizer(tokenizer, context_ids, skip_special_tokens)
    return detok.add(token_ids) + detok.flush()
