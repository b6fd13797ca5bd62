"""Is a running tritonserver still able to serve? What `llmpipe serve` watches while the server runs.

Triton 2.51 does not report a Python backend stub that died (SIGKILL, out of memory): /v2/health/ready,
/v2/health/live and the model's ready endpoint stay 200, the repository index keeps it READY, nothing is
logged, and the stub is never restarted (decoupled or not); every later request to the model fails after
~1 s with "Stub process '<model>_0_0' is not healthy" (measured). So besides readiness, the watch checks
that every stub the server had started once it was ready is still alive. Linux only (/proc).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"


@dataclass(frozen=True)
class GroupProcess:
    pid: int
    state: str  # /proc/<pid>/stat's state letter: "Z" is a zombie (dead, not yet reaped)
    argv: list[str]
    rss_bytes: int


def group_processes(pgid: int, proc: Path = Path("/proc"), with_rss: bool = True) -> list[GroupProcess]:
    """The processes of one process group: tritonserver (its leader) and the stubs it started. Without
    `with_rss`, /proc/<pid>/status is not read and rss_bytes is 0 (the watchdog needs only who is alive)."""
    found = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # field 5 of /proc/<pid>/stat: the process group
                continue
            argv = (stat.parent / "cmdline").read_bytes().decode("utf-8", "replace").split("\0")
            status = (stat.parent / "status").read_text() if with_rss else ""
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        rss_kb = next((int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS")), 0)
        found.append(GroupProcess(int(stat.parent.name), fields[0], argv, rss_kb * 1024))
    return found


def python_stubs(pgid: int, proc: Path = Path("/proc")) -> dict[int, str]:
    """pid -> model name of every live Python backend stub in the group.

    A stub runs `triton_python_backend_stub <repository>/<model>/<version>/model.py ...`.
    """
    stubs = {}
    for process in group_processes(pgid, proc, with_rss=False):
        if process.state != "Z" and len(process.argv) > 1 and Path(process.argv[0]).name == STUB_BINARY:
            stubs[process.pid] = Path(process.argv[1]).parent.parent.name
    return stubs


class HealthWatch:
    """Polled by `TritonServer.serve_forever`; `check()` says why the server can no longer serve, or None."""

    def __init__(
        self,
        pgid: int,
        is_ready: Callable[[], bool],
        unready_grace_s: float = 10.0,
        ready_every_s: float = 2.0,
        proc: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pgid = pgid
        self.is_ready = is_ready
        self.unready_grace_s = unready_grace_s
        # Stubs are looked up in /proc on every check (cheap, so a dead one is caught within a poll);
        # readiness is an HTTP request, asked at most this often.
        self.ready_every_s = ready_every_s
        self.proc = proc
        self.clock = clock
        self.stubs = python_stubs(pgid, proc)  # the stubs of the loaded models: each must stay alive
        self._unready_since: float | None = None
        self._ready_asked_at: float | None = None

    def _alive(self, pid: int) -> bool:
        # Only the known stubs' own /proc entries are read: a full scan on every poll would cost a share
        # of a core on a busy host. A reused pid lands in another process group.
        try:
            fields = (self.proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return False
        return fields[0] != "Z" and int(fields[2]) == self.pgid

    def check(self) -> str | None:
        for pid, model in sorted(self.stubs.items()):
            if not self._alive(pid):
                return (
                    f"the Python backend stub of model '{model}' (pid {pid}) died while serving; tritonserver "
                    "neither restarts nor reports a dead stub, and every request to the model would fail"
                )
        now = self.clock()
        if self._ready_asked_at is not None and now - self._ready_asked_at < self.ready_every_s:
            return None
        self._ready_asked_at = now
        if self.is_ready():
            self._unready_since = None
            return None
        if self._unready_since is None:
            self._unready_since = now
        elif now - self._unready_since >= self.unready_grace_s:
            return f"tritonserver has not been ready for {now - self._unready_since:.0f}s (/v2/health/ready)"
        return None
