"""The request bodies of /v1/completions and /v1/chat/completions: strict, unknown fields refused.

Fields OpenAI defines that this server does not implement are declared anyway (typed Any) so that
`unsupported()` can refuse them by name when a client sets them, rather than a generic "extra field"."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.serving.openai.errors import APIError, bad_request, not_supported
from pipeline.serving.openai.logprobs import MAX_TOP_LOGPROBS


def check_utf8(param: str, text: str) -> None:
    """400 for text that is not valid Unicode (a lone surrogate sent as a JSON escape), which the tokenizer
    and the BLS's UTF-8 tensors would otherwise fail on as a server error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise bad_request(
            param, f"{param}: not valid Unicode text ({err.reason} at position {err.start})"
        ) from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """What both endpoints share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo (completions)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # an extension: OpenAI has no top_k
    # an extension (vLLM's and trtllm-serve's name): no end before this many tokens; benchmarks force lengths
    min_tokens: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    n: int | None = Field(default=1, ge=1)  # null as OpenAI allows: one choice
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    logit_bias: dict[str, Any] | None = None

    # field -> (the values that mean "off", whether it may come later)
    OFF: ClassVar[dict[str, tuple[tuple[Any, ...], bool]]] = {"logit_bias": ((None, {}), False)}

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for stop in stops:
            check_utf8("stop", stop)
        return [s for s in stops if s]

    def unsupported(self) -> None:
        """Refuse what is parsed but not implemented, naming the field."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options", "stream_options is only allowed with stream: true")
        if self.n not in (None, 1):
            raise bad_request("n", f"n={self.n}: this server returns one choice per request (n=1 only)")
        for name, (off, later) in self.OFF.items():
            if getattr(self, name) not in off:
                raise not_supported(name, yet=later)
        if self.max_tokens == 0 and not getattr(self, "echo", False):
            raise bad_request("max_tokens", "max_tokens=0 is only allowed with echo: true (/v1/completions)")

    def top_logprobs_wanted(self) -> int | None:
        """None: no log-probs; else how many alternatives per token."""
        raise NotImplementedError


def _check_top(name: str, value: int | None) -> None:
    if value is not None and value > MAX_TOP_LOGPROBS:
        raise bad_request(name, f"{name}={value}: at most {MAX_TOP_LOGPROBS} alternatives per token")


class CompletionRequest(_Sampling):
    # text, or token ids (what lm-eval's local-completions sends); one prompt per request
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)  # legacy: log-probs with this many alternatives
    suffix: str | None = None
    best_of: int | None = None
    OFF: ClassVar[dict[str, tuple[tuple[Any, ...], bool]]] = {
        **_Sampling.OFF,
        "suffix": ((None, ""), False),
        "best_of": ((None, 1), False),
    }

    def unsupported(self) -> None:
        super().unsupported()
        _check_top("logprobs", self.logprobs)

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_input(self) -> str | list[int]:
        """The prompt's text, or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], int):
            return [int(t) for t in prompt]
        if len(prompt) != 1:
            raise bad_request("prompt", f"a list of {len(prompt)} prompts: send one prompt per request")
        first = prompt[0]
        return first if isinstance(first, str) else [int(t) for t in first]  # type: ignore[union-attr]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    OFF: ClassVar[dict[str, tuple[tuple[Any, ...], bool]]] = {
        **_Sampling.OFF,
        **{name: ((None,), False) for name in ("tools", "tool_choice", "functions", "function_call")},
        "parallel_tool_calls": ((None,), False),
        "response_format": ((None, {"type": "text"}), False),
    }

    def unsupported(self) -> None:
        super().unsupported()
        _check_top("top_logprobs", self.top_logprobs)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> int | None:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise bad_request("max_completion_tokens", "max_tokens and max_completion_tokens disagree")
        return self.max_completion_tokens or self.max_tokens


def parse(model: type[_Sampling], data: Any) -> Any:
    """The validated request, or a 400 naming the first wrong field."""
    if not isinstance(data, dict):
        raise bad_request(None, "the request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        message = "unknown parameter" if first["type"] == "extra_forbidden" else first["msg"]
        raise APIError(400, f"{param}: {message}", param=param, code="invalid_parameter") from None
    request.unsupported()
    return request
