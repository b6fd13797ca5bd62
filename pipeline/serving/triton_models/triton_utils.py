"""Small bridges between Triton's Python backend (`triton_python_backend_utils`) and plain numpy/dicts.

Imported only inside a Triton stub (or a test that installs tests/stub_pb_utils.py under that name).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


class ParameterError(ValueError):
    """A model parameter in config.pbtxt is invalid: raised at load so the model never becomes ready."""

    def __init__(self, model: str, key: str, value: object, allowed: str) -> None:
        super().__init__(f"model '{model}': parameter {key}={value!r} is invalid: {allowed}")


class ModelParameters:
    """`parameters { key: ... value { string_value: ... } }` of a model, read with strict types."""

    def __init__(self, model: str, model_config: Mapping[str, Any]) -> None:
        self.model = model
        raw = model_config.get("parameters") or {}
        self.values = {k: str(v.get("string_value", "")) for k, v in raw.items()}

    def _get(self, key: str, default: str | None) -> str:
        if key in self.values:
            return self.values[key]
        if default is None:
            raise ParameterError(self.model, key, None, "required parameter is missing")
        return default

    def string(self, key: str, default: str | None = None) -> str:
        return self._get(key, default)

    def boolean(self, key: str, default: bool | None = None) -> bool:
        text = self._get(key, None if default is None else str(default)).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ParameterError(self.model, key, text, "expected true or false")

    def integer(self, key: str, default: int | None = None, minimum: int | None = None) -> int:
        text = self._get(key, None if default is None else str(default))
        try:
            value = int(text)
        except ValueError:
            raise ParameterError(self.model, key, text, "expected an integer") from None
        if minimum is not None and value < minimum:
            raise ParameterError(self.model, key, value, f"must be >= {minimum}")
        return value

    def optional_integer(self, key: str, minimum: int | None = None) -> int | None:
        return None if key not in self.values or not self.values[key] else self.integer(key, minimum=minimum)

    def real(
        self, key: str, default: float | None = None, low: float = float("-inf"), high: float = float("inf")
    ) -> float:
        text = self._get(key, None if default is None else repr(default))
        try:
            value = float(text)
        except ValueError:
            raise ParameterError(self.model, key, text, "expected a number") from None
        if not low < value <= high:
            raise ParameterError(self.model, key, value, f"must be in ({low}, {high}]")
        return value

    def choice(self, key: str, allowed: Iterable[str], default: str | None = None) -> str:
        options = tuple(allowed)
        value = self._get(key, default)
        if value not in options:
            raise ParameterError(self.model, key, value, f"choose one of {', '.join(options)}")
        return value

    def path(self, key: str, base: Path) -> Path:
        """A path parameter; relative ones resolve against the model's version folder (relocatable)."""
        path = Path(self._get(key, None)).expanduser()
        path = path if path.is_absolute() else base / path
        if not path.exists():
            raise ParameterError(self.model, key, str(path), "path does not exist")
        return path


def version_dir(args: Mapping[str, str]) -> Path:
    """`<repository>/<model>/<version>/` of the model being initialized."""
    return Path(args["model_repository"]) / str(args["model_version"])


def request_inputs(request: Any, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The named inputs the client sent (absent optional inputs are left out)."""
    found = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            found[name] = tensor.as_numpy()
    return found


def requested_outputs(request: Any, declared: Collection[str]) -> frozenset[str]:
    """The outputs a request asks for: Triton fills in every declared one when a client names none."""
    return frozenset(request.requested_output_names()) or frozenset(declared)


def response_sender(request: Any, declared: Collection[str]) -> Any:
    """The request's response sender, sending only the outputs the request asked for.

    Triton 2.51's Python stub (python_backend r24.10) drops a response's unrequested outputs inside
    ResponseSender.send after releasing the GIL, so their numpy arrays are freed without it, and now and then
    the stub dies with SIGSEGV in numpy (python_backend #390 made it take the GIL, December 2024). Leaving
    them out before the send drops them here, with the GIL. A request that asks for every output (what a
    client that names none gets) keeps the stub's own sender."""
    sender = request.get_response_sender()
    wanted = requested_outputs(request, declared)
    return sender if wanted >= frozenset(declared) else _RequestedOutputsSender(sender, wanted)


class _RequestedOutputsSender:
    def __init__(self, sender: Any, wanted: frozenset[str]) -> None:
        self._sender = sender
        self._wanted = wanted

    def is_cancelled(self) -> bool:
        return bool(self._sender.is_cancelled())

    def send(self, response: Any = None, flags: int = 0) -> None:
        if response is None:
            self._sender.send(flags=flags)
            return
        if not response.has_error():
            tensors = response.output_tensors()
            kept = [tensor for tensor in tensors if tensor.name() in self._wanted]
            if len(kept) < len(tensors):
                response = pb_utils.InferenceResponse(output_tensors=kept)
        self._sender.send(response, flags=flags)


def make_response(outputs: Mapping[str, np.ndarray]) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])


def error_response(message: str, invalid_argument: bool = True) -> Any:
    """A response carrying an error; InvalidArgument (HTTP 400) for client mistakes, else Internal."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG" if invalid_argument else "INTERNAL", None)
    try:
        error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    except TypeError:  # a backend older than error codes
        error = pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def unavailable_response(message: str) -> Any:
    code = getattr(pb_utils.TritonError, "UNAVAILABLE", None)
    error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def string_array(texts: Iterable[str], shape: tuple[int, ...]) -> np.ndarray:
    """Texts as a Triton STRING tensor (UTF-8 bytes objects)."""
    return np.array([t.encode("utf-8") for t in texts], dtype=np.object_).reshape(shape)


def log_info(message: str) -> None:
    pb_utils.Logger.log_info(message)


def log_error(message: str) -> None:
    pb_utils.Logger.log_error(message)


class _TritonLogHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        message = self.format(record)
        if record.levelno >= logging.ERROR:
            log_error(message)
        elif record.levelno >= logging.WARNING:
            pb_utils.Logger.log_warn(message)
        else:
            log_info(message)


def forward_logs(name: str = "pipeline") -> None:
    """Send logger `name`'s INFO and above to tritonserver's log: a stub's Python logging is otherwise
    unconfigured, and what the engine reports at load (KV blocks, the choices it timed) would be lost."""
    logger = logging.getLogger(name)
    if not any(isinstance(h, _TritonLogHandler) for h in logger.handlers):
        logger.addHandler(_TritonLogHandler())
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
