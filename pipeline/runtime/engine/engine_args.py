"""EngineArgs: what a caller may choose when it loads an engine directory. Every field is typed; None keeps
what the engine was built with (limits may only go lower than built)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pipeline.config.vocab import SchedulerPolicy

AttentionChoice = Literal["auto", "kernel", "torch"]
SpeculativeMode = Literal["none", "ngram", "draft_model"]  # the ones the torch runtime implements
SPECULATIVE_MODES: tuple[SpeculativeMode, ...] = ("none", "ngram", "draft_model")


@dataclass(frozen=True)
class SpeculationArgs:
    """Speculative decoding, overriding the engine directory's build_config.speculative_* settings."""

    mode: SpeculativeMode | None = None
    max_draft_len: int | None = None
    ngram_min_match: int | None = None
    ngram_max_match: int | None = None
    adaptive: bool | None = None  # size each request's draft by its recent acceptance
    draft_engine_dir: Path | str | None = None  # draft_model: the draft model's engine directory


@dataclass(frozen=True)
class RunnerArgs:
    """How the model runner places and computes the model."""

    device: str = "auto"  # auto | cpu | cuda
    kv_max_tokens: int | None = None  # KV cache capacity; None: the engine's runtime default
    kv_free_memory_fraction: float | None = None  # share of free memory for the KV cache when no max
    num_threads: int | None = None  # torch's (process-wide) thread count; None leaves it as it is
    # One-row (decode) steps' thread count on CPU; None measures the faster of 1 and all at load.
    single_row_threads: int | None = None
    attention: AttentionChoice = "auto"  # kernel | torch | auto (the kernel when it applies)
    seed: int | None = None  # the sampler's base seed for requests that bring none


@dataclass(frozen=True)
class EngineArgs:
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_input_len: int | None = None
    max_seq_len: int | None = None
    policy: SchedulerPolicy | None = None
    enable_chunked_context: bool | None = None
    enable_block_reuse: bool | None = None
    # Engine steps per streamed output of a request (its first and last go at once): serving.stream_interval
    stream_interval: int = 1
    runner: RunnerArgs = field(default_factory=RunnerArgs)
    speculation: SpeculationArgs = field(default_factory=SpeculationArgs)
