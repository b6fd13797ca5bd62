"""The package-side facts of the trtllm_pytorch backend: where the checkpoint sits in the model repository,
which llmapi model the repository's loader runs, and the trtllm-serve launch files written beside it.

The repository serves TensorRT-LLM's own llmapi Triton model (triton_backend/all_models/llmapi/tensorrt_llm),
not a copy of it: NVIDIA's serving image carries that model at UPSTREAM_MODEL_DIR (its Dockerfile copies
triton_backend/all_models to /app/all_models, WORKDIR /app:
triton-inference-server/tensorrtllm_backend:dockerfile/Dockerfile.triton.trt_llm_backend@0046c23), and the
repository's 1/model.py loads it from there. UPSTREAM_MODEL_ENV points the loader at another folder holding
that model.py and its helpers.py (a TensorRT-LLM checkout, a custom image).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.backends.trtllm_pytorch import release
from pipeline.backends.trtllm_pytorch.llm_args import (
    TRTLLM_SERVE_OPTIONS_FILE,
    model_yaml,
    trtllm_serve_argv,
)
from pipeline.config.build_config import BuildConfig

UPSTREAM_MODEL_DIR = "/app/all_models/llmapi/tensorrt_llm/1"
UPSTREAM_MODEL_ENV = "LLMPIPE_LLMAPI_MODEL_DIR"
UPSTREAM_MODEL_FILE = "model.py"
# The checkpoint's folder inside the model's version folder: model.yaml names it relative to that folder.
CHECKPOINT_SUBDIR = "checkpoint"
TRTLLM_SERVE_SCRIPT = "trtllm_serve.sh"


def upstream_model_file(environ: Mapping[str, str] | None = None) -> Path:
    """The llmapi model.py the repository's loader runs under `environ` (default: this process's)."""
    environ = os.environ if environ is None else environ
    return Path(environ.get(UPSTREAM_MODEL_ENV) or UPSTREAM_MODEL_DIR) / UPSTREAM_MODEL_FILE


def loader_values() -> dict[str, str]:
    """The placeholders of the loader template (templates/trtllm_pytorch/tensorrt_llm/1/model.py)."""
    return {
        "upstream_model_dir": UPSTREAM_MODEL_DIR,
        "upstream_model_env": UPSTREAM_MODEL_ENV,
        "serving_container": release.PINNED_CONTAINER,
        "trtllm_release": release.PINNED,
    }


def repository_model_yaml(cfg: BuildConfig) -> dict[str, Any]:
    """1/model.yaml: the LLM API arguments on the checkpoint beside it, plus triton_config."""
    return model_yaml(cfg, CHECKPOINT_SUBDIR)


def trtllm_serve_script(cfg: BuildConfig, checkpoint: str) -> str:
    """A shell script that starts `trtllm-serve serve` on the repository's checkpoint (`checkpoint`, relative
    to the script's folder) with the trtllm_serve.yaml beside it; its arguments are passed on."""
    argv = trtllm_serve_argv(cfg, checkpoint, TRTLLM_SERVE_OPTIONS_FILE)
    lines = [
        "#!/bin/sh",
        f"# Written by `llmpipe package` for {cfg.name}.",
        "# TensorRT-LLM's own OpenAI-compatible server (/v1/completions, /v1/chat/completions) on this",
        f"# repository's checkpoint with the LLM API arguments of {TRTLLM_SERVE_OPTIONS_FILE}: the alternative to",
        f"# Triton. It needs TensorRT-LLM {release.PINNED}, e.g. in {release.PINNED_CONTAINER}.",
        "# Arguments given to this script are passed on to trtllm-serve.",
        'cd "$(dirname "$0")" || exit 1',
        f'exec {shlex.join(argv)} "$@"',
    ]
    return "\n".join(lines) + "\n"
