"""Engine backends. Each provides the same three steps, looked up here by name so stages stay generic:
`convert(cfg, hf_dir, out_dir) -> facts`, `quantize(cfg, ckpt_dir, out_dir) -> facts`,
`build(cfg, ckpt_dir, out_dir) -> facts`. `out_dir` is a temporary folder the stage framework renames.
Optional: `quantize_data_files(cfg) -> {name: path}`, files outside the work dir the quantize step reads
(calibration data), whose contents key the stage's reuse; `plan(cfg, workdir, stage) -> lines`, what
`--dry-run` adds for convert, quantize and engine."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_STEPS: dict[str, dict[str, str]] = {
    "torch": {
        "convert": "pipeline.backends.torch.checkpoint:convert",
        "quantize": "pipeline.quantize.run:quantize",
        "quantize_data_files": "pipeline.quantize.run:data_files",
        "build": "pipeline.backends.torch.build:build",
    },
    "trtllm": {
        "convert": "pipeline.backends.trtllm.convert:convert",
        "quantize": "pipeline.backends.trtllm.quantize:quantize",
        "quantize_data_files": "pipeline.backends.trtllm.quantize:data_files",
        "build": "pipeline.backends.trtllm.build:build",
        "plan": "pipeline.backends.trtllm.plan:plan",
    },
    "trtllm_pytorch": {
        "convert": "pipeline.backends.trtllm_pytorch.convert:convert",
        "quantize": "pipeline.backends.trtllm_pytorch.quantize:quantize",
        # the same calibration inputs as the engine route (both calibrate with ModelOpt)
        "quantize_data_files": "pipeline.backends.trtllm.quantize:data_files",
        "build": "pipeline.backends.trtllm_pytorch.build:build",
        "plan": "pipeline.backends.trtllm_pytorch.plan:plan",
    },
}


def backend_step(backend: str, step: str) -> Callable[..., Any] | None:
    target = _STEPS[backend].get(step)
    if target is None:
        return None
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)
