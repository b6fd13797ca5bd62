"""What the contract pins for one build config: the generated trtllm-build command line, the tensorrt_llm
model parameters and the full rendered tensorrt_llm/config.pbtxt (the serving helper's template filled by
pipeline.serving.repository.render_configs), as the text of the files kept in expected/<name>/ (reviewed
by hand against REFERENCE.md). Paths are the work-dir layout relative to the current directory."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.backends.trtllm.build_cmd import format_argv, trtllm_build_argv
from pipeline.backends.trtllm.triton_params import tensorrt_llm_parameters
from pipeline.config import BuildConfig, load_build_config
from pipeline.serving.repository import render_configs, templates_dir

CONTRACT_DIR = Path(__file__).resolve().parent
CONFIG_DIR = CONTRACT_DIR / "configs"
EXPECTED_DIR = CONTRACT_DIR / "expected"


def config_paths() -> list[Path]:
    return sorted(CONFIG_DIR.glob("*.yaml"))


def load(path: Path) -> BuildConfig:
    return load_build_config(path)


def work_paths(cfg: BuildConfig) -> tuple[Path, Path]:
    work = Path("build") / cfg.name
    return work / "quantized", work / "engine"


def contract_files(cfg: BuildConfig) -> dict[str, str]:
    ckpt, engine = work_paths(cfg)
    argv = trtllm_build_argv(cfg, ckpt, engine)
    params = tensorrt_llm_parameters(cfg, engine)
    return {
        "trtllm-build.sh": format_argv(argv) + "\n",
        "tensorrt_llm.parameters.json": json.dumps(params, indent=2) + "\n",
        "tensorrt_llm.config.pbtxt": render_configs(cfg, templates_dir(), engine)["tensorrt_llm"],
    }
