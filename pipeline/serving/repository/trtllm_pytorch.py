"""The model repository of a trtllm_pytorch build (the `package` stage's work for that backend): TensorRT-LLM's
llmapi Triton model, run by NVIDIA's own model.py in the serving image. Relocatable: every path inside is
relative.

    tensorrt_llm/config.pbtxt             upstream's llmapi tensors (templates/llmapi/tensorrt_llm), no parameters
    tensorrt_llm/1/model.py               the loader (templates/trtllm_pytorch): runs the image's llmapi model.py
    tensorrt_llm/1/model.yaml             LLM API arguments (model: checkpoint) + triton_config
    tensorrt_llm/1/checkpoint/            the engine stage's HF / ModelOpt checkpoint (hard links)
    trtllm_serve.sh, trtllm_serve.yaml    trtllm-serve serve on the same checkpoint and arguments (Triton ignores
                                          files at the repository's top level)
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml

from pipeline.artifacts import link_tree
from pipeline.backends.trtllm_pytorch import release
from pipeline.backends.trtllm_pytorch.checkpoint import require_hf_checkpoint
from pipeline.backends.trtllm_pytorch.llm_args import (
    LLM_API_ARGS_FILE,
    TRTLLM_SERVE_OPTIONS_FILE,
    trtllm_serve_options,
)
from pipeline.backends.trtllm_pytorch.package import (
    CHECKPOINT_SUBDIR,
    TRTLLM_SERVE_SCRIPT,
    UPSTREAM_MODEL_DIR,
    UPSTREAM_MODEL_ENV,
    loader_values,
    repository_model_yaml,
    trtllm_serve_script,
)
from pipeline.config.build_config import BuildConfig
from pipeline.serving.repository.render import (
    ENGINE_MODEL,
    MODEL_YAML,
    render_configs,
    render_template,
    templates_dir,
)

LOADER_TEMPLATE = Path("trtllm_pytorch") / ENGINE_MODEL / "1" / "model.py"
CHECKPOINT = f"{ENGINE_MODEL}/1/{CHECKPOINT_SUBDIR}"  # relative to the repository
MODEL_YAML_HEADER = (
    "# Written by `llmpipe package`: the settings of TensorRT-LLM's llmapi model (model.py beside this file\n"
    "# runs it). triton_config goes to Triton; every other key is an LLM() argument (TensorRT-LLM\n"
    f"# {release.PINNED}'s TorchLlmArgs). model: the checkpoint folder, relative to this file.\n"
)


def _write_yaml(path: Path, document: dict[str, Any], header: str = "") -> None:
    path.write_text(header + yaml.safe_dump(document, sort_keys=False), encoding="utf-8")


def render_trtllm_pytorch_repository(
    cfg: BuildConfig, engine_dir: Path, out_dir: Path, templates: Path | None = None
) -> dict[str, Any]:
    """Write the repository for the engine stage's folder `engine_dir` into `out_dir`; the facts for the
    stage manifest."""
    engine_dir, out_dir = Path(engine_dir).resolve(), Path(out_dir)
    templates = templates or templates_dir()
    checkpoint = require_hf_checkpoint(engine_dir)
    config = render_configs(cfg, templates)[ENGINE_MODEL]
    loader = render_template(ENGINE_MODEL, (templates / LOADER_TEMPLATE).read_text("utf-8"), loader_values())
    version = out_dir / ENGINE_MODEL / "1"
    version.mkdir(parents=True, exist_ok=True)
    (out_dir / ENGINE_MODEL / "config.pbtxt").write_text(config, encoding="utf-8")
    (version / "model.py").write_text(loader, encoding="utf-8")
    _write_yaml(version / MODEL_YAML, repository_model_yaml(cfg), MODEL_YAML_HEADER)
    link_tree(engine_dir, version / CHECKPOINT_SUBDIR)
    for name in (LLM_API_ARGS_FILE, TRTLLM_SERVE_OPTIONS_FILE):
        # The engine folder's argument files name that folder; model.yaml and the files below replace them.
        (version / CHECKPOINT_SUBDIR / name).unlink(missing_ok=True)
    _write_yaml(out_dir / TRTLLM_SERVE_OPTIONS_FILE, trtllm_serve_options(cfg, CHECKPOINT))
    script = out_dir / TRTLLM_SERVE_SCRIPT
    script.write_text(trtllm_serve_script(cfg, CHECKPOINT), encoding="utf-8")
    script.chmod(0o755)
    return {
        "models": [ENGINE_MODEL],
        "interface": "llmapi",
        "backend": cfg.backend,
        "triton_backend": "python",
        "decoupled": cfg.serving.decoupled,
        "triton_max_batch_size": 0,  # model.yaml's triton_config, as upstream's
        "engine": CHECKPOINT,
        "architecture": checkpoint["architecture"],
        "upstream_model": {"dir": UPSTREAM_MODEL_DIR, "env": UPSTREAM_MODEL_ENV},
        "container": release.PINNED_CONTAINER,
        "trtllm_serve": {"script": TRTLLM_SERVE_SCRIPT, "options": TRTLLM_SERVE_OPTIONS_FILE},
        "config_sha256": {ENGINE_MODEL: hashlib.sha256(config.encode()).hexdigest()},
        "tool_packages": ["tritonclient"],
    }
