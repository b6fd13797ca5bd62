"""Engine backends. Each provides the same three steps, looked up here by name so stages stay generic:
`convert(cfg, hf_dir, out_dir) -> facts`, `quantize(cfg, ckpt_dir, out_dir) -> facts`,
`build(cfg, ckpt_dir, out_dir) -> facts`. `out_dir` is a temporary folder the stage framework renames.
Optional: `quantize_data_files(cfg) -> {name: path}`, files outside the work dir the quantize step reads
(calibration data), whose contents key the stage's reuse."""

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
        "build": "pipeline.backends.trtllm.build:build",
        "plan": "pipeline.backends.trtllm.plan:plan",
    },
}


def backend_step(backend: str, step: str) -> Callable[..., Any] | None:
    target = _STEPS[backend].get(step)
    if target is None:
        return None
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)
