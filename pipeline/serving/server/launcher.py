"""Run a real tritonserver: start it, wait until it is ready, stop it, and leave nothing behind.

`TritonServer` is a context manager for tests and for `llmpipe serve`:

    with TritonServer(ServerOptions(model_repository=repo, http_port=0, grpc_port=0, metrics_port=0)) as srv:
        print(srv.http_url)         # ports 0 were replaced by free ones
        srv.serve_forever()         # CLI only: forwards SIGINT/SIGTERM, watches health, returns the exit code

A model that fails to load makes `start()` raise ServingError quoting that model's log lines; a server that
never becomes ready raises after `ready_timeout_s`. Stopping sends SIGTERM (SIGKILL after the exit timeout)
and removes the server's /dev/shm regions by their unique prefix.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from types import FrameType, TracebackType

from pipeline.errors import ServingError
from pipeline.serving.server.command import (
    ServerOptions,
    TritonInstall,
    find_tritonserver,
    prepare_backend_dir,
    server_command,
    server_env,
)
from pipeline.serving.server.health import HealthWatch
from pipeline.serving.server.ports import check_ports_free, describe_process, listening_pids
from pipeline.serving.server.trtllm_launch import MPIRUN

SHM_DIR = Path("/dev/shm")
_LOG_LINES_KEPT = 400
# Triton's own error lines ("E1129 12:00:00.1 42 model_lifecycle.cc:654] failed to load ..."), its model
# status table rows, and Python tracebacks from the stubs.
_ERROR_LINE = re.compile(r"^E\d{4} |UNAVAILABLE|failed to load|Traceback|Error|Exception")
# Harmless on machines without a GPU: never the reason a start failed.
_NOISE = re.compile(r"CudaDriverHelper has not been initialized|unable to create stream|CUDA driver version")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def with_free_ports(opts: ServerOptions) -> ServerOptions:
    """Replace every port 0 with a free port on the bind address."""
    host = "127.0.0.1" if opts.host in ("0.0.0.0", "") else opts.host
    return dataclasses.replace(
        opts,
        http_port=opts.http_port or free_port(host),
        grpc_port=opts.grpc_port or free_port(host),
        metrics_port=opts.metrics_port or free_port(host),
    )


def failure_lines(lines: list[str], limit: int = 40) -> list[str]:
    """The log lines that explain a failed start: errors, UNAVAILABLE models, tracebacks."""
    picked = [line for line in lines if _ERROR_LINE.search(line) and not _NOISE.search(line)]
    return (picked or lines)[-limit:]


# The server gets SIGTERM if the launching process dies without stopping it (a killed test run): a
# trampoline sets PR_SET_PDEATHSIG and execs the server. Not a preexec_fn: that makes subprocess fork() a
# process whose other threads (gRPC's pollers, log pumps) may hold locks, and runs gRPC's fork handlers in
# the child; without one, subprocess uses vfork and the child does nothing but exec.
_EXEC_DYING_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # the launcher died before prctl: nobody would stop the server
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _dying_with_parent(command: list[str]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-I", "-S", "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *command]


class TritonServer:
    def __init__(
        self,
        options: ServerOptions,
        *,
        install: TritonInstall | None = None,
        ready_timeout_s: float = 180.0,
        echo_log: bool = False,
    ) -> None:
        self.options = with_free_ports(options)
        self.install = install
        self.ready_timeout_s = ready_timeout_s
        self.echo_log = echo_log
        self.shm_prefix = self._new_shm_prefix()
        self.process: subprocess.Popen[bytes] | None = None
        self.run_dir: Path | None = None
        self._lines: collections.deque[str] = collections.deque(maxlen=_LOG_LINES_KEPT)
        self._num_lines = 0  # ever logged; with _lines_at_ready, tells which kept lines came after ready
        self._lines_at_ready = 0
        self._log_lock = threading.Lock()
        self._pump: threading.Thread | None = None
        self._stop_requested = False
        self.health_failure: str | None = None  # why serve_forever stopped an unhealthy server
        self.health_failure_log: list[str] = []  # what the server logged from ready until that failure

    # -- addresses ---------------------------------------------------------------------------------
    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.options.host in ("0.0.0.0", "") else self.options.host

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self.options.metrics_port}/metrics"

    @property
    def log_path(self) -> Path | None:
        return None if self.run_dir is None else self.run_dir / "tritonserver.log"

    def log_lines(self, since_ready: bool = False) -> list[str]:
        """The last lines of tritonserver's log; since_ready: only those logged after it became ready."""
        with self._log_lock:
            lines, total = list(self._lines), self._num_lines
        return lines[max(0, len(lines) - (total - self._lines_at_ready)) :] if since_ready else lines

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        repo = Path(self.options.model_repository)
        if not repo.is_dir() or not any(repo.glob("*/config.pbtxt")):
            raise ServingError(
                f"{repo} is not a Triton model repository (no */config.pbtxt)",
                hint="Render one with `llmpipe package CONFIG`.",
            )
        install = self.install or find_tritonserver()
        if self.options.trtllm is not None and shutil.which(MPIRUN) is None:
            raise ServingError(
                f"a TensorRT-LLM repository is started under {MPIRUN}, which is not on PATH",
                hint="Serve it inside NVIDIA's tritonserver trtllm container (`make image`).",
            )
        opts = self.options
        check_ports_free(
            opts.host or "0.0.0.0",
            {"HTTP": opts.http_port, "gRPC": opts.grpc_port, "metrics": opts.metrics_port},
        )
        self.run_dir = Path(tempfile.mkdtemp(prefix="llmpipe-triton-"))
        backend_dir = prepare_backend_dir(install, self.run_dir)
        command = server_command(install.binary, self.options, backend_dir, self.shm_prefix)
        self.process = subprocess.Popen(
            _dying_with_parent(command),
            env=server_env(install, trtllm=self.options.trtllm),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._pump = threading.Thread(target=self._pump_log, name="tritonserver-log", daemon=True)
        self._pump.start()
        try:
            self.wait_ready(self.ready_timeout_s)
            with self._log_lock:
                self._lines_at_ready = self._num_lines
        except BaseException:
            self.stop()
            raise

    def _pump_log(self) -> None:
        assert self.process is not None and self.process.stdout is not None and self.log_path is not None
        with self.log_path.open("w", encoding="utf-8") as log:
            for raw in self.process.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                with self._log_lock:
                    self._lines.append(line)
                    self._num_lines += 1
                log.write(line + "\n")
                log.flush()
                if self.echo_log:
                    print(line, file=sys.stderr, flush=True)

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._join_pump()
                raise ServingError(
                    self._explain(
                        f"tritonserver exited with code {self.process.returncode} before it was ready"
                    ),
                    hint="Fix the model named above, then serve again (LLMPIPE_DEBUG=1 and "
                    "--log-verbose=1 show more).",
                )
            if self.is_ready() and self._owns_http_port():
                return
            time.sleep(0.2)
        raise ServingError(
            self._explain(f"tritonserver was not ready after {timeout_s:.0f}s"),
            hint="A model may still be loading (raise --ready-timeout) or be stuck: see the log.",
        )

    def _owns_http_port(self) -> bool:
        """Whether the server answering on the HTTP port is this one (a process of its group): another
        server that took the port after the start's check must not make this one look ready. By session:
        under mpirun the listener is a child of the launcher, which led the session."""
        assert self.process is not None
        holders = listening_pids(self.options.http_port)
        if not holders:
            return True  # sockets this user cannot see: nothing to tell them apart by
        for pid in holders:
            with contextlib.suppress(OSError):
                if os.getsid(pid) == self.process.pid:
                    return True
        raise ServingError(
            f"port {self.options.http_port} answers, but from "
            + ", ".join(describe_process(pid) for pid in sorted(holders))
            + ", not from the tritonserver llmpipe started",
            hint="Another server took the port while this one started: stop it, or serve on other ports.",
        )

    def _explain(self, headline: str) -> str:
        lines = failure_lines(self.log_lines())
        return headline + ":\n  " + "\n  ".join(lines) if lines else headline

    def _join_pump(self) -> None:
        if self._pump is not None:
            self._pump.join(timeout=5)

    def terminate(self) -> None:
        """Ask the server to shut down gracefully; returns at once.

        NOTE: SIGTERM goes to the server alone, not its process group: the server stops its Python stubs
        itself, and a stub killed under it is reported as a crash.
        """
        self._stop_requested = True
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def _reap_group(self, timeout_s: float) -> None:
        """Wait for the stubs the server started (same process group) to exit; kill what remains."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def stop(self) -> int | None:
        """Stop the server, wait for it, remove its shared memory and scratch folder; the exit code."""
        code = None
        if self.process is not None:
            self.terminate()
            try:
                code = self.process.wait(timeout=self.options.exit_timeout_s + 15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                code = self.process.wait()
            self._reap_group(timeout_s=5)
            self._join_pump()
        self.cleanup_shm()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return code

    def restart(self) -> None:
        """Start a fresh server on the same ports and repository, after this one died or was stopped
        unhealthy (what is left of it is reaped and cleaned first). Its shared memory regions get new
        names: a region of the dead server that a stub still maps is never the new server's."""
        self.stop()
        self.shm_prefix = self._new_shm_prefix()
        self._stop_requested = False
        self.health_failure = None
        self.health_failure_log = []
        self.start()

    @staticmethod
    def _new_shm_prefix() -> str:
        # Unique per server so concurrent servers never share (or delete) each other's regions.
        return f"llmpipe{os.getpid()}_{uuid.uuid4().hex[:8]}_"

    def leftover_shm(self) -> list[Path]:
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*")) if SHM_DIR.is_dir() else []

    def cleanup_shm(self) -> list[Path]:
        """Remove this server's /dev/shm regions (only left behind when the server was killed)."""
        removed = self.leftover_shm()
        for path in removed:
            with contextlib.suppress(OSError):
                path.unlink()
        return removed

    def serve_forever(self, health_period_s: float | None = 0.25) -> int:
        """Block until the server exits; SIGINT/SIGTERM stop it (a second one kills it). The exit code.

        Every `health_period_s` the server's health is checked (health.py); a server that can no longer
        serve (a dead Python stub, not ready for long) is killed at once, so that its clients get a
        transport error now instead of waiting out their requests on a model that will never answer, and
        `health_failure` says why.
        """
        assert self.process is not None
        watch = HealthWatch(self.process.pid, self.is_ready) if health_period_s else None

        def forward(signum: int, frame: FrameType | None) -> None:
            if self._stop_requested and self.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
            self.terminate()

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while True:
                try:
                    code = self.process.wait(timeout=health_period_s)
                    break
                except subprocess.TimeoutExpired:
                    assert watch is not None
                    problem = None if self._stop_requested else watch.check()
                    if problem is not None:
                        self.health_failure = problem
                        self.health_failure_log = self.log_lines(since_ready=True)
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(self.process.pid, signal.SIGKILL)
                        self.stop()
                        code = self.process.returncode
                        break
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self._join_pump()
        return code

    @property
    def stopped_on_request(self) -> bool:
        return self._stop_requested
