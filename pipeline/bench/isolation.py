"""Each peer's measurement in a process of its own: a peer that crashes (a segfault while loading, an abort
in its kernels) or hangs costs its own rows, not the run.

The parent writes a `PeerJob` as JSON and starts `python -m pipeline.bench.peers.worker JOB OUT` with the
chosen interpreter (a peer whose stack conflicts with llmpipe's runs on its own venv's python). The
worker appends each finished run to OUT as one JSON line, so runs that completed before a crash are kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.bench.load import RunResult
from pipeline.bench.metrics import DraftCounts, RequestRecord
from pipeline.bench.requests import BenchRequest

REPO_ROOT = Path(__file__).resolve().parents[2]
_STDERR_TAIL_LINES = 8


@dataclass(frozen=True)
class PeerJob:
    """What a worker measures: one peer, warmed up, then each run (a batch size and its requests)."""

    family: str  # hf | llamacpp | ct2 | openvino
    precision: str
    loader: str  # "module:function", called in the worker as function(job) -> a Peer
    runs: tuple[tuple[int, tuple[BenchRequest, ...]], ...]  # (batch size, requests), in order
    warmup: tuple[BenchRequest, ...] = ()
    # how to load the peer: paths (as strings), thread count, batch limit; the loader's own keys
    options: Mapping[str, Any] = field(default_factory=dict)
    progress: bool = True

    @property
    def name(self) -> str:
        return f"{self.family}-{self.precision}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PeerJob:
        data = json.loads(text)
        return cls(
            family=data["family"],
            precision=data["precision"],
            loader=data["loader"],
            runs=tuple((size, tuple(_request(r) for r in requests)) for size, requests in data["runs"]),
            warmup=tuple(_request(r) for r in data["warmup"]),
            options=data["options"],
            progress=data["progress"],
        )


def _request(data: dict[str, Any]) -> BenchRequest:
    ids = data.get("input_ids")
    return BenchRequest(**{**data, "input_ids": None if ids is None else tuple(ids)})


@dataclass
class Outcome:
    """A worker's runs, and why it ended early when it did (None: it finished)."""

    job: PeerJob
    results: list[RunResult]
    failure: str | None = None


def result_to_dict(result: RunResult) -> dict[str, Any]:
    return asdict(result)


def result_from_dict(data: dict[str, Any]) -> RunResult:
    records = []
    for r in data["records"]:
        drafts = r.get("drafts")
        records.append(RequestRecord(**{**r, "drafts": None if drafts is None else DraftCounts(**drafts)}))
    return RunResult(**{**data, "records": records})


def describe_exit(returncode: int) -> str:
    """'killed by SIGSEGV' for a signal (negative return codes), 'exited with status N' otherwise."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def run_isolated(
    job: PeerJob, python: str | os.PathLike[str] = sys.executable, timeout_s: float | None = None
) -> Outcome:
    """Run `job` in a child `python`; its stderr passes through (progress bars, the peer's own logs) and
    its last lines explain a failure."""
    with tempfile.TemporaryDirectory(prefix="llmpipe-peer-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "runs.jsonl"
        job_path.write_text(job.to_json())
        env = dict(os.environ)
        # the worker imports this checkout's pipeline, also from a venv where llmpipe is not installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            [str(python), "-m", "pipeline.bench.peers.worker", str(job_path), str(out_path)],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group: ending it ends the peer's children too
        )
        tail = _Tail(proc.stderr)
        tail.start()
        returncode: int | None = None
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                returncode = proc.wait(timeout=timeout_s)
        finally:  # also on Ctrl-C: no peer outlives the run, nor a child of it holding the stderr pipe
            _kill_group(proc)
        tail.join()
        results = _read_runs(out_path)
    if returncode == 0:
        return Outcome(job, results)
    why = f"timed out after {timeout_s:g} s" if returncode is None else describe_exit(returncode)
    last = _last_words([line.strip() for line in tail.lines if line.strip()])
    detail = f" ({last[:300]})" if last else ""
    done = f"; {len(results)} run(s) finished before it" if results else ""
    return Outcome(job, results, f"{job.name} {why}{detail}{done}")


def _last_words(lines: list[str]) -> str:
    """What a failed worker said last: a user-fixable error as the worker printed it (`Error: ...` and its
    hint, pipeline.errors.run_script), else its last line (a traceback's exception, a crash's message)."""
    errors = [i for i, line in enumerate(lines) if line.startswith("Error: ")]
    if errors:
        return " ".join(lines[errors[-1] : errors[-1] + 2])
    return lines[-1] if lines else ""


class _Tail(threading.Thread):
    """Copies the child's stderr to ours and keeps its last lines."""

    def __init__(self, stream: Any) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.lines: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)

    def run(self) -> None:
        pending = ""
        for chunk in iter(lambda: self.stream.read1(4096), b""):
            text = chunk.decode(errors="replace")
            sys.stderr.write(text)
            sys.stderr.flush()
            pending += text.replace("\r", "\n")
            *done, pending = pending.split("\n")
            self.lines.extend(done)
        if pending:
            self.lines.append(pending)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _read_runs(path: Path) -> list[RunResult]:
    if not path.is_file():
        return []
    runs = []
    for line in path.read_text().splitlines():
        try:
            data = json.loads(line)
        except ValueError:  # a line cut short by a crash mid-write is not a run
            continue
        runs.append(result_from_dict(data))
    return runs


def append_run(path: Path, result: RunResult) -> None:
    """The worker's side: one finished run, flushed at once so a later crash cannot take it."""
    with path.open("a") as f:
        f.write(json.dumps(result_to_dict(result), default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_jobs(
    jobs: Sequence[tuple[PeerJob, str | os.PathLike[str]]], timeout_s: float | None = None
) -> list[Outcome]:
    """Jobs one after the other (never two peers on the cores at once), each with its interpreter."""
    return [run_isolated(job, python, timeout_s) for job, python in jobs]
