"""`llmpipe serve` on a trtllm_pytorch repository: the checks before anything starts (TensorRT-LLM of the
pinned release, GPUs, the llmapi model.py of NVIDIA's image), the one tritonserver it starts whatever tp*pp
(the LLM API spawns its own MPI workers), and `--dry-run` on any machine.

No TensorRT-LLM, GPU or NVIDIA tritonserver exists here: the probes of TensorRT-LLM and the GPUs are patched,
and a recording stand-in tritonserver goes on PATH."""

from __future__ import annotations

import shlex
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from pipeline.backends.trtllm import env
from pipeline.backends.trtllm_pytorch.package import UPSTREAM_MODEL_ENV
from pipeline.backends.trtllm_pytorch.serve_checks import preflight_serve
from pipeline.cli.main import cli
from pipeline.cli.serve import serve
from pipeline.config.build_config import BuildConfig
from pipeline.errors import BackendUnavailableError, ServingError
from tests.trtllm_pytorch_builds import STAND_IN_LLMAPI_MODEL as STAND_IN
from tests.trtllm_pytorch_builds import build, model_repo, write_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONTAINER_BIN = "/opt/tritonserver/bin/tritonserver"
H100 = env.Gpu(0, "NVIDIA H100 80GB HBM3", "9.0", 81559, 80000)
A100 = env.Gpu(0, "NVIDIA A100-SXM4-80GB", "8.0", 81920, 80000)


def runtime(monkeypatch: pytest.MonkeyPatch, trtllm: str | None, gpus: list[env.Gpu] | None) -> None:
    reason = "TensorRT-LLM is not installed (it needs an NVIDIA GPU host)"
    monkeypatch.setattr(env, "tensorrt_llm_version", lambda: env.Probe(trtllm, None if trtllm else reason))
    monkeypatch.setattr(env, "gpus", lambda: env.Probe(gpus, None if gpus else "nvidia-smi not found"))


@pytest.fixture
def tritonserver_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in NVIDIA tritonserver on PATH (no mpirun): it records its argv and the loader's variable
    into the returned folder and exits 3."""
    bin_dir, record = tmp_path / "nvidia-bin", tmp_path / "launched"
    bin_dir.mkdir()
    record.mkdir()
    server = bin_dir / "tritonserver"
    server.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}/argv\necho "${UPSTREAM_MODEL_ENV}" > {record}/env\nexit 3\n'
    )
    server.chmod(server.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return record


@pytest.fixture(scope="module")
def tp2(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A built tp=2, pp=2 repository's config."""
    config = write_config(
        tmp_path_factory.mktemp("tp2") / "tiny-tp2.yaml",
        tiny_llama_dir,
        parallel={"tp_size": 2, "pp_size": 2},
    )
    build(config)
    return config


def served(*args: str) -> Result:
    """The command itself: a refusal stays the exception it raised (the `llmpipe` group prints it)."""
    return CliRunner().invoke(serve, list(args))


