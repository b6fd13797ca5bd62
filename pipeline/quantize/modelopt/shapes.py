"""Will ModelOpt's TensorRT-LLM exporter accept these shapes? Answered from the HF config.json alone, before the
model is loaded and calibrated (minutes, for a large model) only to fail at export.

ModelOpt's exporter (modelopt/torch/export/postprocess.py, check_weight_shape_valid) requires of every quantized
linear layer that its input features split evenly over the tensor-parallel ranks and, for block formats, that
each rank's share is a multiple of the block. In a Llama-family decoder the input features are hidden_size
(q/k/v, gate/up), num_attention_heads * head_dim (o_proj) and intermediate_size (down_proj); the output head
stays unquantized.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.config.vocab import INT4_GROUP_SIZES
from pipeline.errors import ConfigError, MissingArtifactError
from pipeline.quantize.modelopt.formats import GROUP_SIZE_MODES, NVFP4_BLOCK, block_size
from pipeline.util.files import read_json_object


def input_features(hf_config: dict[str, Any]) -> dict[str, int]:
    """{name as the HF config spells it: size} of the quantized linears' input features."""
    heads = int(hf_config["num_attention_heads"])
    head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
    return {
        "hidden_size": int(hf_config["hidden_size"]),
        "num_attention_heads * head_dim": heads * head_dim,
        "intermediate_size": int(hf_config["intermediate_size"]),
    }


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise MissingArtifactError(f"no HF checkpoint at {hf_dir}", hint="Run `llmpipe fetch CONFIG` first.")
    return read_json_object(path)


def check_shapes(hf_config: dict[str, Any], mode: str, group_size: int, tp_size: int) -> None:
    """ConfigError naming the field, its value, the dimension that does not fit, and what would fit."""
    dims = input_features(hf_config)
    for name, size in dims.items():
        if size % tp_size:
            raise ConfigError(
                f"parallel.tp_size={tp_size} does not divide the model's {name}={size}: its quantized layers "
                "cannot be split over the ranks",
                hint=f"tp sizes that fit: {', '.join(map(str, _dividing(dims.values(), range(1, 9))))}",
            )
    block = block_size(mode, group_size)
    if block is None:
        return
    for name, size in dims.items():
        share = size // tp_size
        if share % block == 0:
            continue
        where = f"{name}={size}" + (
            f" / parallel.tp_size={tp_size} = {share} per rank" if tp_size > 1 else ""
        )
        if mode in GROUP_SIZE_MODES:
            fits = _dividing([size // tp_size for size in dims.values()], INT4_GROUP_SIZES)
            raise ConfigError(
                f"quantization.group_size={group_size} does not divide the model's {where} "
                f"(mode={mode} quantizes every layer's input features in groups of that size)",
                hint=f"group sizes that fit: {', '.join(map(str, fits))}"
                if fits
                else f"none of {', '.join(map(str, INT4_GROUP_SIZES))} fits; lower parallel.tp_size or use mode=fp8 / int8_sq",
            )
        raise ConfigError(
            f"quantization.mode={mode} quantizes in blocks of {NVFP4_BLOCK}, which do not divide the model's {where}",
            hint="lower parallel.tp_size or use another mode",
        )


def _dividing(sizes: Iterable[int], candidates: Iterable[int]) -> list[int]:
    sizes = list(sizes)
    return [c for c in candidates if all(size % c == 0 for size in sizes)]
