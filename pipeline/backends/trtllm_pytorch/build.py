"""engine (trtllm_pytorch): the folder TensorRT-LLM's PyTorch backend loads, with the arguments to load it.

Nothing is compiled: the PyTorch backend takes the (ModelOpt) HF checkpoint as it is. The engine folder
holds that checkpoint (hard links) beside the LLM API arguments, as `LLM(**llm_api_args.yaml)` takes them
and as trtllm-serve's --extra_llm_api_options file. The checkpoint must carry the quantization the config
asks for, so a mismatch fails here, not when the model loads on the GPU host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipeline.artifacts import link_tree
from pipeline.backends.trtllm_pytorch import release
from pipeline.backends.trtllm_pytorch.checkpoint import HF_QUANT_CONFIG, quant_algos, require_hf_checkpoint
from pipeline.backends.trtllm_pytorch.llm_args import (
    LLM_API_ARGS_FILE,
    TRTLLM_SERVE_OPTIONS_FILE,
    llm_api_args,
    trtllm_serve_argv,
    trtllm_serve_options,
)
from pipeline.config.build_config import BuildConfig
from pipeline.config.workdir import stage_output_dir
from pipeline.errors import MissingArtifactError
from pipeline.quantize.modelopt.state import SIMULATION_DIR


def _check_quantization(cfg: BuildConfig, ckpt_dir: Path) -> tuple[str | None, str | None]:
    found = quant_algos(ckpt_dir)
    expected = cfg.quantization.quant_algo
    if found[0] != expected:
        raise MissingArtifactError(
            f"{ckpt_dir} holds quant_algo {found[0]} ({HF_QUANT_CONFIG}), but quantization.mode="
            f"{cfg.quantization.mode} needs {expected}",
            hint="Rerun the quantize stage: llmpipe quantize CONFIG --force",
        )
    return found


def _write_yaml(path: Path, document: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")


def build(cfg: BuildConfig, ckpt_dir: Path, out_dir: Path) -> dict[str, Any]:
    checkpoint = require_hf_checkpoint(ckpt_dir)
    quant_algo, kv_cache_quant_algo = _check_quantization(cfg, ckpt_dir)
    link_tree(ckpt_dir, out_dir, skip=(SIMULATION_DIR,))  # what validation reads is no part of the engine
    # `out_dir` is renamed to the stage folder once written: the arguments name the final folder.
    final_dir = stage_output_dir(cfg, "engine").resolve()
    args = llm_api_args(cfg, final_dir)
    _write_yaml(out_dir / LLM_API_ARGS_FILE, args)
    _write_yaml(out_dir / TRTLLM_SERVE_OPTIONS_FILE, trtllm_serve_options(cfg, final_dir))
    return {
        **checkpoint,
        "route": "trtllm_pytorch",
        "release": release.PINNED,
        "container": release.PINNED_CONTAINER,
        "quant_algo": quant_algo,
        # Without KV scales in the checkpoint, kv_cache_config.dtype still gives an FP8 cache (unit scales).
        "kv_cache_quant_algo": kv_cache_quant_algo or cfg.quantization.kv_cache_quant_algo,
        "llm_api_args": args,
        "llm_api_args_file": LLM_API_ARGS_FILE,
        "trtllm_serve_options_file": TRTLLM_SERVE_OPTIONS_FILE,
        "trtllm_serve_argv": trtllm_serve_argv(cfg, final_dir, final_dir / TRTLLM_SERVE_OPTIONS_FILE),
        "compiled": False,
    }
