"""Prompt text as the BLS will see it, and its token ids (usage.prompt_tokens, echo, the 413 check)."""

from __future__ import annotations

from pipeline.serving.openai.errors import APIError, bad_request
from pipeline.serving.openai.model_info import ModelInfo
from pipeline.serving.openai.schemas import Message, check_utf8
from pipeline.serving.triton_models.tokenization import (
    ChatTemplateLimitError,
    render_chat,
    special_token_text,
)


def chat_prompt(info: ModelInfo, messages: list[Message]) -> str:
    """The conversation through the tokenizer's chat template, ready for the assistant's turn."""
    tokenizer = info.encoder.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("messages", "this model's tokenizer has no chat template: use /v1/completions")
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    for index, turn in enumerate(turns):
        check_utf8("messages", turn["content"])
        # The BLS takes text and reads every special token's text in it as that token, so a user's
        # `<|im_end|>` would end the turn: refused rather than passed on as a control token.
        special = special_token_text(tokenizer, turn["content"])
        if special is not None:
            raise bad_request(
                "messages",
                f"messages[{index}].content contains {special!r}, the text of one of the model's control "
                "tokens: remove it",
            )
    try:
        text = render_chat(tokenizer, turns)
    except ChatTemplateLimitError as err:
        raise bad_request("messages", f"messages: the chat template failed: {err}") from None
    # The BLS encodes text_input with the tokenizer's special tokens; a template that writes BOS itself
    # would get a second one, so leave BOS to the encoder.
    bos = getattr(tokenizer, "bos_token", None)
    if bos and info.encoder.add_special_tokens and text.startswith(bos) and info.encoder_adds_bos:
        text = text[len(bos) :]
    return text


def prompt_ids(info: ModelInfo, prompt: str | list[int], param: str) -> list[int]:
    """The prompt's token ids as the BLS will use them (text encoded as it encodes it; ids as sent); 413
    beyond the engine's max_input_len."""
    if not prompt:
        raise bad_request(param, f"{param}: the prompt is empty")
    if isinstance(prompt, str):
        check_utf8(param, prompt)
        tokenizer = info.encoder.tokenizer
        ids = list(tokenizer.encode(prompt, add_special_tokens=info.encoder.add_special_tokens))
    else:
        ids, vocab = prompt, len(info.encoder.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                param, f"{param}: token ids {bad[:5]} are not in this model's vocabulary [0, {vocab})"
            )
    if len(ids) > info.max_input_len:
        raise APIError(
            413,
            f"{param}: the prompt is {len(ids)} tokens, more than this model's limit of "
            f"{info.max_input_len} input tokens (max_input_len)",
            param=param,
            code="context_length_exceeded",
        )
    return ids


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
