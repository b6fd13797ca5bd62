"""Which TensorRT-LLM release and container the PyTorch-backend route targets, and why; the GPUs each
quantization format runs on there. Data only: `doctor`, `--dry-run` and the engine step read it.

Why 1.1.0: it is the newest release that Triton's compatibility matrix lists in a container,
nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3 (TensorRT-LLM 1.1.0, TensorRT 10.13.3.9;
https://docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/introduction/compatibility.html),
and it has both halves of the route: the PyTorch backend behind the LLM API (the default backend since 1.0)
and the Triton model triton_backend/all_models/llmapi, which that container copies from TensorRT-LLM's
release/1.1 branch and whose tensorrt_llm wheel it installs at 1.1.0
(triton-inference-server/tensorrtllm_backend:dockerfile/Dockerfile.triton.trt_llm_backend@49aba4a).
Newer releases (1.2.x, 1.3 and 1.4 release candidates) have docs but no container that the matrix lists;
tensorrtllm_backend's Dockerfile builds 1.2.1 since 8addf2f, an image one builds oneself.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.backends.trtllm import versions as engine_route

# The engine route's pin: one release (and container) carries both routes.
PINNED = engine_route.PINNED
PINNED_CONTAINER = engine_route.PINNED_CONTAINER
# The TensorRT-LLM commit release 1.1.0's documentation was generated from (footer of its gh-pages pages).
SOURCE_COMMIT = "48b7b5d"


@dataclass(frozen=True)
class Route:
    """One way of running TensorRT-LLM under Triton, as `doctor` and `--dry-run` describe it."""

    backend: str  # the build config's `backend`
    summary: str
    release: str
    container: str
    why: str

    def describe(self) -> str:
        return f"{self.summary}; TensorRT-LLM {self.release} ({self.container}): {self.why}"

    def line(self) -> str:
        return f"route {self.backend}: {self.describe()}"


ROUTES: dict[str, Route] = {
    "trtllm": Route(
        "trtllm",
        "TensorRT engines built by trtllm-build, served by the C++ tensorrtllm backend",
        engine_route.PINNED,
        engine_route.PINNED_CONTAINER,
        "the removed route: TensorRT-LLM deleted trtllm-build, convert_checkpoint.py and the C++ backend in "
        "June-July 2026 (NVIDIA/TensorRT-LLM:docs/source/legacy/tensorrt-backend-removal.md@335107a), so it "
        "stays on the newest release that both has them and ships in a container; use backend "
        "trtllm_pytorch for anything new",
    ),
    "trtllm_pytorch": Route(
        "trtllm_pytorch",
        "the PyTorch backend through the LLM API: HF or ModelOpt checkpoints load as they are, no engine "
        "compilation, served by the Triton model all_models/llmapi or trtllm-serve",
        PINNED,
        PINNED_CONTAINER,
        "the current route; 1.1.0 is the newest release Triton's compatibility matrix lists in a container "
        "(25.12), and that container ships the llmapi model",
    ),
}

# Oldest and newest GPU compute capability (major*10+minor; None = no upper bound) each quantization format
# runs on in the PyTorch backend: release 1.1.0's hardware support matrix
# (NVIDIA/TensorRT-LLM:1.1.0/features/quantization.html@8660c119, gh-pages). Ampere is SM80, Ada SM89,
# Hopper SM90, Blackwell SM100 and later.
GPU_RANGE_FOR_QUANT: dict[str, tuple[int, int | None]] = {
    "none": (80, None),
    "fp8": (89, None),  # FP8 per tensor: Ada, Hopper, Blackwell
    "int4_awq": (80, 90),  # W4A16 AWQ: Ampere, Ada, Hopper (not Blackwell)
    "w4a8_awq": (89, 90),  # W4A8 AWQ: Ada, Hopper
    "nvfp4": (100, None),  # Blackwell
}
GPU_RANGE_FOR_KV: dict[str, tuple[int, int | None]] = {"auto": (80, None), "fp8": (80, None)}


def is_pinned_release(version: str) -> bool:
    """Whether installed TensorRT-LLM `version` is the pinned release line (a patch release of it counts as
    it, as on the engine route)."""
    return version.split(".")[:2] == PINNED.split(".")[:2]


def runs_on(gpu_range: tuple[int, int | None], sm: int) -> bool:
    low, high = gpu_range
    return low <= sm and (high is None or sm <= high)


def sm_range_label(gpu_range: tuple[int, int | None]) -> str:
    low, high = gpu_range
    if high is None:
        return f"SM{low}+"
    return f"SM{low}" if low == high else f"SM{low}-SM{high}"
