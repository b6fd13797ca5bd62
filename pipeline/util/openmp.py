"""OpenMP's wait policy for the processes that run the torch engine.

With OpenMP's default (active) wait, idle worker threads spin after each parallel region. When no core is
spare (the engine's threads beside tritonserver, the other Python stubs, or any other process), the
spinning threads take the cores the working ones need: decode steps on a loaded 2-core machine ran 10-40x
slower. PASSIVE lets idle workers sleep. But a worker that sleeps at once pays a futex wake-up at every
barrier and region of a decode step (a SmolLM2 step has ~200); a short spin first (GOMP_SPINCOUNT, libgomp's
busy-wait iterations before it sleeps, some tens of microseconds) takes those waits without the sleep: on
2 vCPUs of a Zen 5, one-row int8 steps ran 1.3x and 16-row steps 1.07x faster, and with two busy processes
competing for the cores still no slower than without the spin. libgomp reads both variables once, when torch
loads it, so the entry points set them (the CLI, the Triton server's environment, benchmark scripts), never a
library import; values the user set win.

libgomp spins for GOMP_SPINCOUNT only while the worker threads it manages (every thread's team, summed) do not
outnumber the CPUs; beyond that it spins ~100 iterations and sleeps. The thread that loads an engine runs
OpenMP regions (weight conversion, the load-time probes) and keeps its workers, so once the engine's own thread
starts its team the process holds twice the workers and every barrier of a step sleeps again:
`release_thread_workers` lets the loading thread's workers go.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import MutableMapping
from pathlib import Path

logger = logging.getLogger(__name__)

WAIT_POLICY_VAR = "OMP_WAIT_POLICY"
SPIN_COUNT_VAR = "GOMP_SPINCOUNT"
SPIN_COUNT = "3000"


def default_wait_policy(env: MutableMapping[str, str]) -> None:
    env.setdefault(WAIT_POLICY_VAR, "PASSIVE")
    env.setdefault(SPIN_COUNT_VAR, SPIN_COUNT)


# omp_pause_resource_t's omp_pause_soft (OpenMP 5.0): release the threads, keep nothing else.
_OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (its own copy in torch/lib, else the one its soname resolves to), or None."""
    import torch

    candidates = [str(p) for p in sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))]
    for name in [*candidates, "libgomp.so.1"]:
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        if hasattr(library, "omp_pause_resource_all"):
            return library
    return None


def release_thread_workers() -> bool:
    """End the OpenMP worker threads of the calling thread's team (libgomp recreates them if this thread
    opens a parallel region again). Call it on the thread that loaded an engine, before another thread runs
    the engine's steps. Measured on 2 vCPUs (Zen 4): single-stream int8 decode steps on the engine thread took
    10.6-11.3 ms with the loader's workers alive, 6.6-7.1 ms without (as fast as steps on the loading thread
    itself). Returns whether libgomp released them."""
    library = _libgomp()
    if library is None:
        logger.debug(
            "no libgomp with omp_pause_resource_all in this process: OpenMP workers left as they are"
        )
        return False
    return library.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
