"""BlsTurns: a BLS call starts alone; response waits overlap; a call waiting to start holds back new waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pipeline.serving.triton_models.bls_turns import BlsTurns


def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_response_waits_overlap_and_a_call_goes_alone_before_new_waits() -> None:
    turns = BlsTurns()
    events: list[str] = []
    release = {name: threading.Event() for name in ("a", "b", "call", "c")}

    def wait_for_response(name: str) -> None:
        with turns.response():
            events.append(f"{name} in")
            release[name].wait(5)
            events.append(f"{name} out")

    def start_call() -> None:
        with turns.call():
            events.append("call in")
            release["call"].wait(5)
            events.append("call out")

    a, b = (threading.Thread(target=wait_for_response, args=(n,)) for n in "ab")
    a.start()
    b.start()
    _until(lambda: {"a in", "b in"} <= set(events))  # two response waits at once
    call = threading.Thread(target=start_call)
    call.start()
    _until(lambda: turns._calls_waiting == 1)
    c = threading.Thread(target=wait_for_response, args=("c",))
    c.start()
    time.sleep(0.05)
    assert (
        "c in" not in events and "call in" not in events
    )  # c waits behind the call, the call behind a and b
    release["a"].set()
    release["b"].set()
    _until(lambda: "call in" in events)
    time.sleep(0.05)
    assert "c in" not in events  # the call is alone
    release["call"].set()
    _until(lambda: "c in" in events)
    release["c"].set()
    for thread in (a, b, call, c):
        thread.join(5)
    assert events.index("call in") > max(events.index("a out"), events.index("b out"))
    assert events.index("c in") > events.index("call out")
