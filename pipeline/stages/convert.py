"""convert: HF checkpoint -> the backend's checkpoint layout (TensorRT-LLM's unified checkpoint shape)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.backends import backend_step
from pipeline.config.build_config import BuildConfig
from pipeline.stages.fetch import checkpoint_dir
from pipeline.stages.runner import StageInput, StageSpec


def produce(cfg: BuildConfig, inputs: dict[str, StageInput], out: Path) -> dict[str, Any]:
    convert = backend_step(cfg.backend, "convert")
    assert convert is not None
    return dict(convert(cfg, checkpoint_dir(inputs["fetch"]), out))


def describe(cfg: BuildConfig, out: Path) -> list[str]:
    return [
        f"{cfg.backend}: convert the HF checkpoint for the backend (dtype {cfg.dtype}, tp {cfg.parallel.tp_size} "
        f"pp {cfg.parallel.pp_size}) -> {out}"
    ]


SPEC = StageSpec(
    name="convert",
    config_sections=("backend", "dtype", "parallel", "engine", "quantization"),
    inputs=("fetch",),
    produce=produce,
    describe=describe,
    summary="Convert the HF checkpoint into the backend's checkpoint (fused qkv / gate-up, tp/pp shards).",
)
