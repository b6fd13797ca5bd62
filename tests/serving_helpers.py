"""Shared by the serving tests: a build config, a torch engine directory and a served model repository for
the tiny random Llama."""

from __future__ import annotations

import importlib.util
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.config.build_config import BuildConfig

if TYPE_CHECKING:
    from pipeline.serving.server.launcher import TritonServer

# max_seq_len leaves room for long generations, so that a cancellation lands before the request ends.
ENGINE_LIMITS = {"max_batch_size": 16, "max_input_len": 256, "max_seq_len": 1024, "max_num_tokens": 512}
MULTIBYTE_PROMPT = "héllo wörld, 日本語のテキスト 🚀"


def tiny_config(hf_dir: Path, *, decoupled: bool = True, **sections: Any) -> BuildConfig:
    data: dict[str, Any] = {
        "name": "tiny-serving",
        "source": {"kind": "local", "path": str(hf_dir)},
        "dtype": "float32",
        "engine": dict(ENGINE_LIMITS),
        "kv_cache": {"tokens_per_block": 16, "max_tokens": 16384},
        "serving": {"decoupled": decoupled, "streaming": decoupled},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return BuildConfig.model_validate(data)


def build_tiny_engine(hf_dir: Path, root: Path, **sections: Any) -> Path:
    """convert + build of the torch backend into `root/engine` (`sections` as for tiny_config); returns
    the engine directory."""
    from pipeline.backends.torch.build import build
    from pipeline.backends.torch.checkpoint import convert

    cfg = tiny_config(hf_dir, **sections)
    checkpoint, engine = root / "checkpoint", root / "engine"
    convert(cfg, hf_dir, checkpoint)
    build(cfg, checkpoint, engine)
    return engine


def cli_build_and_validate(
    hf_dir: Path, root: Path, name: str, quantization: dict[str, Any]
) -> dict[str, Any]:
    """`llmpipe build --until engine` then `llmpipe validate` of `hf_dir` (SmolLM2-sized limits) with
    `quantization`, both asserted to exit 0; returns validation.json."""
    import yaml
    from click.testing import CliRunner

    from pipeline.cli.main import cli

    config = root / f"{name}.yaml"
    engine = {"max_batch_size": 16, "max_input_len": 512, "max_seq_len": 1024, "max_num_tokens": 512}
    config.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "source": {"kind": "local", "path": str(hf_dir)},
                "workdir": str(root / "build"),
                "engine": engine,
                "kv_cache": {"tokens_per_block": 32, "max_tokens": 16384},
                "quantization": quantization,
            }
        )
    )
    for command in (["build", str(config), "--until", "engine"], ["validate", str(config)]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 0, result.stdout + result.stderr
    report: dict[str, Any] = json.loads((root / "build" / "validation" / "validation.json").read_text())
    return report


@contextmanager
def serve_tiny(
    hf_dir: Path,
    engine_dir: Path,
    repo: Path,
    *,
    prepare: Callable[[Path], None] | None = None,
    **sections: Any,
) -> Iterator[TritonServer]:
    """A real tritonserver on free loopback ports serving `engine_dir`, packaged into `repo` with
    tiny_config(hf_dir, **sections); `prepare(repo)` edits the repository before the server starts. Skips
    the caller when no tritonserver binary can be found."""
    from pipeline.serving.repository.render import render_model_repository
    from pipeline.serving.server.command import ServerOptions
    from pipeline.serving.server.launcher import TritonServer

    require_tritonserver()
    cfg = tiny_config(hf_dir, **sections)
    render_model_repository(cfg, engine_dir, repo)
    if prepare is not None:
        prepare(repo)
    # A roomy exit timeout: the tests check that shutdown is clean, not fast, on a busy 2-core machine.
    options = ServerOptions(repo, http_port=0, grpc_port=0, metrics_port=0, exit_timeout_s=20)
    with TritonServer(options, ready_timeout_s=240) as server:
        yield server


def post_generate(http_url: str, model: str, body: dict[str, Any]) -> tuple[int, str]:
    """POST Triton's /v2/models/<model>/generate; (HTTP status, response body text), errors included."""
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", "replace")


def scrape_metrics(metrics_url: str) -> dict[str, float]:
    """Every sample on a Prometheus endpoint: 'family{labels}' -> value."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def metric(values: dict[str, float], family: str, **labels: str) -> float:
    """The one sample of `family` carrying all `labels`."""
    for key, value in values.items():
        if key.startswith(family + "{") and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    raise AssertionError(f"{family}{labels} not on the metrics endpoint")


def require_tritonserver() -> None:
    """Skip the calling test or fixture when no tritonserver binary can be found."""
    import pytest

    from pipeline.errors import ServingError
    from pipeline.serving.server.command import find_tritonserver

    try:
        find_tritonserver()
    except ServingError as err:
        pytest.skip(f"no tritonserver: {err}")


def soak_script() -> ModuleType:
    """scripts/soak.py as a module: its soak and burst loads, expected texts and KV gauge reader."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"
    spec = importlib.util.spec_from_file_location("llmpipe_soak", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class EngineStream:
    """One gRPC stream to an engine model: token ids in, every response's token ids collected."""

    def __init__(self, server: TritonServer, model: str = "tensorrt_llm") -> None:
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.model = model
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.tokens: list[int] = []
        self.sizes: list[
            int
        ] = []  # how many token ids each response carried (empty final responses left out)
        self.errors: list[str] = []
        self.finished = threading.Event()
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result: Any = None, error: Any = None) -> None:
        if error is not None:
            self.errors.append(error.message() if hasattr(error, "message") else str(error))
            self.finished.set()
            return
        ids = result.as_numpy("output_ids")
        if ids is not None and ids.size:
            self.tokens += ids.reshape(-1).tolist()
            self.sizes.append(int(ids.size))
        final = result.get_response().parameters.get("triton_final_response")
        if final is None or final.bool_param:
            self.finished.set()

    def send(self, request_id: str, **arrays: np.ndarray) -> None:
        inputs = []
        for name, array in arrays.items():
            tensor = self._grpc.InferInput(
                name, list(array.shape), "BOOL" if array.dtype == bool else "INT32"
            )
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        self.client.async_stream_infer(
            self.model, inputs, request_id=request_id, enable_empty_final_response=True
        )

    def generate(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> None:
        self.send(
            request_id,
            input_ids=np.array([prompt_ids], np.int32),
            input_lengths=np.array([[len(prompt_ids)]], np.int32),
            request_output_len=np.array([[max_tokens]], np.int32),
            streaming=np.array([[True]]),
        )

    def stop(self, request_id: str) -> None:
        """tensorrtllm_backend's stop request: dummy prompt tensors (required inputs) and stop=true."""
        self.send(
            request_id,
            input_ids=np.zeros((1, 1), np.int32),
            input_lengths=np.ones((1, 1), np.int32),
            request_output_len=np.ones((1, 1), np.int32),
            stop=np.array([[True]]),
        )

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=not self.finished.is_set())
        self.client.close()
