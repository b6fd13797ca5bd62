"""The aiohttp application: routes, the API-key check, OpenAI-shaped errors for everything, and the runner."""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pipeline.errors import ServingError
from pipeline.serving.openai.errors import APIError, server_error
from pipeline.serving.openai.model_info import BLS_MODEL, ModelInfo, load_model_info
from pipeline.serving.openai.routes import BLS, INFO, add_routes
from pipeline.serving.openai.triton import TritonBls

log = logging.getLogger(__name__)
_UNAUTHENTICATED = ("/health",)


@dataclass(frozen=True)
class OpenAIServerOptions:
    model_repository: Path
    triton_grpc: str = "127.0.0.1:8001"
    host: str = "127.0.0.1"
    port: int = 9000
    api_key: str | None = None
    served_model_name: str | None = None


def _errors() -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as err:
            return err.response()
        except web.HTTPException as err:  # the router's 404 / 405, in OpenAI's shape
            if err.status < 400:
                raise
            message = f"{request.method} {request.path}: {err.reason}"
            code = "not_found" if err.status == 404 else None
            return APIError(err.status, message, code=code).response()
        except (ConnectionError, OSError):
            raise  # the client went away mid-response: nothing left to tell it
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return server_error().response()

    return middleware


def _auth(api_key: str) -> Middleware:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in _UNAUTHENTICATED:
            sent = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(sent, expected):
                raise APIError(
                    401,
                    "Invalid or missing API key (send Authorization: Bearer <key>)",
                    code="invalid_api_key",
                )
        return await handler(request)

    return middleware


def make_app(info: ModelInfo, triton_grpc: str, api_key: str | None = None) -> web.Application:
    """The front-end for `info`'s model, served by the tensorrt_llm_bls model of the Triton at `triton_grpc`."""
    middlewares: list[Middleware] = [_errors()] + ([_auth(api_key)] if api_key else [])
    app = web.Application(middlewares=middlewares)
    app[INFO] = info

    async def triton_channel(app: web.Application) -> AsyncIterator[None]:
        app[BLS] = TritonBls(triton_grpc, BLS_MODEL)  # on the serving loop: grpc.aio channels belong to one
        yield
        await app[BLS].close()

    app.cleanup_ctx.append(triton_channel)
    add_routes(app)
    return app


def run_openai_server(options: OpenAIServerOptions) -> None:
    """Serve until interrupted."""
    info = load_model_info(options.model_repository, options.served_model_name)
    app = make_app(info, options.triton_grpc, options.api_key)
    print(
        f"OpenAI API for '{info.name}' on http://{options.host}:{options.port}/v1 (Triton {options.triton_grpc})"
    )
    # handler_cancellation: a client that disconnects cancels its handler, which cancels its Triton request.
    web.run_app(app, host=options.host, port=options.port, handler_cancellation=True, print=None)


class BackgroundFrontEnd:
    """make_app's server on its own event loop in a daemon thread, beside a process that does something else
    (`llmpipe serve` watching tritonserver, a test). `start` returns once the port is bound."""

    def __init__(self, options: OpenAIServerOptions) -> None:
        self.options = options
        info = load_model_info(options.model_repository, options.served_model_name)
        self.loop = asyncio.new_event_loop()
        # A short shutdown_timeout: stopping the server must not wait out open streams (aiohttp's 60 s).
        self.runner = web.AppRunner(
            make_app(info, options.triton_grpc, options.api_key),
            handler_cancellation=True,
            shutdown_timeout=2.0,
        )
        self.thread = threading.Thread(target=self.loop.run_forever, name="openai-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.options.port}"

    def start(self) -> BackgroundFrontEnd:
        self.thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._bind(), self.loop).result(30)
        except OSError as err:
            self.close()
            raise ServingError(
                f"the OpenAI API cannot listen on {self.options.host}:{self.options.port}: {err.strerror}",
                hint="Pick another port (--openai-port, serving.openai_port) or turn it off (--no-openai).",
            ) from None
        return self

    async def _bind(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, self.options.host, self.options.port).start()

    def close(self) -> None:
        if self.thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
            except TimeoutError:
                log.warning("the OpenAI API did not stop within 30 s; leaving its thread behind")
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()

    def __enter__(self) -> BackgroundFrontEnd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
