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
"""

from __future__ import annotations

from collections.abc import MutableMapping

WAIT_POLICY_VAR = "OMP_WAIT_POLICY"
SPIN_COUNT_VAR = "GOMP_SPINCOUNT"
SPIN_COUNT = "3000"


def default_wait_policy(env: MutableMapping[str, str]) -> None:
    env.setdefault(WAIT_POLICY_VAR, "PASSIVE")
    env.setdefault(SPIN_COUNT_VAR, SPIN_COUNT)
