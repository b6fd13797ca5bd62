"""What `llmpipe serve` checks before it starts tritonserver on a trtllm_pytorch repository: TensorRT-LLM of the
pinned release, enough GPUs that run the checkpoint's formats, and the llmapi model.py the repository's loader
runs. Everything missing is named in one error, before any process starts (a CPU host fails here, clearly,
instead of in a model's log)."""

from __future__ import annotations

from pipeline.backends.trtllm import env
from pipeline.backends.trtllm_pytorch import release
from pipeline.backends.trtllm_pytorch.package import UPSTREAM_MODEL_ENV, upstream_model_file
from pipeline.config.build_config import BuildConfig
from pipeline.errors import BackendUnavailableError


def _runtime_problems() -> list[str]:
    found = env.tensorrt_llm_version()
    if found.value is None:
        return [found.reason or "TensorRT-LLM is not installed"]
    if not release.is_pinned_release(str(found.value)):
        return [f"TensorRT-LLM {found.value} is installed, the repository is written for {release.PINNED}"]
    return []


def _gpu_problems(cfg: BuildConfig) -> list[str]:
    probe = env.gpus()
    gpus = probe.value or []
    if not gpus:
        return [f"no NVIDIA GPU: {probe.reason}" if probe.reason else "no NVIDIA GPU"]
    needed = cfg.parallel.world_size
    problems = []
    if len(gpus) < needed:
        problems.append(
            f"parallel.tp_size*pp_size={needed} needs {needed} GPUs, this machine has {len(gpus)}"
        )
    q = cfg.quantization
    for name, value, gpu_range in (
        ("quantization.mode", q.mode, release.GPU_RANGE_FOR_QUANT[q.mode]),
        ("quantization.kv_cache_dtype", q.kv_cache_dtype, release.GPU_RANGE_FOR_KV[q.kv_cache_dtype]),
    ):
        for gpu in gpus[:needed]:
            if not release.runs_on(gpu_range, gpu.sm):
                problems.append(
                    f"{name}={value} runs on {release.sm_range_label(gpu_range)} GPUs, GPU {gpu.index} "
                    f"({gpu.name}) is SM{gpu.sm}"
                )
    return problems


def _upstream_model_problems() -> list[str]:
    source = upstream_model_file()
    if source.is_file():
        return []
    return [f"{source} not found (TensorRT-LLM's llmapi model, which the repository runs; {UPSTREAM_MODEL_ENV} "
            "names another folder holding it)"]  # fmt: skip


def preflight_serve(cfg: BuildConfig) -> None:
    """BackendUnavailableError naming everything this machine lacks to serve `cfg`'s repository."""
    problems = [*_runtime_problems(), *_gpu_problems(cfg), *_upstream_model_problems()]
    if problems:
        raise BackendUnavailableError(
            f"{cfg.name} (backend trtllm_pytorch) cannot be served here: " + "; ".join(problems),
            hint=f"Serve it on a GPU host in {release.PINNED_CONTAINER} (TensorRT-LLM {release.PINNED} and its "
            "llmapi model); `llmpipe serve CONFIG --dry-run` prints the command on any machine.",
        )
