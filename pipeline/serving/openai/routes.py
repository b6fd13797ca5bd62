"""The HTTP handlers: /v1/models, /health, /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pipeline.serving.openai.errors import APIError, bad_request, server_error
from pipeline.serving.openai.generation import Delta, Outcome, generate_deltas
from pipeline.serving.openai.logprobs import LogprobsView, prompt_logprobs
from pipeline.serving.openai.model_info import ModelInfo
from pipeline.serving.openai.prompts import chat_prompt, completion_budget, prompt_ids
from pipeline.serving.openai.responses import DONE, Shape, sse, usage
from pipeline.serving.openai.schemas import ChatRequest, CompletionRequest, parse
from pipeline.serving.openai.triton import TritonBls

log = logging.getLogger(__name__)
INFO = web.AppKey("info", ModelInfo)
BLS = web.AppKey("bls", TritonBls)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left


async def list_models(request: web.Request) -> web.Response:
    info = request.app[INFO]
    model = {"id": info.name, "object": "model", "created": 0, "owned_by": "llmpipe"}
    return web.json_response({"object": "list", "data": [model]})


async def health(request: web.Request) -> web.Response:
    ready = await request.app[BLS].ready()
    return web.json_response({"status": "ok" if ready else "unavailable"}, status=200 if ready else 503)


async def _body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(None, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:
        raise bad_request(None, "the request body nests too deeply", code="invalid_json") from None


def _bls_inputs(
    req: CompletionRequest | ChatRequest, prompt: str | list[int], max_tokens: int, info: ModelInfo
) -> dict:
    body: dict[str, Any] = {
        "text_input" if isinstance(prompt, str) else "input_ids": prompt,
        # echo with max_tokens 0 generates one token and shows none: the engine needs one
        "max_tokens": max(1, max_tokens),
        "stream": info.decoupled,  # streamed internally wherever possible: a stop string ends it early
        "exclude_input_in_output": True,
        "return_log_probs": True,  # one log-prob per token: how completion_tokens are counted
    }
    # Vocabulary-sized rows per token: asked for only when alternatives or prompt log-probs are wanted.
    top = req.top_logprobs_wanted()
    if top and req.max_tokens != 0:  # echo with max_tokens 0 shows no generated token
        body["return_generation_logits"] = True
    if top is not None and isinstance(req, CompletionRequest) and req.echo:
        body["return_context_logits"] = True
    sampling = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_tokens": req.min_tokens,
        "seed": req.seed,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
    }
    body.update({name: value for name, value in sampling.items() if value is not None})
    if req.stop_strings():
        body["stop_words"] = req.stop_strings()
    return body


async def completions(request: web.Request) -> web.StreamResponse:
    req = parse(CompletionRequest, await _body(request))
    info = request.app[INFO]
    _check_model(info, req.model)
    prompt = req.prompt_input()
    # Tokenizing off the event loop: a long prompt must not stall the other streams.
    ids = await asyncio.to_thread(prompt_ids, info, prompt, "prompt")
    max_tokens = completion_budget(info, len(ids), req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
    body = _bls_inputs(req, prompt, max_tokens, info)
    text = prompt if isinstance(prompt, str) else info.encoder.tokenizer.decode(ids)
    echo = Echo(text, ids, shown=req.echo)
    return await _answer(request, req, Shape.new(False, info.name), body, len(ids), echo)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = parse(ChatRequest, await _body(request))
    info = request.app[INFO]
    _check_model(info, req.model)
    prompt = await asyncio.to_thread(chat_prompt, info, req.messages)
    ids = await asyncio.to_thread(prompt_ids, info, prompt, "messages")
    max_tokens = completion_budget(info, len(ids), req.token_limit(), None)
    body = _bls_inputs(req, prompt, max_tokens, info)
    return await _answer(request, req, Shape.new(True, info.name), body, len(ids))


def _check_model(info: ModelInfo, model: str) -> None:
    if model != info.name:
        raise APIError(
            404, f"The model '{model}' does not exist (this server serves '{info.name}')",
            param="model", code="model_not_found",
        )  # fmt: skip


@dataclass
class Echo:
    """/v1/completions' prompt: with `echo` (`shown`) it goes first in the choice's text and log-probs;
    else the generated tokens' text offsets count from its end, as OpenAI's do."""

    text: str
    ids: list[int]
    shown: bool


class _Choice:
    """What one request's choice shows: echoed prompt, generated deltas (none for echo with max_tokens
    0), their log-probs when asked for."""

    def __init__(
        self, req: CompletionRequest | ChatRequest, shape: Shape, info: ModelInfo, echo: Echo | None
    ) -> None:
        self.top = req.top_logprobs_wanted()
        self.echo = echo if echo is not None and echo.shown else None
        self.show_generated = req.max_tokens != 0
        offset = len(echo.text) if echo is not None and not echo.shown else 0
        tokenizer = info.encoder.tokenizer
        self.view = None if self.top is None else LogprobsView(tokenizer, shape.chat, offset)

    def echoed(self, outcome: Outcome) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt's text and log-probs (the BLS's context logits, with the first response)."""
        assert self.echo is not None
        if self.view is None or self.top is None:
            return self.echo.text, None
        context = outcome.context_logits
        if context is None or len(context) != len(self.echo.ids):
            raise server_error("the model returned no context logits for the prompt")
        return self.echo.text, self.view.render(prompt_logprobs(self.echo.ids, context, self.top))

    def chunk(self, shape: Shape, delta: Delta) -> dict[str, Any]:
        shown = self.view.render(delta.logprobs) if self.view is not None else None
        return shape.chunk(delta.text, logprobs=shown)

    def whole(self, outcome: Outcome) -> tuple[str, dict[str, Any] | None, int]:
        """(text, logprobs, completion tokens) of a non-streamed choice."""
        text, shown = self.echoed(outcome) if self.echo is not None else ("", None)
        if self.show_generated:
            text += outcome.text
            if self.view is not None:
                shown = _joined(shown, self.view.render(outcome.logprobs))
        return text, shown, outcome.completion_tokens if self.show_generated else 0


