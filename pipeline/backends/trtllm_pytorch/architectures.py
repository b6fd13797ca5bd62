"""The HF architectures TensorRT-LLM's PyTorch backend loads in the pinned release, as data.

This set is the trtllm_pytorch route's one home of the fact; its convert step and `--dry-run` plan refuse
anything else before a checkpoint is linked or calibrated, since the LLM API would stop at load time with
"Unknown architecture for AutoModelForCausalLM". Source: the model classes tensorrt_llm/_torch/models/
__init__.py imports in TensorRT-LLM 1.1.0 (each modeling_*.py registers its architecture with
register_auto_model), read in the 1.1.0rc6 merge of fork Ataraksia/TensorRT-LLM@a451bf93888ef588251268516ac6cd4be0a124c5,
and the release's "Supported Models" table (gh-pages 1.1.0/models/supported-models.html@8660c11, generated
from 48b7b5d). tests/contract/upstream/pytorch_backend_architectures.tsv records them.
"""

from __future__ import annotations

from pipeline.backends.trtllm.architectures import PYTORCH_ARCHITECTURES, other_routes
from pipeline.backends.trtllm_pytorch.release import PINNED
from pipeline.errors import UnsupportedModelError


def require_pytorch_architecture(arch: str) -> str:
    """`arch` when the PyTorch backend loads it; else UnsupportedModelError in one line."""
    if arch in PYTORCH_ARCHITECTURES:
        return arch
    raise UnsupportedModelError(
        f"backend trtllm_pytorch: architecture {arch or '(none)'} is not a model of TensorRT-LLM {PINNED}'s "
        f"PyTorch backend (register_auto_model); it has {', '.join(PYTORCH_ARCHITECTURES)}; "
        f"{other_routes(arch, 'trtllm_pytorch')}"
    )
