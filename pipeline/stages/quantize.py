"""quantize: apply the configured quantization to the converted checkpoint (a pass-through for mode none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.artifacts import link_tree
from pipeline.backends import backend_step
from pipeline.config.build_config import BuildConfig
from pipeline.stages.fetch import checkpoint_dir
from pipeline.stages.runner import StageInput, StageSpec


def produce(cfg: BuildConfig, inputs: dict[str, StageInput], out: Path) -> dict[str, Any]:
    q = cfg.quantization
    if q.mode == "none" and q.kv_cache_dtype == "auto":
        link_tree(inputs["convert"].dir, out)
        return {"quant_algo": None, "kv_cache_quant_algo": None, "pass_through": True}
    quantize = backend_step(cfg.backend, "quantize")
    assert quantize is not None
    facts = dict(quantize(cfg, inputs["convert"].dir, out, hf_dir=checkpoint_dir(inputs["fetch"])))
    facts.setdefault("quant_algo", q.quant_algo_for(cfg.backend))
    facts.setdefault("kv_cache_quant_algo", q.kv_cache_quant_algo)
    return facts


def describe(cfg: BuildConfig, out: Path) -> list[str]:
    q = cfg.quantization
    if q.mode == "none" and q.kv_cache_dtype == "auto":
        return [f"no quantization: hardlink the checkpoint into {out}"]
    return [
        f"{cfg.backend}: quantize {q.mode} (quant_algo {q.quant_algo_for(cfg.backend)}, group {q.group_size}, "
        f"kv {q.kv_cache_dtype}) -> {out}"
    ]


def data_files(cfg: BuildConfig) -> dict[str, Path]:
    files = backend_step(cfg.backend, "quantize_data_files")
    return files(cfg) if files is not None else {}


SPEC = StageSpec(
    name="quantize",
    config_sections=("backend", "quantization"),
    inputs=("fetch", "convert"),
    produce=produce,
    describe=describe,
    summary="Quantize the checkpoint (int8/int4 weight-only, AWQ, fp8, ... per backend).",
    data_files=data_files,
)
