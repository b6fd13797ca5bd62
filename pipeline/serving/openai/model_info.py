"""What the served model repository tells the front-end: the model's name, its tokenizer, and its limits,
read from the files Triton serves (so they cannot disagree with what the BLS model does)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts import read_manifest
from pipeline.errors import MissingArtifactError
from pipeline.serving.triton_models.tokenization import PromptEncoder

BLS_MODEL = "tensorrt_llm_bls"
_PARAMETER = re.compile(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')


def config_parameters(config_pbtxt: Path) -> dict[str, str]:
    """A config.pbtxt's `parameters { key: ... value: { string_value: ... } }` entries."""
    return dict(_PARAMETER.findall(config_pbtxt.read_text(encoding="utf-8")))


@dataclass
class ModelInfo:
    name: str
    encoder: PromptEncoder  # tokenizes exactly as the BLS does
    max_input_len: int
    max_seq_len: int
    decoupled: bool  # the BLS streams (else each request is one response)

    @functools.cached_property
    def encoder_adds_bos(self) -> bool:
        """Whether the BLS's encoding starts a text with BOS (asked once, not per request)."""
        tokenizer = self.encoder.tokenizer
        ids = tokenizer.encode("a", add_special_tokens=True)
        return bool(ids) and ids[0] == tokenizer.bos_token_id


def _build_config_name(repo: Path) -> str | None:
    manifest = read_manifest(repo)
    build_config = manifest.facts.get("build_config") if manifest is not None else None
    name = build_config.get("name") if isinstance(build_config, dict) else None
    return str(name) if name else None


def load_model_info(repo: Path, served_model_name: str | None = None) -> ModelInfo:
    """The tensorrt_llm_bls model of `repo`, as the front-end needs it."""
    config = repo / BLS_MODEL / "config.pbtxt"
    if not config.is_file():
        raise MissingArtifactError(
            f"{repo} has no {BLS_MODEL}/config.pbtxt",
            hint="Pass the model_repo folder `llmpipe package` wrote (it holds tensorrt_llm_bls).",
        )
    params = config_parameters(config)
    tokenizer_dir = repo / "preprocessing" / "1" / "tokenizer"
    if not tokenizer_dir.is_dir():
        tokenizer_dir = Path(params.get("tokenizer_dir", ""))
    if not tokenizer_dir.is_dir():
        raise MissingArtifactError(
            f"no tokenizer for {repo}: not at preprocessing/1/tokenizer nor tokenizer_dir"
        )
    add_special = params.get("add_special_tokens", "true").lower() == "true"
    max_input_len = int(params.get("max_input_len", "0") or 0)
    decoupled = re.search(r"decoupled:\s*true", config.read_text(encoding="utf-8")) is not None
    return ModelInfo(
        name=served_model_name or _build_config_name(repo) or repo.resolve().name,
        encoder=PromptEncoder.from_dir(tokenizer_dir, add_special_tokens=add_special),
        max_input_len=max_input_len or 1 << 30,
        max_seq_len=int(params.get("max_seq_len", "0") or 0) or 1 << 30,
        decoupled=decoupled,
    )
