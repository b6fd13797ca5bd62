"""build (trtllm): run `trtllm-build` on the (quantized) checkpoint, log kept beside the engine.

The engine manifest records what the serve-time version check needs: the TensorRT-LLM and TensorRT versions that built it and
the GPU compute capability it was built for. The guards run first, so a wrong setting fails in a second
instead of after a long TensorRT build.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.artifacts import link_tree
from pipeline.backends.trtllm import env, guards
from pipeline.backends.trtllm.api import load_api
from pipeline.backends.trtllm.build_cmd import BUILD_LOG_NAME, NETWORK_DIRNAME, format_argv, trtllm_build_argv
from pipeline.backends.trtllm.inspect.onnx_check import network_files
from pipeline.backends.trtllm.versions import release_for_runtime
from pipeline.config.build_config import BuildConfig
from pipeline.errors import BackendUnavailableError, PipelineError
from pipeline.runtime.engine_config import TOKENIZER_DIR

# Kept beside the work dir when a build fails (the engine's temporary folder is removed).
FAILED_LOG_NAME = "trtllm-build.failed.log"


class EngineBuildError(PipelineError):
    """trtllm-build exited non-zero."""


def run_logged(argv: list[str], log_path: Path) -> int:
    """Run argv, streaming its combined output to stderr and to `log_path`; return the exit code."""
    with log_path.open("w", encoding="utf-8") as log:
        log.write("$ " + format_argv(argv) + "\n")
        log.flush()
        with subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                sys.stderr.write(line)
            return proc.wait()


def _tensorrt_version() -> str | None:
    found = env.tensorrt_version().value
    if found:
        return str(found)
    try:
        import tensorrt

        return str(tensorrt.__version__)
    except ImportError:
        return None


def _weight_bytes_per_gpu(ckpt_dir: Path, world_size: int) -> int:
    # Each rank file holds exactly that rank's shard; the largest one bounds what a GPU must hold.
    return max((ckpt_dir / f"rank{r}.safetensors").stat().st_size for r in range(world_size))


def preflight_build(cfg: BuildConfig, ckpt_dir: Path, gpus: list[env.Gpu]) -> dict[str, int]:
    """All build-time guards; returns the KV numbers for the manifest."""
    ckpt_config = json.loads((ckpt_dir / "config.json").read_text())
    guards.check_build_features(cfg)
    guards.check_gpu_supports(cfg, gpus)
    guards.check_world_size(cfg, gpus)
    guards.check_prompt_limits(cfg, ckpt_config)
    smallest = min(gpus, key=lambda g: g.memory_free_mib)
    capacity = guards.kv_capacity_tokens(
        cfg,
        ckpt_config,
        smallest.memory_free_mib << 20,
        _weight_bytes_per_gpu(ckpt_dir, cfg.parallel.world_size),
    )
    return guards.check_kv_capacity(cfg, capacity)


def build(cfg: BuildConfig, ckpt_dir: Path, out_dir: Path) -> dict[str, Any]:
    api = load_api()
    target = release_for_runtime(api.version)
    found = env.gpus()
    if not found.value:
        raise BackendUnavailableError(f"trtllm-build needs an NVIDIA GPU: {found.reason}")
    gpus: list[env.Gpu] = found.value
    kv_numbers = preflight_build(cfg, ckpt_dir, gpus)
    argv = trtllm_build_argv(cfg, ckpt_dir, out_dir, target=target)
    if shutil.which(argv[0]) is None:
        raise BackendUnavailableError(f"{argv[0]} is not on PATH although tensorrt_llm imports; reinstall it")
    if cfg.engine.visualize_network:  # trtllm-build writes its network file here but never creates the folder
        (out_dir / NETWORK_DIRNAME).mkdir(parents=True, exist_ok=True)
    log_path = out_dir / BUILD_LOG_NAME
    code = run_logged(argv, log_path)
    if code != 0:
        kept = out_dir.parent / FAILED_LOG_NAME
        shutil.copy2(log_path, kept)
        raise EngineBuildError(
            f"trtllm-build exited with {code}; its log is {kept}",
            hint="Out of memory? Lower engine.max_batch_size / max_num_tokens.",
        )
    missing = [n for n in ["config.json", *(f"rank{r}.engine" for r in range(cfg.parallel.world_size))]
               if not (out_dir / n).is_file()]  # fmt: skip
    if missing:
        raise EngineBuildError(f"trtllm-build succeeded but wrote no {', '.join(missing)} into {out_dir}")
    if (ckpt_dir / TOKENIZER_DIR).is_dir():  # what `package` gives preprocessing and postprocessing
        link_tree(ckpt_dir / TOKENIZER_DIR, out_dir / TOKENIZER_DIR)
    engine_config = json.loads((out_dir / "config.json").read_text())
    network = network_files(out_dir / NETWORK_DIRNAME)
    gpu = gpus[0]
    return {
        "release": target.version,
        "tensorrt_llm_version": api.version,
        "tensorrt_version": _tensorrt_version(),
        "engine_version": engine_config.get("version"),
        "gpu_name": gpu.name,
        "gpu_compute_capability": gpu.compute_capability,
        "world_size": cfg.parallel.world_size,
        "argv": argv,
        "build_log": BUILD_LOG_NAME,
        "network_onnx": network,
        **kv_numbers,
        "tool_packages": ["tensorrt_llm"],
    }
