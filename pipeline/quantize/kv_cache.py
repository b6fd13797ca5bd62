"""quantize (torch backend) for an int8 KV cache over dense weights (quantization.mode none,
kv_cache_dtype int8): the checkpoint's files are linked unchanged and its config.json records
`kv_cache_quant_algo`, which the build step carries into the engine config. The runtime quantizes K/V as it
writes them, with a scale per token and head (runtime/kv_quant.py says why no offline calibration), so
there is nothing to compute here."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.artifacts import link_tree
from pipeline.config.build_config import BuildConfig


def quantize_kv_only(
    cfg: BuildConfig, pretrained: dict[str, Any], ckpt_dir: Path, out_dir: Path
) -> dict[str, Any]:
    """`pretrained`: the config.json of `ckpt_dir`, as quantize() read it."""
    started = time.perf_counter()
    quantization = {
        **(pretrained.get("quantization") or {}),
        "kv_cache_quant_algo": cfg.quantization.kv_cache_quant_algo,
    }
    pretrained = {**pretrained, "quantization": quantization}
    link_tree(ckpt_dir, out_dir)
    # The link shares the convert stage's inode: replace it rather than write through it.
    (out_dir / "config.json").unlink()
    (out_dir / "config.json").write_text(json.dumps(pretrained, indent=2) + "\n", encoding="utf-8")
    return {
        "quant_algo": None,
        "kv_cache_quant_algo": cfg.quantization.kv_cache_quant_algo,
        "seconds": round(time.perf_counter() - started, 2),
    }
