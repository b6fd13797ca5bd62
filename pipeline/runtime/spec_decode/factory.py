"""The proposer an engine directory asks for: `build_config.speculative_decoding_mode`, `max_draft_len`
and `speculative_config`, each overridable when the engine is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, UnsupportedModelError
from pipeline.runtime.engine.engine_args import RunnerArgs, SpeculationArgs
from pipeline.runtime.engine_config import EngineConfig
from pipeline.runtime.spec_decode.proposer import NgramProposer, Proposer

# TensorRT-LLM's SpeculativeDecodingMode names (what the build writes) -> llmpipe's speculative.mode.
_MODE_OF_BUILD = {None: "none", "draft_tokens_external": "draft_model", "ngram": "ngram"}


def make_proposer(
    engine_config: EngineConfig, runner: Any, args: SpeculationArgs | None = None
) -> Proposer | None:
    """None when speculation is off. `runner` is the target's ModelRunner (the draft model is loaded onto
    its device); `args` override the engine's built speculative settings."""
    args = args or SpeculationArgs()
    build, spec = engine_config.build, engine_config.build.speculative_config
    built_mode = build.speculative_decoding_mode
    mode = args.mode or _MODE_OF_BUILD.get(built_mode, built_mode)
    if mode == "none":
        return None
    max_draft_len = build.max_draft_len if args.max_draft_len is None else args.max_draft_len
    if not isinstance(max_draft_len, int) or max_draft_len < 1:
        raise ConfigError(
            f"max_draft_len={max_draft_len!r} is invalid for speculative mode {mode}: must be >= 1",
            hint="rebuild with speculative.max_draft_len >= 1 or pass max_draft_len",
        )
    adaptive = spec.adaptive if args.adaptive is None else args.adaptive
    if mode == "ngram":
        try:
            return NgramProposer(
                max_draft_len,
                spec.ngram_min_match if args.ngram_min_match is None else args.ngram_min_match,
                spec.ngram_max_match if args.ngram_max_match is None else args.ngram_max_match,
                adaptive,
            )
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if mode == "draft_model":
        draft_dir = args.draft_engine_dir or spec.draft_engine_dir
        if not draft_dir:
            raise ConfigError(
                "speculative mode draft_model needs the draft engine directory",
                hint="build with speculative.draft_config set, or pass draft_engine_dir",
            )
        return load_draft_model_proposer(Path(draft_dir), engine_config, runner, max_draft_len, adaptive)
    raise UnsupportedModelError(
        f"speculative mode {mode!r} is not implemented by the torch runtime; use ngram or draft_model",
        hint="lookahead, medusa and eagle are TensorRT-LLM modes (backend: trtllm)",
    )


def load_draft_model_proposer(
    draft_dir: Path, target: EngineConfig, runner: Any, max_draft_len: int, adaptive: bool
) -> Proposer:
    from pipeline.runtime.engine_config import load_engine_config
    from pipeline.runtime.spec_decode.draft_model import DraftModelProposer
    from pipeline.runtime.worker.model_runner import ModelRunner

    draft = load_engine_config(draft_dir)
    if draft.model.vocab_size != target.model.vocab_size:
        raise ConfigError(
            f"draft engine {draft_dir} has vocab_size={draft.model.vocab_size} but the target has "
            f"{target.model.vocab_size}: a draft model must share the target's tokenizer"
        )
    draft_runner = ModelRunner(draft, RunnerArgs(device=str(runner.device)))
    return DraftModelProposer(draft_runner, max_draft_len, adaptive, max_positions=draft_runner.max_positions)
