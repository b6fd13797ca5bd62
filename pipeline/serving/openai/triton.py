"""The BLS model over Triton's gRPC stream, asynchronously: one stream per request, so that closing it
early (client gone, stop string seen) cancels the request in Triton, which frees its KV blocks.

The request protobuf is built here rather than through tritonclient.grpc.aio, whose stream_infer cannot ask
for the empty final response that marks the end of a decoupled model's stream."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor

from pipeline.serving.client import request_tensors
from pipeline.serving.openai.errors import APIError, bad_request, server_error, unavailable

_OVERLOADED = ("queue is full", "exceeds maximum queue size", "overloaded", "not ready", "unavailable")


@dataclass
class Piece:
    """One response of the BLS: the text it adds, the tokens that took and their log-probs, and the logits
    the request asked for."""

    text: str
    token_ids: list[int]
    log_probs: list[float]
    context_logits: np.ndarray | None = None  # [prompt, vocab]
    generation_logits: np.ndarray | None = None  # [len(token_ids), vocab]

    @property
    def num_tokens(self) -> int:
        return len(self.log_probs)


def _request(model: str, body: dict[str, Any], request_id: str) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, (datatype, array) in request_tensors(body).items():
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend(array.shape)
        raw = serialize_byte_tensor(array).item() if datatype == "BYTES" else array.tobytes()
        request.raw_input_contents.append(raw)
    return request


def model_error(message: str) -> APIError:
    """A Triton/BLS error message as the client's error: its mistake (the BLS names the input), an
    overloaded or unready server (retry later), or a model failure."""
    lowered = message.lower()
    if "input '" in message:
        return bad_request(None, message)
    if any(marker in lowered for marker in _OVERLOADED):
        return unavailable(f"the model is overloaded or not ready: {message}")
    return server_error(f"the model failed: {message}")


class TritonBls:
    """One gRPC channel to Triton, shared by every request; create and close it on the serving loop."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.model = model
        # Logits outputs are vocabulary-sized rows per token: far past gRPC's 4 MB default for a response.
        self._channel = grpc.aio.insecure_channel(url, options=[("grpc.max_receive_message_length", -1)])
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def ready(self, timeout_s: float = 2.0) -> bool:
        try:
            reply = await self._stub.ModelReady(
                service_pb2.ModelReadyRequest(name=self.model), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.ready)

    async def generate(self, body: dict[str, Any]) -> AsyncGenerator[Piece, None]:
        """Each response's text and token count until the final one. Leaving early cancels the request."""
        request = _request(self.model, body, uuid.uuid4().hex)
        done = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield request
            await done.wait()  # keep our side open until the last response: a half-close may end it early

        call = self._stub.ModelStreamInfer(requests())
        finished = False
        try:
            async for response in call:
                if response.error_message:
                    raise model_error(response.error_message)
                result = InferResult(response.infer_response)
                if response.infer_response.outputs:
                    yield _piece(result)
                final = response.infer_response.parameters.get("triton_final_response")
                if final is None or final.bool_param:
                    finished = True
                    return
            finished = True
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise unavailable(f"cannot reach Triton at {self.url}: {err.details()}") from None
            raise model_error(str(err.details())) from None
        finally:
            done.set()
            if not finished:
                call.cancel()  # Triton passes the cancellation on to the BLS, which stops the engine request


def _piece(result: Any) -> Piece:
    text = result.as_numpy("text_output")
    first = np.asarray(text).reshape(-1)[0] if text is not None and np.asarray(text).size else b""
    log_probs, ids = result.as_numpy("output_log_probs"), result.as_numpy("output_ids")
    context, generation = result.as_numpy("context_logits"), result.as_numpy("generation_logits")
    return Piece(
        first.decode("utf-8") if isinstance(first, bytes) else str(first),
        [] if ids is None else np.asarray(ids).reshape(-1).tolist(),
        [] if log_probs is None else np.asarray(log_probs, dtype=np.float32).reshape(-1).tolist(),
        None if context is None else context.reshape(-1, context.shape[-1]),
        None if generation is None or not generation.size else generation.reshape(-1, generation.shape[-1]),
    )
