"""OpenMP's wait policy for the processes that run the torch engine.

With OpenMP's default (active) wait, idle worker threads spin after each parallel region. When no core is
spare (the engine's threads beside tritonserver, the other Python stubs, or any other process), the
spinning threads take the cores the working ones need: decode steps on a loaded 2-core machine ran 10-40x
slower. PASSIVE lets idle workers sleep. libgomp reads the variable once, when torch loads it, so the entry
points set it (the CLI, the Triton server's environment, benchmark scripts), never a library import; a value
the user set wins.
"""

from __future__ import annotations

from collections.abc import MutableMapping

WAIT_POLICY_VAR = "OMP_WAIT_POLICY"


def default_wait_policy(env: MutableMapping[str, str]) -> None:
    env.setdefault(WAIT_POLICY_VAR, "PASSIVE")
