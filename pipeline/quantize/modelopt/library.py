"""Importing ModelOpt: the supported release, what to install when it is missing, and its chatter kept out of
the terminal."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import warnings
from collections.abc import Iterator
from importlib import metadata
from typing import Any, TextIO

from pipeline.errors import BackendUnavailableError

DISTRIBUTION = "nvidia-modelopt"
# The releases whose quantize configs, exporters and saved state llmpipe uses: 0.47 (pyproject's `modelopt`
# extra) and 0.37, the one TensorRT-LLM 1.1 pins (its requirements.txt: nvidia-modelopt[torch]~=0.37.0), which
# the serving container carries.
OLDEST, NEWEST = (0, 37), (0, 47)
# The first release measured to quantize NVFP4 on the CPU (0.37 asserts that NVFP4's amax is a CUDA tensor).
NVFP4_ON_CPU = (0, 47)
# The first release measured to write a Qwen TensorRT-LLM config without TensorRT-LLM installed (0.37 builds
# it with TensorRT-LLM's own config class and has no fallback for Qwen).
QWEN_WITHOUT_TRTLLM = (0, 47)
LOG_NAME = "modelopt.log"
_INSTALL_HINT = "pip install 'llmpipe[modelopt]' (nvidia-modelopt 0.47: pure Python, runs on the CPU torch)"


def modelopt_version() -> str | None:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def require_modelopt(mode: str | None = None, decoder_type: str | None = None) -> str:
    """The installed ModelOpt version; BackendUnavailableError when it is absent, outside OLDEST..NEWEST, or
    cannot quantize `mode` on the CPU or export `decoder_type` here."""
    version = modelopt_version()
    if version is None or importlib.util.find_spec("modelopt") is None:
        raise BackendUnavailableError("NVIDIA ModelOpt is not installed", hint=_INSTALL_HINT)
    if not OLDEST <= release(version) <= NEWEST:
        raise BackendUnavailableError(
            f"nvidia-modelopt {version} is installed; llmpipe's ModelOpt steps support "
            f"{'.'.join(map(str, OLDEST))} to {'.'.join(map(str, NEWEST))}",
            hint=_INSTALL_HINT,
        )
    if mode == "nvfp4" and release(version) < NVFP4_ON_CPU:
        raise BackendUnavailableError(
            f"nvidia-modelopt {version} quantizes NVFP4 on CUDA only; llmpipe calibrates on the CPU",
            hint=_INSTALL_HINT,
        )
    if (
        decoder_type == "qwen"
        and release(version) < QWEN_WITHOUT_TRTLLM
        and not importlib.util.find_spec("tensorrt_llm")
    ):
        raise BackendUnavailableError(
            f"nvidia-modelopt {version} exports Qwen TensorRT-LLM checkpoints only with TensorRT-LLM installed",
            hint=_INSTALL_HINT,
        )
    return version


class ModelOptLog:
    """Where ModelOpt's prints ("Inserted 56 quantizers", its exporter's rank banner) and warnings (e.g. that
    the installed transformers is newer than the ones it was tested with) go, so the terminal shows the
    progress bars and llmpipe's own lines. The warnings are also kept, for the manifest."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else io.StringIO()
        self.warnings: list[str] = []

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        with contextlib.redirect_stdout(self.stream), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield
            finally:
                for warning in caught:
                    line = f"{warning.category.__name__}: {warning.message}"
                    self.stream.write(f"warning: {line}\n")
                    if line not in self.warnings:
                        self.warnings.append(line)


def import_modelopt(log: ModelOptLog) -> Any:
    """`modelopt.torch.quantization`, imported with its import-time warnings sent to `log`."""
    require_modelopt()
    with log.capture():
        import modelopt.torch.quantization as mtq
    return mtq
