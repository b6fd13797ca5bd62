"""Prompt text as the BLS will see it, and its token count (usage.prompt_tokens, the 413 check)."""

from __future__ import annotations

from pipeline.serving.openai.errors import APIError, bad_request
from pipeline.serving.openai.model_info import ModelInfo
from pipeline.serving.openai.schemas import Message, check_utf8


def chat_prompt(info: ModelInfo, messages: list[Message]) -> str:
    """The conversation through the tokenizer's chat template, ready for the assistant's turn."""
    tokenizer = info.encoder.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("messages", "this model's tokenizer has no chat template: use /v1/completions")
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    for turn in turns:
        check_utf8("messages", turn["content"])
    text = str(tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True))
    # The BLS encodes text_input with the tokenizer's special tokens; a template that writes BOS itself
    # would get a second one, so leave BOS to the encoder.
    bos = getattr(tokenizer, "bos_token", None)
    if bos and info.encoder.add_special_tokens and text.startswith(bos) and info.encoder_adds_bos:
        text = text[len(bos) :]
    return text


def count_prompt_tokens(info: ModelInfo, text: str, param: str) -> int:
    """Tokens in `text` as the BLS encodes it; 413 beyond the engine's max_input_len."""
    if not text:
        raise bad_request(param, f"{param}: the prompt is empty")
    check_utf8(param, text)
    count = len(info.encoder.tokenizer.encode(text, add_special_tokens=info.encoder.add_special_tokens))
    if count > info.max_input_len:
        raise APIError(
            413,
            f"{param}: the prompt is {count} tokens, more than this model's limit of "
            f"{info.max_input_len} input tokens (max_input_len)",
            param=param,
            code="context_length_exceeded",
        )
    return count


def completion_budget(info: ModelInfo, prompt_tokens: int, requested: int | None, default: int | None) -> int:
    """max_tokens to send: the request's, else `default`, else what the context leaves; 400 past it."""
    room = info.max_seq_len - prompt_tokens
    if requested is None:
        return max(1, min(default or room, room))
    if requested > room:
        raise bad_request(
            "max_tokens",
            f"max_tokens={requested}: the prompt ({prompt_tokens} tokens) plus max_tokens exceeds this model's "
            f"maximum context length of {info.max_seq_len} tokens",
            code="context_length_exceeded",
        )
    return requested
