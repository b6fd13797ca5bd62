"""A stand-in for Triton's `triton_python_backend_utils`, enough to run pipeline.serving's models in-process.

`install()` registers it under the real module name (before pipeline.serving's model modules are
imported). Requests carry numpy inputs; response senders record what a model sent; BLS calls go to the
handler registered with `route(model_name, fn)`; metrics keep their values for assertions.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
MODULE_NAME = "triton_python_backend_utils"


class TritonModelException(Exception):
    pass


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors: Iterable[Tensor] = (), error: TritonError | None = None) -> None:
        self._outputs, self._error = list(output_tensors), error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def as_dict(self) -> dict[str, np.ndarray]:
        return {t.name(): t.as_numpy() for t in self._outputs}


class ResponseSender:
    """Records (response, flags); `cancel()` makes is_cancelled() true, like a client that went away."""

    def __init__(self) -> None:
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.done = threading.Event()
        self._cancelled = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self.done.is_set():
            raise TritonModelException("a response was sent after the final flag")
        self.sent.append((response, flags))
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        self._cancelled = True

    def responses(self) -> list[InferenceResponse]:
        return [r for r, _ in self.sent if r is not None]


class InferenceRequest:
    """A client request (built by tests) or a BLS request (built by a model, run with exec())."""

    routes: dict[str, Callable[[InferenceRequest, bool], Any]] = {}

    def __init__(
        self,
        model_name: str = "",
        inputs: Iterable[Tensor] = (),
        request_id: str = "",
        requested_output_names: Iterable[str] = (),
        parameters: str = "{}",
        **_: Any,
    ) -> None:
        self.model_name = model_name
        self._parameters = parameters  # JSON, as Triton hands them over
        self.inputs = {t.name(): t for t in inputs}
        self._request_id = request_id
        self._requested_output_names = list(requested_output_names)
        self.sender = ResponseSender()

    def requested_output_names(self) -> list[str]:
        return list(self._requested_output_names)

    def request_id(self) -> str:
        return self._request_id

    def parameters(self) -> str:
        return self._parameters

    def get_response_sender(self) -> ResponseSender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()

    def exec(self, decoupled: bool = False) -> Any:
        return InferenceRequest.routes[self.model_name](self, decoupled)


def route(model_name: str, handler: Callable[[InferenceRequest, bool], Any]) -> None:
    InferenceRequest.routes[model_name] = handler


def make_request(inputs: dict[str, np.ndarray], request_id: str = "") -> InferenceRequest:
    return InferenceRequest(inputs=[Tensor(k, v) for k, v in inputs.items()], request_id=request_id)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return request.inputs.get(name)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


model_dir = ""  # what get_model_dir() answers: a test that loads a model sets it (monkeypatch.setattr)


def get_model_dir() -> str:
    """The folder of the model.py Triton loaded (its version folder)."""
    return model_dir


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class Logger:
    lines: list[str] = []

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.lines.append(message)

    log_warn = log_verbose = log_error = log_info


class _Metric:
    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None) -> None:
        self.family, self.labels, self.buckets = family, labels, buckets
        self._value = 0.0
        self.observations: list[float] = []

    def set(self, value: float) -> None:
        self._value = float(value)

    def increment(self, value: float) -> None:
        self._value += value

    def observe(self, value: float) -> None:
        self.observations.append(value)

    def value(self) -> float:
        return self._value


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    families: dict[str, MetricFamily] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[_Metric] = []
        MetricFamily.families[name] = self

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> _Metric:  # noqa: N802
        if (self.kind == self.HISTOGRAM) != (buckets is not None):
            raise TritonModelException("histograms need buckets; other kinds must not have them")
        metric = _Metric(self, dict(labels or {}), buckets)
        self.metrics.append(metric)
        return metric


def install() -> Any:
    """Register this module as `triton_python_backend_utils`; returns it."""
    module = sys.modules[__name__]
    sys.modules[MODULE_NAME] = module
    return module
