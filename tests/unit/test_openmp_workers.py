"""The OpenMP workers of the thread that loaded an engine end before the engine's own thread runs it: libgomp
stops spinning before it sleeps once its workers outnumber the CPUs. Each case runs in a fresh interpreter,
so that the process's threads are the ones it made."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Counts this process's threads until they reach `want` (worker threads end a moment after they are told to).
_COUNT = """
import os, time
def threads(want=None):
    deadline = time.monotonic() + 10
    while True:
        n = len(os.listdir("/proc/self/task"))
        if want is None or n == want or time.monotonic() > deadline:
            return n
        time.sleep(0.01)
"""


def _run(body: str, *args: str) -> dict[str, int]:
    script = _COUNT + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_release_ends_the_calling_threads_openmp_workers() -> None:
    counts = _run(
        """
        import json, torch
        from pipeline.util.openmp import release_thread_workers
        torch.set_num_threads(2)
        before = threads()
        torch.ones(1 << 22).sum()  # a parallel region: libgomp starts one worker beside this thread
        with_worker = threads()
        released = release_thread_workers()
        print(json.dumps({"before": before, "with_worker": with_worker, "released": int(released),
                          "after": threads(want=before)}))
        """
    )
    assert counts["with_worker"] == counts["before"] + 1
    assert counts["released"] == 1
    assert counts["after"] == counts["before"]


def test_engine_thread_ends_the_loading_threads_openmp_workers(tiny_engine_dir: Path) -> None:
    counts = _run(
        """
        import json, sys, torch
        from pipeline.runtime.engine.async_engine import EngineThread
        from pipeline.runtime.engine.llm_engine import LLMEngine
        engine = LLMEngine.from_engine_dir(sys.argv[1])
        torch.set_num_threads(2)
        torch.ones(1 << 22).sum()
        loaded = threads()  # this thread, its OpenMP worker and whatever loading left
        with EngineThread(engine):
            # one thread more (the engine's, idle: it runs no OpenMP region) and the worker gone
            running = threads(want=loaded)
        print(json.dumps({"loaded": loaded, "running": running}))
        """,
        str(tiny_engine_dir),
    )
    assert counts["running"] == counts["loaded"], counts