def test_dry_run_prints_one_tritonserver_whatever_tp_and_pp(
    tp2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime(monkeypatch, None, None)  # a CPU machine: the dry run checks nothing
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no tritonserver on PATH: the container's path is shown
    repo = model_repo(tp2)
    for target in (tp2, repo):  # a build config, or the repository (its manifest records the backend)
        result = served(str(target), "--dry-run", "--http-port", "9000")
        assert result.exit_code == 0, result.output
        words = shlex.split(result.stdout)
        assert words[0] == CONTAINER_BIN and words[1] == f"--model-repository={repo}"
        assert "mpirun" not in words and words.count(CONTAINER_BIN) == 1 and "--http-port=9000" in words
        # The llmapi model hands Triton model.yaml's triton_config through auto_complete_config.
        assert "--disable-auto-complete-config" not in words


def test_dry_run_of_the_shipped_config_before_it_is_built(in_tmp_workdir: Path) -> None:
    shipped = Path(__file__).resolve().parents[2] / "build_configs" / "smollm2-135m-trtllm-pytorch-fp8.yaml"
    result = served(str(shipped), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "smollm2-135m-trtllm-pytorch-fp8 has no packaged model repository" in result.stderr
    repo = in_tmp_workdir / "build" / "smollm2-135m-trtllm-pytorch-fp8" / "model_repo"
    assert f"--model-repository={repo}" in shlex.split(result.stdout)


def test_a_cpu_host_is_refused_with_everything_it_lacks_before_anything_starts(
    tp2: Path, tritonserver_on_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime(monkeypatch, None, None)
    monkeypatch.delenv(UPSTREAM_MODEL_ENV, raising=False)
    for target in (tp2, model_repo(tp2)):
        result = served(str(target))
        assert isinstance(result.exception, BackendUnavailableError), result.output
        message = result.exception.message
        assert message.startswith("tiny-tp2 (backend trtllm_pytorch) cannot be served here: ")
        assert "TensorRT-LLM is not installed" in message and "no NVIDIA GPU: nvidia-smi not found" in message
        assert "/app/all_models/llmapi/tensorrt_llm/1/model.py not found" in message
        assert "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3" in (result.exception.hint or "")
        assert not (tritonserver_on_path / "argv").exists()
    printed = CliRunner().invoke(cli, ["serve", str(tp2)])  # as a user sees it: one line and the hint
    assert printed.exit_code == 1
    assert printed.output.startswith("Error: tiny-tp2 (backend trtllm_pytorch) cannot be served here: ")
    assert printed.output.count("\n") == 3 and "\nHint: Serve it on a GPU host in " in printed.output


def test_another_release_or_too_few_gpus_are_refused(
    tp2: Path, tritonserver_on_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(UPSTREAM_MODEL_ENV, str(STAND_IN))
    runtime(monkeypatch, "1.2.1", [H100, H100])
    result = served(str(tp2))
    assert isinstance(result.exception, BackendUnavailableError)
    assert result.exception.message.endswith(
        "cannot be served here: TensorRT-LLM 1.2.1 is installed, the repository is written for 1.1.0; "
        "parallel.tp_size*pp_size=4 needs 4 GPUs, this machine has 2"
    )
    assert not (tritonserver_on_path / "argv").exists()


def test_a_gpu_that_cannot_run_the_format_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UPSTREAM_MODEL_ENV, str(STAND_IN))
    cfg = BuildConfig.model_validate(
        {"name": "f", "backend": "trtllm_pytorch", "source": {"kind": "local", "path": "m"},
         "quantization": {"mode": "fp8"}}
    )  # fmt: skip
    runtime(monkeypatch, "1.1.0", [A100])
    with pytest.raises(BackendUnavailableError) as refused:
        preflight_serve(cfg)
    assert refused.value.message.endswith(
        "quantization.mode=fp8 runs on SM89+ GPUs, GPU 0 (NVIDIA A100-SXM4-80GB) is SM80"
    )
    runtime(monkeypatch, "1.1.0", [H100])
    preflight_serve(cfg)  # Hopper runs FP8
    runtime(monkeypatch, "1.1.2", [H100])
    preflight_serve(cfg)  # a patch release of the pinned one


def test_a_host_with_everything_starts_one_tritonserver_on_the_repository(
    tp2: Path, tritonserver_on_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(UPSTREAM_MODEL_ENV, str(STAND_IN))
    runtime(monkeypatch, "1.1.0", [H100] * 4)
    result = served(str(tp2))
    assert isinstance(result.exception, ServingError) and "exited with code 3" in result.exception.message
    argv = (tritonserver_on_path / "argv").read_text().splitlines()
    assert argv[0] == f"--model-repository={model_repo(tp2)}"
    assert "--disable-auto-complete-config" not in argv
    assert not any(a.startswith("--load-model") for a in argv)
    # The loader's variable reaches the server's environment (and so its Python stubs).
    assert (tritonserver_on_path / "env").read_text().strip() == str(STAND_IN)
