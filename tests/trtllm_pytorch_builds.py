"""Shared by the trtllm_pytorch package and serve tests: a build config of the tiny model written to a file,
`llmpipe build` of it, and the stand-in of the llmapi model.py that NVIDIA's serving image carries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from click.testing import CliRunner

from pipeline.cli.main import cli

STAND_IN_LLMAPI_MODEL = Path(__file__).resolve().parent / "stand_in_llmapi_model"


def write_config(path: Path, hf_dir: Path, **sections: Any) -> Path:
    """A trtllm_pytorch build config of `hf_dir` named after the file, building under build/ beside it."""
    data = {
        "name": path.stem, "backend": "trtllm_pytorch", "source": {"kind": "local", "path": str(hf_dir)},
        "workdir": str(path.parent / "build" / path.stem),
        "engine": {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128, "max_num_tokens": 128},
        **sections,
    }  # fmt: skip
    path.write_text(yaml.safe_dump(data))
    return path


def model_repo(config: Path) -> Path:
    return (config.parent / "build" / config.stem / "model_repo").resolve()


def build(config: Path) -> tuple[Path, str]:
    """`llmpipe build CONFIG`: (the model repository, what the command printed)."""
    result = CliRunner().invoke(cli, ["build", str(config)])
    assert result.exit_code == 0, result.output
    return model_repo(config), result.output
