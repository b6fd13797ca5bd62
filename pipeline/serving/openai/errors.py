"""OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, and the statuses that go with it."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class APIError(Exception):
    """An error the client is told about: its HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            text=json.dumps(self.body()),
            content_type="application/json",
            headers=self.headers,
        )


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_supported(param: str, yet: bool = False) -> APIError:
    return bad_request(
        param, f"'{param}' is not supported{' yet' if yet else ''}", code="unsupported_parameter"
    )


def unavailable(message: str, retry_after_s: int = 1) -> APIError:
    """Triton is down, not ready or overloaded: the client should retry later."""
    return APIError(
        503,
        message,
        type="service_unavailable",
        code="service_unavailable",
        headers={"Retry-After": str(retry_after_s)},
    )


def server_error(message: str = "The server had an error while processing your request.") -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")