def _joined(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two `logprobs` objects of consecutive tokens as one (their lists end to end)."""
    return second if first is None else {key: first[key] + second[key] for key in second}


async def _answer(
    request: web.Request,
    req: CompletionRequest | ChatRequest,
    shape: Shape,
    body: dict,
    prompt_tokens: int,
    echo: Echo | None = None,
) -> web.StreamResponse:
    outcome = Outcome()
    choice = _Choice(req, shape, request.app[INFO], echo)
    deltas = generate_deltas(request.app[BLS], body, req.stop_strings(), outcome, choice.top)
    async with contextlib.aclosing(deltas):
        if not req.stream:
            async for _ in deltas:
                pass
            text, shown, completion_tokens = choice.whole(outcome)
            finish_reason = outcome.finish_reason if choice.show_generated else "length"
            used = usage(prompt_tokens, completion_tokens)
            return web.json_response(shape.whole(text, finish_reason, used, shown))
        # Wait for the first text (or the end) before answering 200, so that a refused request gets its
        # HTTP error status rather than an error inside the stream.
        first = await anext(deltas, None)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        if shape.chat:
            await response.write(sse(shape.chunk("", role=True)))
        try:
            if choice.echo is not None:
                text, shown = choice.echoed(outcome)
                await response.write(sse(shape.chunk(text, logprobs=shown)))
            if first is not None and choice.show_generated:
                await response.write(sse(choice.chunk(shape, first)))
                async for delta in deltas:
                    await response.write(sse(choice.chunk(shape, delta)))
        except APIError as err:  # after the 200: the error goes into the stream
            await response.write(sse(err.body()))
            await response.write(DONE)
            return response
        except (ConnectionError, OSError):
            raise  # the client went away: closing `deltas` cancels the request in Triton
        except Exception:
            log.exception("streaming %s failed", shape.id)
            await response.write(sse(server_error().body()))
            await response.write(DONE)
            return response
        completion_tokens = outcome.completion_tokens if choice.show_generated else 0
        finish_reason = outcome.finish_reason if choice.show_generated else "length"
        await response.write(sse(shape.chunk(None if shape.chat else "", finish_reason)))
        if req.stream_options is not None and req.stream_options.include_usage:
            await response.write(sse(shape.usage_chunk(usage(prompt_tokens, completion_tokens))))
        await response.write(DONE)
        await response.write_eof()
        return response


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
