"""The HTTP handlers: /v1/models, /health, /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from aiohttp import web

from pipeline.serving.openai.errors import APIError, bad_request, server_error
from pipeline.serving.openai.generation import Outcome, generate_deltas
from pipeline.serving.openai.model_info import ModelInfo
from pipeline.serving.openai.prompts import chat_prompt, completion_budget, count_prompt_tokens
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


def _bls_inputs(req: CompletionRequest | ChatRequest, prompt: str, max_tokens: int, info: ModelInfo) -> dict:
    body: dict[str, Any] = {
        "text_input": prompt,
        "max_tokens": max_tokens,
        "stream": info.decoupled,  # streamed internally wherever possible: a stop string ends it early
        "exclude_input_in_output": True,
        "return_log_probs": True,  # one log-prob per token: how completion_tokens are counted
    }
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
    prompt = req.prompt_text()
    # Tokenizing off the event loop: a long prompt must not stall the other streams.
    prompt_tokens = await asyncio.to_thread(count_prompt_tokens, info, prompt, "prompt")
    max_tokens = completion_budget(info, prompt_tokens, req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
    body = _bls_inputs(req, prompt, max_tokens, info)
    return await _answer(request, req, Shape.new(False, info.name), body, prompt_tokens)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = parse(ChatRequest, await _body(request))
    info = request.app[INFO]
    _check_model(info, req.model)
    prompt = await asyncio.to_thread(chat_prompt, info, req.messages)
    prompt_tokens = await asyncio.to_thread(count_prompt_tokens, info, prompt, "messages")
    max_tokens = completion_budget(info, prompt_tokens, req.token_limit(), None)
    body = _bls_inputs(req, prompt, max_tokens, info)
    return await _answer(request, req, Shape.new(True, info.name), body, prompt_tokens)


def _check_model(info: ModelInfo, model: str) -> None:
    if model != info.name:
        raise APIError(
            404, f"The model '{model}' does not exist (this server serves '{info.name}')",
            param="model", code="model_not_found",
        )  # fmt: skip


async def _answer(
    request: web.Request, req: CompletionRequest | ChatRequest, shape: Shape, body: dict, prompt_tokens: int
) -> web.StreamResponse:
    outcome = Outcome()
    deltas = generate_deltas(request.app[BLS], body, req.stop_strings(), outcome)
    async with contextlib.aclosing(deltas):
        if not req.stream:
            async for _ in deltas:
                pass
            used = usage(prompt_tokens, outcome.completion_tokens)
            return web.json_response(shape.whole(outcome.text, outcome.finish_reason, used))
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
            if first is not None:
                await response.write(sse(shape.chunk(first)))
                async for delta in deltas:
                    await response.write(sse(shape.chunk(delta)))
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
        await response.write(sse(shape.chunk(None if shape.chat else "", outcome.finish_reason)))
        if req.stream_options is not None and req.stream_options.include_usage:
            await response.write(sse(shape.usage_chunk(usage(prompt_tokens, outcome.completion_tokens))))
        await response.write(DONE)
        await response.write_eof()
        return response


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
