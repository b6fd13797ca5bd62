"""What this machine offers the engine path: GPUs (nvidia-smi), TensorRT-LLM / TensorRT, tritonserver.

Every probe answers without raising: a missing tool gives None plus a reason, so `llmpipe doctor` can print
a full table on any machine, and the build/serve guards can say exactly what is missing.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.backends.trtllm.versions import PINNED_CONTAINER
from pipeline.errors import BackendUnavailableError, PipelineError

_PROBE_TIMEOUT_S = 20


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    compute_capability: str  # "9.0"
    memory_total_mib: int
    memory_free_mib: int

    @property
    def sm(self) -> int:
        major, _, minor = self.compute_capability.partition(".")
        return int(major) * 10 + int(minor or 0)


@dataclass(frozen=True)
class Probe:
    value: Any
    reason: str | None = None  # why value is None

    def as_dict(self) -> dict[str, Any]:
        value = [asdict(g) for g in self.value] if isinstance(self.value, list) else self.value
        return {"value": value, "reason": self.reason}


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, env=env, check=False
    )


def parse_nvidia_smi_gpus(csv_text: str) -> list[Gpu]:
    """Rows of `--query-gpu=index,name,compute_cap,memory.total,memory.free --format=csv,noheader,nounits`."""
    gpus = []
    for line in csv_text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 5:
            continue
        index, name, cap, total, free = fields
        gpus.append(Gpu(int(index), name, cap, int(float(total)), int(float(free))))
    return gpus


def gpus() -> Probe:
    if shutil.which("nvidia-smi") is None:
        return Probe(None, "nvidia-smi not found (no NVIDIA driver on this machine)")
    try:
        done = _run([
            "nvidia-smi", "--query-gpu=index,name,compute_cap,memory.total,memory.free",
            "--format=csv,noheader,nounits",
        ])  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        return Probe(None, f"nvidia-smi failed: {err}")
    if done.returncode != 0:
        return Probe(None, f"nvidia-smi failed: {(done.stderr or done.stdout).strip()[:200]}")
    found = parse_nvidia_smi_gpus(done.stdout)
    return Probe(found, None if found else "nvidia-smi lists no GPU")


def cuda_driver_version() -> Probe:
    """Highest CUDA version the installed driver supports (nvidia-smi's header)."""
    if shutil.which("nvidia-smi") is None:
        return Probe(None, "nvidia-smi not found")
    try:
        done = _run(["nvidia-smi"])
    except (OSError, subprocess.TimeoutExpired) as err:
        return Probe(None, f"nvidia-smi failed: {err}")
    match = re.search(r"CUDA Version:\s*([0-9.]+)", done.stdout)
    return Probe(match.group(1)) if match else Probe(None, "nvidia-smi did not report a CUDA version")


def package_version(*dists: str) -> Probe:
    """Installed version of the first of `dists` that is installed (TensorRT ships under several names)."""
    for dist in dists:
        try:
            return Probe(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return Probe(None, f"{dists[0]} is not installed")


def tensorrt_llm_version() -> Probe:
    found = package_version("tensorrt_llm", "tensorrt-llm")
    if found.value is None:
        return Probe(None, trtllm_unavailable_reason())
    return found


def tensorrt_version() -> Probe:
    return package_version(
        "tensorrt", "tensorrt-cu12", "tensorrt-cu13", "tensorrt_cu12_libs", "tensorrt-cu12-libs"
    )


def trtllm_unavailable_reason() -> str | None:
    """None when `import tensorrt_llm` can work here, else one line saying why not and what to do."""
    if importlib.util.find_spec("tensorrt_llm") is not None:
        return None
    container = PINNED_CONTAINER
    return (
        "TensorRT-LLM is not installed (it needs an NVIDIA GPU host; PyPI has only installer stubs): "
        f"`pip install llmpipe[trtllm]` with NVIDIA's package index, or use the container {container} "
        "(`make image`)"
    )


def require_trtllm() -> None:
    """Raise BackendUnavailableError at once when the engine path cannot run on this machine."""
    reason = trtllm_unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(
            reason, hint="`llmpipe build CONFIG --dry-run` still prints the full plan."
        )


def parse_server_version(log: str) -> str | None:
    match = re.search(r"\|\s*server_version\s*\|\s*([0-9][0-9.]*)", log)
    return match.group(1) if match else None


def tritonserver_version() -> Probe:
    """Triton's version. `tritonserver` has no --version; started on a repository that does not exist it
    prints its option table (server_version included) and exits at once (~30 ms, no ports opened)."""
    from pipeline.serving.server.command import find_tritonserver, server_env

    try:
        install = find_tritonserver()
    except PipelineError as err:
        return Probe(None, err.message)
    binary, env = install.binary, server_env(install)
    with tempfile.TemporaryDirectory(prefix="llmpipe-doctor-") as scratch:
        argv = [
            str(binary), f"--model-repository={Path(scratch) / 'absent'}", "--allow-http=false",
            "--allow-grpc=false", "--allow-metrics=false", "--allow-gpu-metrics=false",
            "--pinned-memory-pool-byte-size=0",
        ]  # fmt: skip
        try:
            done = _run(argv, env=env)
        except (OSError, subprocess.TimeoutExpired) as err:
            return Probe(None, f"{binary} did not start: {err}")
    version = parse_server_version(done.stdout + done.stderr)
    if version is None:
        return Probe(None, f"{binary} printed no server_version (exit {done.returncode})")
    return Probe(version)


def torch_info() -> dict[str, Any]:
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return {"version": None, "cuda": None, "reason": "torch is not installed"}
    import torch

    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }


def python_version() -> str:
    return sys.version.split()[0]
