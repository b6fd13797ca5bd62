"""CPU priority of the serving front-end: tritonserver and the tokenizer, detokenizer and BLS stubs yield to
the torch engine.

Why: on a small CPU host the engine keeps every core busy with OpenMP regions that end in a barrier. A
front-end thread that wakes on a core (to route, detokenize or send one streamed token) stalls the engine
thread it displaced and, through the barrier, every other engine thread. Measured on 2 vCPUs (SmolLM2 int8,
16 streams through the ensemble, 3 interleaved rounds; benchmarks/NOTES.md): served throughput 0.85x
in-process with the front-end at niceness 0, 0.90x at 10, 0.93x at 19. At a high niceness the front-end
runs when an engine thread idles between steps, which every step does; the price is a little streaming
latency (inter-token p95 +10-20 ms).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def lower_priority(pid: int, nice: int) -> None:
    """Raise every thread of process `pid` to niceness `nice` (never lowers one; no privileges needed).
    Linux sets niceness per thread, and threads created later inherit their creator's."""
    if nice <= 0:
        return
    tasks = Path(f"/proc/{pid}/task")
    tids = [int(task.name) for task in tasks.iterdir()] if tasks.is_dir() else [pid]
    for tid in tids:
        with contextlib.suppress(OSError):  # the thread exited meanwhile
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
