"""Text <-> token ids for serving: prompts, stop/bad word lists, end/pad ids (the preprocessing side).

The tokenizer is the engine's own copy (`<engine>/tokenizer/`), loaded offline with Hugging Face's
AutoTokenizer; end ids come from its generation_config.json when present, because that is where chat
models declare the turn-end token they actually stop on (Llama-3's `<|eot_id|>`).
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from pipeline.serving.triton_models.io import InvalidInputError, sequences_to_word_list

GENERATION_CONFIG = "generation_config.json"
# A chat template is code from the checkpoint: Jinja's sandbox keeps it from Python, not from looping for
# hours or writing gigabytes. Its rendering stops at these limits (a normal template takes milliseconds).
MAX_TEMPLATE_SECONDS = 1.0
MAX_TEMPLATE_CHARS = 8 << 20


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_config(path: Path) -> dict[str, Any]:
    config = path / "tokenizer_config.json"
    return json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}


def _transformers_4_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """from_pretrained overrides under transformers 4 (TensorRT-LLM's pin) for a tokenizer saved by
    transformers 5, which writes its list of added special tokens as `extra_special_tokens`: transformers 4
    reads that key as a dict of named tokens (and fails on a list) and calls the list
    `additional_special_tokens`."""
    extra = config.get("extra_special_tokens")
    if not isinstance(extra, list):
        return {}
    return {"extra_special_tokens": {}, "additional_special_tokens": extra}


def load_tokenizer(path: str | Path) -> Any:
    """The HF tokenizer in `path`, offline, never running repository code; pad falls back to eos.

    NOTE: a generic fast tokenizer is loaded through its own class, not AutoTokenizer: AutoTokenizer
    imports torch (via AutoConfig), which costs each Triton stub ~3 s to start and seconds to stop.
    """
    path = Path(path)
    config = _tokenizer_config(path)
    TokenizerClass: Any  # noqa: N806
    try:
        from transformers import TokenizersBackend as TokenizerClass

        kwargs: dict[str, Any] = {}
    except ImportError:  # transformers < 5
        from transformers import PreTrainedTokenizerFast as TokenizerClass

        kwargs = _transformers_4_kwargs(config)
    generic = (
        config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file()
    )
    if not generic:
        from transformers import AutoTokenizer as TokenizerClass
    tokenizer = TokenizerClass.from_pretrained(
        str(path), local_files_only=True, trust_remote_code=False, padding_side="left", **kwargs
    )
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _as_ids(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]  # type: ignore[attr-defined]


def end_ids(tokenizer: Any, tokenizer_dir: str | Path) -> list[int]:
    """End-of-generation ids: generation_config.json's eos_token_id (int or list), else the tokenizer's."""
    path = Path(tokenizer_dir) / GENERATION_CONFIG
    if path.is_file():
        ids = _as_ids(json.loads(path.read_text(encoding="utf-8")).get("eos_token_id"))
        if ids:
            return ids
    return _as_ids(tokenizer.eos_token_id)


def decode_text(name: str, raw: object) -> str:
    """A STRING tensor element (bytes from Triton) as text; invalid UTF-8 is the client's error."""
    if isinstance(raw, str):
        return raw
    data = bytes(raw)  # type: ignore[call-overload]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidInputError(
            name,
            data[max(0, err.start - 8) : err.start + 8],
            f"not valid UTF-8 (bad byte at offset {err.start})",
        ) from None


def decode_words(name: str, row: object) -> list[str]:
    """Every string of a (possibly absent) BYTES input, decoded as `decode_text` does."""
    return [] if row is None else [decode_text(name, w) for w in np.asarray(row).reshape(-1)]


class ChatTemplateLimitError(ValueError):
    """Rendering the chat template went past MAX_TEMPLATE_SECONDS or MAX_TEMPLATE_CHARS."""


