"""Where tritonserver is, and the command line and environment to run it: pure functions, tested alone.

Two installs are supported:
- a `tritonserver` on PATH (NVIDIA's containers): it brings its own backends and Python, nothing to set;
- the binary bundled in the `nvidia-pytriton` wheel (CPU machines, CI): it needs a per-server backend
  folder, its shared libraries on LD_LIBRARY_PATH and this interpreter's prefix on PATH
  (nvidia-pytriton ships the server without them).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import ServingError
from pipeline.serving.server.options import ServerOptions, TrtllmLaunch
from pipeline.serving.server.trtllm_launch import trtllm_command
from pipeline.util.openmp import default_wait_policy
from pipeline.util.package_data import IMPORT_ROOT

_INSTALL_HINT = (
    "Install the server with `pip install --no-deps nvidia-pytriton==0.7.0` (`make install` does), "
    "or put NVIDIA's tritonserver on PATH."
)


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    # Only for the wheel's binary: the pieces a per-server backend folder is assembled from.
    python_backend: Path | None = None  # holds libtriton_python.so and triton_python_backend_utils.py
    stub: Path | None = None  # triton_python_backend_stub for this interpreter's Python version
    libs: Path | None = None  # nvidia_pytriton.libs: the bundled shared libraries

    @property
    def bundled(self) -> bool:
        return self.python_backend is not None


def find_tritonserver(path_env: str | None = None) -> TritonInstall:
    """The tritonserver on PATH if any, else the one bundled in the nvidia-pytriton wheel."""
    on_path = shutil.which("tritonserver", path=path_env if path_env is not None else os.environ.get("PATH"))
    if on_path:
        return TritonInstall(Path(on_path))
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServingError(
            "tritonserver is not on PATH and the nvidia-pytriton wheel is not installed", hint=_INSTALL_HINT
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstall(
        binary=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        libs=root.parent.parent / "nvidia_pytriton.libs",
    )
    for needed in (install.binary, install.python_backend, install.stub, install.libs):
        if needed is not None and not needed.exists():
            raise ServingError(
                f"the nvidia-pytriton install is incomplete: {needed} is missing "
                f"(Python {version} needs its own backend stub)",
                hint=_INSTALL_HINT,
            )
    return install


def prepare_backend_dir(install: TritonInstall, run_dir: Path) -> Path | None:
    """Assemble `<run_dir>/backends/python/` for the wheel's binary; None for a full install.

    NOTE: triton_python_backend_utils.py must sit beside the stub's library, or every Python model fails
    with the misleading "No module named 'model'".
    """
    if not install.bundled:
        return None
    assert install.python_backend is not None and install.stub is not None
    python_dir = run_dir / "backends" / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(install.python_backend / name, python_dir / name)
    shutil.copy2(install.stub, python_dir / "triton_python_backend_stub")
    return python_dir.parent


def server_env(
    install: TritonInstall, base: dict[str, str] | None = None, trtllm: TrtllmLaunch | None = None
) -> dict[str, str]:
    """The environment for tritonserver and the Python stubs it starts."""
    env = dict(os.environ if base is None else base)
    if trtllm is not None:
        env.update(trtllm.env)
    # The stub must import this very `pipeline` package, installed or not.
    package_root = str(IMPORT_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    default_wait_policy(env)  # the engine stub shares the cores with the server and the other stubs
    if not install.bundled:
        return env
    # The stub finds its sys.prefix by looking up python3 on PATH: put this interpreter's first.
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH", "")) if p)
    # Without the bundled libs the stub cannot load libcudart and the server hangs in "loading";
    # without LIBDIR it may pick a system libpython of another patch version.
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    parts = [str(install.libs), libdir, env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in parts if p)
    return env


def server_args(opts: ServerOptions, backend_dir: Path | None, shm_prefix: str) -> list[str]:
    """tritonserver's arguments (without the binary) for a single server."""
    args = [f"--model-repository={opts.model_repository}"]
    if backend_dir is not None:
        args.append(f"--backend-directory={backend_dir}")
        # Smaller shared-memory arenas than the 1 GiB default: the CPU models move little data.
        args += [
            "--backend-config=python,shm-default-byte-size=4194304",
            "--backend-config=python,shm-growth-byte-size=1048576",
        ]
    args += [
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        "--pinned-memory-pool-byte-size=0",
        "--allow-gpu-metrics=false",
        f"--exit-timeout-secs={opts.exit_timeout_s}",
        f"--log-verbose={opts.log_verbose}",
        f"--http-address={opts.host}",
        f"--http-port={opts.http_port}",
        f"--grpc-address={opts.host}",
        f"--grpc-port={opts.grpc_port}",
        f"--metrics-address={opts.host}",
        f"--metrics-port={opts.metrics_port}",
    ]
    return args + list(opts.extra_args)


def server_command(binary: Path, opts: ServerOptions, backend_dir: Path | None, shm_prefix: str) -> list[str]:
    """The whole command: tritonserver alone, or a TensorRT-LLM repository's mpirun launch."""
    if opts.trtllm is not None:
        return trtllm_command(opts.trtllm, opts, binary, shm_prefix)
    return [str(binary), *server_args(opts, backend_dir, shm_prefix)]
