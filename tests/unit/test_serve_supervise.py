"""`llmpipe serve`'s supervisor: which crashes restart the server, how restarts are counted, and that a
restart whose server fails to start is tried again while restarts are left. The server here is a stand-in
scripted with outcomes; the real crash and restart under tritonserver is tests/integration/test_faults.py."""

from __future__ import annotations

import pytest

from pipeline.cli.serve import _supervise
from pipeline.errors import ServingError


class _ScriptedServer:
    """Plays each serve_forever as the next exit code (None: stopped on request) and each restart as the
    next start outcome (an exception raised, or None for a server that came up)."""

    def __init__(self, exits: list[int | None], starts: list[Exception | None]) -> None:
        self.exits = exits
        self.starts = starts
        self.restarts = 0
        self.health_failure: str | None = None
        self.stopped_on_request = False

    def serve_forever(self) -> int:
        code = self.exits.pop(0)
        self.stopped_on_request = code is None
        return 0 if code is None else code

    def restart(self) -> None:
        self.restarts += 1
        outcome = self.starts.pop(0)
        if outcome is not None:
            raise outcome

    def log_lines(self, since_ready: bool = False) -> list[str]:
        return ["E1205 12:00:00.000000 1 backend.cc:1] the crash"]


def test_a_restart_that_fails_to_start_is_tried_again_and_counts(capsys: pytest.CaptureFixture[str]) -> None:
    server = _ScriptedServer(
        exits=[-9, None], starts=[ServingError("tritonserver exited with code -6"), None]
    )
    _supervise(server, max_restarts=3)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert server.restarts == 2
    assert "restarting tritonserver (1/3)" in err and "restarting tritonserver (2/3)" in err
    assert "the restarted server did not start: tritonserver exited with code -6" in err
    assert err.count("ready again in") == 1


def test_failed_restarts_use_up_the_budget_and_serve_fails_with_the_last_reason() -> None:
    failures: list[Exception | None] = [ServingError(f"start {i} failed") for i in range(2)]
    server = _ScriptedServer(exits=[-9], starts=failures)
    with pytest.raises(ServingError, match="the restarted server did not start: start 1 failed"):
        _supervise(server, max_restarts=2)  # type: ignore[arg-type]
    assert server.restarts == 2


def test_restarts_are_counted_across_crashes_and_none_left_ends_serve() -> None:
    server = _ScriptedServer(exits=[-9, -11], starts=[None])
    with pytest.raises(ServingError, match="tritonserver exited with code -11 while serving"):
        _supervise(server, max_restarts=1)  # type: ignore[arg-type]
    assert server.restarts == 1


def test_a_stop_on_request_ends_serve_without_a_restart() -> None:
    server = _ScriptedServer(exits=[None], starts=[])
    _supervise(server, max_restarts=3)  # type: ignore[arg-type]
    assert server.restarts == 0