@contextmanager
def template_limits(max_seconds: float, max_chars: int) -> Iterator[None]:
    """Stop Jinja templates rendered in this thread past `max_seconds` or `max_chars` of output.

    NOTE: a trace function on the frames of compiled templates (filename "<template>") sees every line they
    run, loop iterations included, and every chunk a template generator yields (a 'return' event); raising
    there aborts the render. Other frames are not traced, so the cost is a call per template line.
    """
    deadline = time.monotonic() + max_seconds
    num_chars = 0

    def trace_line(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal num_chars
        if event == "return" and isinstance(arg, str) and frame.f_code.co_flags & inspect.CO_GENERATOR:
            num_chars += len(arg)
            if num_chars > max_chars:
                raise ChatTemplateLimitError(f"its output passed the limit of {max_chars} characters")
        if time.monotonic() > deadline:
            raise ChatTemplateLimitError(f"it ran past the limit of {max_seconds:g} s")
        return trace_line

    def trace_call(frame: FrameType, event: str, arg: Any) -> Any:
        return trace_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(trace_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """`messages` through the tokenizer's chat template, ready for the assistant's turn, within the limits
    (ChatTemplateLimitError beyond them)."""
    with template_limits(MAX_TEMPLATE_SECONDS, MAX_TEMPLATE_CHARS):
        return str(tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True))


def special_token_text(tokenizer: Any, text: str) -> str | None:
    """The special token (`<|im_end|>`, `</s>`) whose text occurs first in `text`, if any."""
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    found = sorted((text.find(s), -len(s), s) for s in specials if s in text)
    return found[0][2] if found else None


def _content_spans(
    tokenizer: Any, messages: Sequence[dict[str, str]], text: str
) -> list[tuple[int, int, int]]:
    """(start, end, message index) of each message's content in `text`, their rendering, in text order:
    found by rendering again with a marker in place of each content, so a content that repeats the
    template's own text is not mistaken for it. A template that does not copy each content verbatim, once
    (one that trims them), is refused."""
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    skeleton = render_chat(
        tokenizer, [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
    )
    pieces = re.split("(\ue000\\d+\ue001)", skeleton)
    spans, rebuilt = [], ""
    for piece in pieces:
        if piece in marks:
            index = marks.index(piece)
            content = messages[index]["content"]
            spans.append((len(rebuilt), len(rebuilt) + len(content), index))
            piece = content
        rebuilt += piece
    if rebuilt != text or sorted(i for _, _, i in spans) != list(range(len(messages))):
        raise InvalidInputError(
            "messages",
            "(special-token text)",
            "a message content holds special-token text and this chat template does not copy contents "
            "verbatim, so it cannot be kept as plain text: remove it",
        )
    return spans


def encode_chat_text(tokenizer: Any, messages: Sequence[dict[str, str]], text: str) -> list[int]:
    """The ids of `text`, the rendering of `messages`, in which special-token text typed into a content (a
    user writing `<|im_end|>`) is plain text, as HF's `split_special_tokens` reads it, while the template's
    own markers stay control tokens. Without such text this is exactly `tokenizer.encode(text)`."""
    injected = [special_token_text(tokenizer, m["content"]) is not None for m in messages]
    if not any(injected):
        return list(tokenizer.encode(text, add_special_tokens=False))
    ids: list[int] = []
    cursor = 0
    for start, end, index in _content_spans(tokenizer, messages, text):
        if injected[index]:
            ids += tokenizer.encode(text[cursor:start], add_special_tokens=False) if start > cursor else []
            ids += tokenizer.encode(text[start:end], add_special_tokens=False, split_special_tokens=True)
            cursor = end
    if cursor < len(text):
        ids += tokenizer.encode(text[cursor:], add_special_tokens=False)
    return ids


@dataclass
class PromptEncoder:
    """What preprocessing and the BLS share: prompt text -> ids, word strings -> word lists, end/pad ids."""

    tokenizer: Any
    end_ids: list[int]
    add_special_tokens: bool = True
    max_input_len: int | None = None
    _word_cache: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, tokenizer_dir: str | Path, **options: Any) -> PromptEncoder:
        tokenizer = load_tokenizer(tokenizer_dir)
        return cls(tokenizer, end_ids(tokenizer, tokenizer_dir), **options)

    @property
    def end_id(self) -> int:
        return self.end_ids[0] if self.end_ids else -1

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else self.end_id

    def encode_prompt(self, text: str, name: str = "text_input", chat: bool = False) -> list[int]:
        """The prompt's ids: `text` as sent (tensorrtllm_backend's behaviour), or with `chat` as one user
        turn of the tokenizer's chat template."""
        if not text:
            raise InvalidInputError(name, "''", "the prompt is empty")
        if chat:
            ids = self.encode_chat([{"role": "user", "content": text}])
        else:
            ids = list(self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens))
        if not ids:
            raise InvalidInputError(name, text, "encodes to no tokens")
        if self.max_input_len is not None and len(ids) > self.max_input_len:
            raise InvalidInputError(
                name,
                f"{len(text)} characters",
                f"the prompt is {len(ids)} tokens, more than the engine's max_input_len={self.max_input_len}",
            )
        return ids

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The ids of `messages` through the chat template (which writes BOS itself), the contents' special-
        token text as plain text (encode_chat_text)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidInputError("apply_chat_template", True, "the tokenizer has no chat template")
        from jinja2 import TemplateError

        try:
            return encode_chat_text(self.tokenizer, messages, render_chat(self.tokenizer, messages))
        except (ChatTemplateLimitError, TemplateError) as err:
            raise InvalidInputError("apply_chat_template", True, f"the chat template failed: {err}") from None

    def encode_word(self, word: str) -> tuple[int, ...]:
        if word not in self._word_cache:
            self._word_cache[word] = tuple(self.tokenizer.encode(word, add_special_tokens=False))
        return self._word_cache[word]

    def word_list(self, words: Sequence[str], extra: Sequence[Sequence[int]] = ()) -> np.ndarray:
        """Stop or bad words as tensorrtllm_backend's `[2, L]` word list; empty strings are ignored."""
        sequences = [self.encode_word(w) for w in words if w]
        return sequences_to_word_list([s for s in sequences if s] + [list(e) for e in extra])

    def default_stop_sequences(self, client_end_id: int | None) -> list[list[int]]:
        """Extra end ids (beyond the first) become one-token stop words, unless the client chose end_id."""
        return [] if client_end_id is not None else [[i] for i in self.end_ids[1:]]
