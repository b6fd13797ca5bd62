"""OpenAI's response objects: whole completions, stream chunks, usage, and the SSE framing."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class Shape:
    """One response's identity and kind: chat ("chat.completion") or text ("text_completion")."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> Shape:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(chat, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(
        self,
        text: str,
        finish_reason: str | None,
        used: dict[str, int],
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text}
            head = self._head("text_completion")
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return {**head, "choices": [choice], "usage": used}

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One streamed choice delta (`text` None: no content in it)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta}
            head = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or ""}
            head = self._head("text_completion")
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return {**head, "choices": [choice]}

    def usage_chunk(self, used: dict[str, int]) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk, with no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": used}
