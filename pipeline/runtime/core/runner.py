"""The contract between the engine and a model runner: the two dataclasses of outputs.py cross it, nothing else."""

from __future__ import annotations

from typing import Protocol

from pipeline.runtime.core.outputs import RunnerOutput, SchedulerOutput


class Runner(Protocol):
    """What the engine needs from a model runner."""

    num_kv_blocks: int
    tokens_per_block: int

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Compute the scheduled tokens (writing their K/V) and sample where `sample` is set. May be called
        again with a subset of the same requests after it raised (to isolate a failing request)."""
        ...
