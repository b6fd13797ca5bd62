"""What the PyTorch backend reads from a checkpoint folder: an HF checkpoint (config.json, weights, tokenizer),
and for a ModelOpt one also hf_quant_config.json, which names its quantization format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.errors import MissingArtifactError
from pipeline.sources import TOKENIZER_FILES

# Written by ModelOpt's export_hf_checkpoint beside the weights; TensorRT-LLM reads the format from it.
HF_QUANT_CONFIG = "hf_quant_config.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


def weight_files(folder: Path) -> list[str]:
    return sorted(p.name for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern))


def require_hf_checkpoint(folder: Path) -> dict[str, Any]:
    """The checkpoint's facts (architecture, weight and tokenizer files); MissingArtifactError when the
    folder lacks config.json or weights."""
    config_path = folder / "config.json"
    weights = weight_files(folder)
    if not config_path.is_file() or not weights:
        missing = "config.json" if not config_path.is_file() else "weights (*.safetensors)"
        raise MissingArtifactError(
            f"{folder} is not an HF checkpoint: it has no {missing}",
            hint="The PyTorch backend loads HF checkpoints; rerun the stage that wrote this folder with --force.",
        )
    config = json.loads(config_path.read_text(encoding="utf-8"))
    return {
        "architecture": (config.get("architectures") or [None])[0],
        "weight_files": weights,
        "tokenizer_files": [name for name in TOKENIZER_FILES if (folder / name).is_file()],
    }


def quant_algos(folder: Path) -> tuple[str | None, str | None]:
    """(quant_algo, kv_cache_quant_algo) of a ModelOpt checkpoint; (None, None) for a plain HF one."""
    path = folder / HF_QUANT_CONFIG
    if not path.is_file():
        return None, None
    quantization = json.loads(path.read_text(encoding="utf-8")).get("quantization", {})
    return quantization.get("quant_algo"), quantization.get("kv_cache_quant_algo")


def group_size(folder: Path) -> int | None:
    """The weight block size a ModelOpt checkpoint's hf_quant_config.json names (AWQ, NVFP4); None without."""
    path = folder / HF_QUANT_CONFIG
    if not path.is_file():
        return None
    value = json.loads(path.read_text(encoding="utf-8")).get("quantization", {}).get("group_size")
    return int(value) if value is not None else None
