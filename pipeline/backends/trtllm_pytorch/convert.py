"""convert (trtllm_pytorch): carry the HF checkpoint and its tokenizer as they are.

The PyTorch backend loads HF checkpoints itself (there is no TensorRT-LLM checkpoint format on this route),
so this step only hard-links the folder through and records what it holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.artifacts import link_tree
from pipeline.backends.trtllm_pytorch.architectures import require_pytorch_architecture
from pipeline.backends.trtllm_pytorch.checkpoint import require_hf_checkpoint
from pipeline.config.build_config import BuildConfig


def convert(cfg: BuildConfig, hf_dir: Path, out_dir: Path) -> dict[str, Any]:
    facts = require_hf_checkpoint(hf_dir)
    require_pytorch_architecture(str(facts["architecture"] or ""))  # before anything is linked or calibrated
    link_tree(hf_dir, out_dir)
    return {**facts, "conversion": "none (the PyTorch backend loads the HF checkpoint)"}
