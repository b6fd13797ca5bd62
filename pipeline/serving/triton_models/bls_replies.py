"""Where a BLS request's responses go: one row of a client request, on that request's response sender.

The rows of one request (several prompts, as tensorrtllm_backend's batch inputs send them) are served by
threads of their own and share the sender: every send takes the request's lock, each row's responses carry
its batch_index, and only the last row to finish sends the final flag. Only the outputs the request asked
for are sent (tu.response_sender says why); that also keeps the BLS's extra outputs out of the `ensemble`
model, which runs this code with the ensemble's tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipeline.serving.triton_models import triton_utils as tu
from pipeline.serving.triton_models.io import batch_index
from pipeline.serving.triton_models.streams import ResponseGroup


class RequestReplies:
    """What the rows of one client request share: its sender, the lock around it, who finishes last."""

    def __init__(self, sender: Any, num_rows: int, wanted_outputs: frozenset[str]) -> None:
        self.sender = sender
        self.num_rows = num_rows
        self.wanted_outputs = wanted_outputs
        self.lock = threading.Lock()
        self.group = ResponseGroup(num_rows)

    def row(self, index: int) -> RowReplies:
        return RowReplies(self, index if self.num_rows > 1 else None)


class RowReplies:
    """One row's responses."""

    def __init__(self, request: RequestReplies, row: int | None) -> None:
        self._request = request
        self._row = row

    def is_cancelled(self) -> bool:
        return bool(self._request.sender.is_cancelled())

    def send(self, outputs: Mapping[str, np.ndarray]) -> None:
        """A response that is not this row's last."""
        self._send(self._response(outputs), final=False)

    def finish(self, outputs: Mapping[str, np.ndarray] | None = None) -> None:
        """This row's last response (`None`: it has nothing more to say)."""
        last = self._request.group.finish_one()
        response = None if outputs is None else self._response(outputs)
        if last or response is not None:
            self._send(response, final=last)

    def fail(self, message: str, invalid_argument: bool = True) -> None:
        """End this row with an error (InvalidArgument for the client's mistakes)."""
        last = self._request.group.finish_one()
        self._send(tu.error_response(message, invalid_argument=invalid_argument), final=last)

    def _response(self, outputs: Mapping[str, np.ndarray]) -> Any:
        if self._row is not None:
            outputs = {**outputs, **batch_index(self._row)}
        wanted = self._request.wanted_outputs
        tensors = {name: value for name, value in outputs.items() if name in wanted}
        return tu.make_response(tensors)

    def _send(self, response: Any | None, final: bool) -> None:
        flags = tu.FINAL if final else 0
        with self._request.lock:
            if response is None:
                self._request.sender.send(flags=flags)
            else:
                self._request.sender.send(response, flags=flags)
