"""Who may touch the Python stub's decoupled BLS calls when: a new call (exec) alone, responses (next()) together.

Triton 2.51's stub (python_backend r24.10) deadlocks when a thread starts a decoupled BLS call while another
thread's ResponseIterator.__next__ wakes up: __next__ takes back the GIL while holding its iterator's mutex,
exec waits for the stub's iterator-map mutex while holding the GIL, and the stub's response thread holds the
map mutex while it waits for the iterator's. Calls and responses therefore exclude each other, while responses
of different calls may be awaited at once (none of them waits for the map mutex). A call waiting to start holds
back new response waits, so it gets in once the streams in flight have had their next response, about one
engine step.

Excluding every next() from every other, as a plain lock does, let one stream waiting for its next token, or for
a first token behind a full engine batch, hold up the responses already there for all others: at 16 streams of
SmolLM2-135M the BLS streamed 0.8-0.9x the tokens of Triton's own ensemble and its first tokens came 2.8-3.3x
later (0.90-0.94x and 2.1-2.3x with these turns).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class BlsTurns:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._calling = False
        self._calls_waiting = 0
        self._responses_awaited = 0

    @contextmanager
    def call(self) -> Iterator[None]:
        """Start a BLS call (exec): alone, ahead of new response waits."""
        with self._changed:
            self._calls_waiting += 1
            try:
                self._changed.wait_for(lambda: not self._calling and self._responses_awaited == 0)
            finally:
                self._calls_waiting -= 1
            self._calling = True
        try:
            yield
        finally:
            with self._changed:
                self._calling = False
                self._changed.notify_all()

    @contextmanager
    def response(self) -> Iterator[None]:
        """Wait for a call's next response (next()), beside other such waits."""
        with self._changed:
            self._changed.wait_for(lambda: not self._calling and self._calls_waiting == 0)
            self._responses_awaited += 1
        try:
            yield
        finally:
            with self._changed:
                self._responses_awaited -= 1
                if self._responses_awaited == 0:
                    self._changed.notify_all()
