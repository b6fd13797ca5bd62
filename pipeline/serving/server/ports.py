"""Who listens on a TCP port: so `llmpipe serve` refuses ports another process holds before it starts
anything, and calls a server ready only when the answer on its port comes from the process it started.

Without this, a second `llmpipe serve` on ports already in use reported "ready" at once (the health check
reached the other server), and only later died of its own bind error. Linux only (/proc/net/tcp*).
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Mapping
from pathlib import Path

from pipeline.errors import ServingError

_LISTEN = "0A"  # /proc/net/tcp's st column for TCP_LISTEN


def listening_inodes(port: int, proc: Path = Path("/proc")) -> set[int]:
    """Socket inodes listening on `port` on any address (IPv4 and IPv6)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for row in (proc / "net" / table).read_text().splitlines()[1:]:
                fields = row.split()
                if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(int(fields[9]))
    return inodes


def listening_pids(port: int, proc: Path = Path("/proc")) -> set[int]:
    """The processes holding a listening socket on `port` (those whose /proc fds this user can read)."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port, proc)}
    if not wanted:
        return set()
    pids = set()
    for fd_dir in proc.glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if any(_readlink(fd) in wanted for fd in fd_dir.iterdir()):
                pids.add(int(fd_dir.parent.name))
    return pids


def _readlink(path: Path) -> str:
    try:
        return str(path.readlink())
    except OSError:
        return ""


def describe_process(pid: int, proc: Path = Path("/proc")) -> str:
    """`pid 42 (tritonserver --model-repository=...)`, the command line cut to a readable length."""
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().decode("utf-8", "replace").split("\0")
    except OSError:
        return f"pid {pid}"
    command = " ".join(part for part in argv if part)
    return f"pid {pid} ({command[:80]}{'...' if len(command) > 80 else ''})"


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As servers bind: a port left in TIME_WAIT by a stopped server is free to take.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def check_ports_free(host: str, ports: Mapping[str, int]) -> None:
    """Raise ServingError naming the first port (by its setting) that another process holds on `host`.
    Port 0 means "any free port" and is skipped."""
    for setting, port in ports.items():
        if port and not _bindable(host, port):
            holders = sorted(listening_pids(port))
            held_by = ", ".join(describe_process(pid) for pid in holders) or "another process"
            raise ServingError(
                f"port {port} ({setting}) on {host} is in use by {held_by}",
                hint="Stop that server, or serve on other ports (0 = any free port).",
            )
