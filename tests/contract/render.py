"""What the contract pins for one build config: the generated trtllm-build command line, the tensorrt_llm
model parameters, the full rendered tensorrt_llm/config.pbtxt (the serving helper's template filled by
pipeline.serving.repository.render.render_configs), the tensorrt_llm_bls parameters, and for draft-target the
draft model's config.pbtxt, as the text of the files kept in expected/<name>/ (reviewed by hand against
the upstream sources named in expected/README.md). Paths are the work-dir layout relative to the current directory."""

from __future__ import annotations

import json
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pipeline.backends.trtllm.build_cmd import format_argv, trtllm_build_argv
from pipeline.backends.trtllm.triton_params import tensorrt_llm_parameters
from pipeline.config.build_config import BuildConfig, load_build_config
from pipeline.serving.repository.render import DRAFT_MODEL, DraftEngine, render_configs, templates_dir

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


def draft_of(cfg: BuildConfig) -> DraftEngine | None:
    """The draft engine of a draft-target config (its draft_config is a file beside it in configs/)."""
    if cfg.speculative.mode != "draft_model" or cfg.speculative.draft_config is None:
        return None
    draft = load(CONFIG_DIR / cfg.speculative.draft_config)
    return DraftEngine(draft, work_paths(draft)[1])


def bls_parameters(config_pbtxt: str) -> dict[str, str]:
    config = text_format.Parse(config_pbtxt, model_config_pb2.ModelConfig())
    return {k: v.string_value for k, v in sorted(config.parameters.items())}


def contract_files(cfg: BuildConfig) -> dict[str, str]:
    ckpt, engine = work_paths(cfg)
    argv = trtllm_build_argv(cfg, ckpt, engine)
    params = tensorrt_llm_parameters(cfg, engine)
    configs = render_configs(cfg, templates_dir(), engine, draft_of(cfg))
    files = {
        "trtllm-build.sh": format_argv(argv) + "\n",
        "tensorrt_llm.parameters.json": json.dumps(params, indent=2) + "\n",
        "tensorrt_llm.config.pbtxt": configs["tensorrt_llm"],
        "tensorrt_llm_bls.parameters.json": json.dumps(bls_parameters(configs["tensorrt_llm_bls"]), indent=2)
        + "\n",
    }
    if DRAFT_MODEL in configs:
        files[f"{DRAFT_MODEL}.config.pbtxt"] = configs[DRAFT_MODEL]
    return files
