"""The proposer an engine directory asks for: `build_config.speculative_decoding_mode`, `max_draft_len`
and `speculative_config`, each overridable when the engine is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, UnsupportedModelError
from pipeline.runtime.engine_config import EngineConfig
from pipeline.runtime.spec_decode.proposer import NgramProposer, Proposer

# LLMEngine.from_engine_dir keywords that reach make_proposer.
SPEC_OPTIONS = (
    "speculative_mode",  # none | ngram | draft_model
    "max_draft_len",
    "ngram_min_match",
    "ngram_max_match",
    "speculative_adaptive",
    "draft_engine_dir",
)
# TensorRT-LLM's SpeculativeDecodingMode names (what the build writes) -> llmpipe's speculative.mode.
_MODE_OF_BUILD = {None: "none", "draft_tokens_external": "draft_model", "ngram": "ngram"}


def make_proposer(engine_config: EngineConfig, runner: Any, **options: Any) -> Proposer | None:
    """None when speculation is off. `runner` is the target's ModelRunner (the draft model is loaded onto
    its device); `options` are SPEC_OPTIONS."""
    unknown = sorted(set(options) - set(SPEC_OPTIONS))
    if unknown:
        raise ConfigError(
            f"unknown speculative option(s) {', '.join(unknown)}; valid: {', '.join(SPEC_OPTIONS)}"
        )
    build, spec = engine_config.build, engine_config.build.speculative_config
    built_mode = build.speculative_decoding_mode
    mode = options.get("speculative_mode", _MODE_OF_BUILD.get(built_mode, built_mode))
    if mode == "none":
        return None
    max_draft_len = options.get("max_draft_len", build.max_draft_len)
    if not isinstance(max_draft_len, int) or max_draft_len < 1:
        raise ConfigError(
            f"max_draft_len={max_draft_len!r} is invalid for speculative mode {mode}: must be >= 1",
            hint="rebuild with speculative.max_draft_len >= 1 or pass max_draft_len",
        )
    adaptive = bool(options.get("speculative_adaptive", spec.adaptive))
    if mode == "ngram":
        try:
            return NgramProposer(
                max_draft_len,
                options.get("ngram_min_match", spec.ngram_min_match),
                options.get("ngram_max_match", spec.ngram_max_match),
                adaptive,
            )
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if mode == "draft_model":
        draft_dir = options.get("draft_engine_dir", spec.draft_engine_dir)
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
    draft_runner = ModelRunner(draft, device=runner.device)
    return DraftModelProposer(draft_runner, max_draft_len, adaptive, max_positions=draft_runner.max_positions)
