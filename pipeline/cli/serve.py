"""`llmpipe serve`: run tritonserver on a packaged model repository until Ctrl-C."""

from __future__ import annotations

import os
import shlex
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pipeline.cli.options import CONTEXT, overrides_option
from pipeline.errors import BackendUnavailableError, MissingArtifactError, ServingError
from pipeline.serving.server.command import ServerOptions, find_tritonserver, server_command
from pipeline.serving.server.launcher import TritonServer, failure_lines, free_port
from pipeline.serving.server.ports import check_ports_free
from pipeline.serving.server.trtllm_launch import CONTAINER_TRITONSERVER, TrtllmLaunch, launch_for

if TYPE_CHECKING:
    from pipeline.artifacts import Manifest
    from pipeline.config.build_config import BuildConfig
    from pipeline.serving.openai import BackgroundFrontEnd

DEFAULT_CONFIG = "build_configs/smollm2-135m.yaml"
DEFAULT_OPENAI_PORT = 9000  # serving.openai_port's default, for a repository served without its config


@dataclass(frozen=True)
class _TrtllmBuild:
    """What serving a TensorRT-LLM repository (backend trtllm or trtllm_pytorch) needs besides the folder: its
    build config and engine (trtllm_pytorch: the checkpoint)."""

    cfg: BuildConfig
    engine_dir: Path


def _serves_tensorrt_llm(repo: Path) -> bool:
    engine_config = repo / "tensorrt_llm" / "config.pbtxt"
    return engine_config.is_file() and 'backend: "tensorrtllm"' in engine_config.read_text(encoding="utf-8")


def _check_backend_available(repo: Path) -> None:
    """A TensorRT-LLM repository needs NVIDIA's trtllm container; say so before tritonserver fails."""
    if find_tritonserver().bundled:
        raise BackendUnavailableError(
            f"{repo} serves a TensorRT-LLM engine (backend tensorrtllm), which the tritonserver bundled in "
            "nvidia-pytriton does not have",
            hint="Serve it in NVIDIA's tritonserver:<yy.mm>-trtllm-python-py3 container (`make image`), "
            "or package a torch build.",
        )


def _trtllm_build(cfg: BuildConfig, manifest: Manifest | None) -> _TrtllmBuild:
    from pipeline.config.workdir import stage_output_dir

    # The engine the repository's gpt_model_path names (the package stage records it).
    recorded = manifest.facts.get("engine") if manifest is not None else None
    engine = recorded or stage_output_dir(cfg, "engine").resolve()
    return _TrtllmBuild(cfg, Path(engine))


def _from_repository(path: Path, starting: bool) -> tuple[ServerOptions, _TrtllmBuild | None, int | None]:
    if not any(path.glob("*/config.pbtxt")):
        raise MissingArtifactError(
            f"{path} is not a Triton model repository (no */config.pbtxt)",
            hint="Pass a build config, or the model_repo folder `llmpipe package` wrote.",
        )
    from pipeline.artifacts import MANIFEST_NAME, read_manifest
    from pipeline.config.build_config import build_config_from_dict

    options = ServerOptions(model_repository=path.resolve())
    manifest = read_manifest(path)
    # A trtllm_pytorch repository's model is a Python one: only its manifest tells it from a torch one.
    llmapi = manifest is not None and manifest.facts.get("backend") == "trtllm_pytorch"
    if not llmapi and not _serves_tensorrt_llm(path):
        return options, None, DEFAULT_OPENAI_PORT
    if starting and not llmapi:
        _check_backend_available(path)
    recorded = manifest.facts.get("build_config") if manifest is not None else None
    if manifest is None or not recorded:
        raise ServingError(
            f"{path} serves a TensorRT-LLM engine but records no build config, so the engine cannot be "
            "checked against the runtime before Triton loads it",
            hint="Serve it by its build config: `llmpipe serve CONFIG`.",
        )
    cfg = build_config_from_dict(recorded, origin=f"{path / MANIFEST_NAME} build_config")
    return options, _trtllm_build(cfg, manifest), cfg.serving.openai_port


def _from_config(
    target: str, overrides: tuple[str, ...], starting: bool
) -> tuple[ServerOptions, _TrtllmBuild | None, int | None]:
    from pipeline.artifacts import read_manifest
    from pipeline.config.build_config import load_build_config
    from pipeline.config.workdir import stage_output_dir

    cfg = load_build_config(target, overrides)
    repo = stage_output_dir(cfg, "package")
    manifest = read_manifest(repo)
    if manifest is None:
        problem = f"{cfg.name} has no packaged model repository at {repo}"
        hint = f"Build it first: `llmpipe build {target}`."
        if starting:
            raise MissingArtifactError(problem, hint=hint)
        click.echo(f"note: {problem} yet. {hint}", err=True)  # a dry run still shows the command
    if cfg.backend == "trtllm" and starting:
        _check_backend_available(repo)
    served_by_trtllm = cfg.backend in ("trtllm", "trtllm_pytorch")
    s = cfg.serving
    options = ServerOptions(
        model_repository=repo.resolve(),
        host=s.host,
        http_port=s.http_port,
        grpc_port=s.grpc_port,
        metrics_port=s.metrics_port,
    )
    return options, _trtllm_build(cfg, manifest) if served_by_trtllm else None, s.openai_port


def _launch_for(cfg: BuildConfig) -> TrtllmLaunch | None:
    """The mpirun launch of a trtllm repository; None for trtllm_pytorch, which runs one plain tritonserver
    whatever its tp*pp: the LLM API in the model's stub process starts its own tp*pp MPI workers.

    Upstream: triton-inference-server/tensorrtllm_backend:docs/llmapi.md@c75a081 sets tensor and pipeline
    parallelism in model.yaml and launches with launch_triton_server.py's default --world_size 1; the llmapi
    model.py (NVIDIA/TensorRT-LLM:triton_backend/all_models/llmapi/tensorrt_llm/1/model.py@044a90d) builds an
    MPI session of its own only when tritonserver runs in an MPI world of several ranks, else LLM(**args)
    spawns the workers; TensorRT-LLM's test of the model starts tp 1 with --no-mpi (a plain tritonserver) and
    tp 4 with trtllm-llmapi-launch under mpirun, its multi-node launcher
    (NVIDIA/TensorRT-LLM:tests/integration/defs/triton_server/test_triton_llmapi.py@222982d). Without the
    --disable-auto-complete-config that launcher passes: the model hands Triton model.yaml's triton_config
    through auto_complete_config.
    """
    if cfg.backend != "trtllm":
        return None
    from pipeline.backends.trtllm import env

    found = env.gpus().value
    return launch_for(cfg, len(found) if found else None, os.environ.get("NVIDIA_TRITON_SERVER_VERSION"))


def _preflight(build: _TrtllmBuild) -> None:
    """Each engine the repository serves (a draft-target build's draft too) against this machine's runtime
    and GPUs, and its config's features against its build flags, before any process starts; a trtllm_pytorch
    build: TensorRT-LLM's release, the GPUs and the llmapi model the repository runs."""
    if build.cfg.backend == "trtllm_pytorch":
        from pipeline.backends.trtllm_pytorch.serve_checks import preflight_serve as preflight_llmapi

        preflight_llmapi(build.cfg)
        return
    from pipeline.backends.trtllm.guards import preflight_serve
    from pipeline.config.workdir import draft_engine_dir

    preflight_serve(build.cfg, build.engine_dir)
    if build.cfg.speculative.mode == "draft_model":
        preflight_serve(*draft_engine_dir(build.cfg))


@click.command("serve", context_settings=CONTEXT)
@click.argument("target", required=False, default=DEFAULT_CONFIG, metavar="[CONFIG|MODEL_REPO]")
@overrides_option("serving.http_port=9100")
@click.option(
    "--host", help="Bind address [serving.host, 127.0.0.1]. 0.0.0.0 exposes the server to the network."
)
@click.option(
    "--http-port", type=click.IntRange(0, 65535), help="HTTP port [serving.http_port]; 0 = any free port."
)
@click.option(
    "--grpc-port", type=click.IntRange(0, 65535), help="gRPC port [serving.grpc_port]; 0 = any free port."
)
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Metrics port [serving.metrics_port].")
@click.option(
    "--ready-timeout",
    type=click.FloatRange(min=1),
    default=300.0,
    show_default=True,
    help="Seconds to wait for every model to load.",
)
@click.option(
    "--log-verbose",
    type=click.IntRange(0, 3),
    default=0,
    show_default=True,
    help="tritonserver --log-verbose level.",
)
@click.option(
    "--openai-port",
    type=click.IntRange(0, 65535),
    help="Port of the OpenAI-compatible API [serving.openai_port, 9000]; 0 = any free port.",
)
@click.option("--no-openai", is_flag=True, help="Run no OpenAI-compatible API beside Triton.")
@click.option(
    "--api-key",
    envvar="LLMPIPE_API_KEY",
    help="Make the OpenAI-compatible API require `Authorization: Bearer KEY` [$LLMPIPE_API_KEY].",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Restart tritonserver this many times when it crashes or a model's Python stub dies while "
    "serving; 0 exits non-zero at the first crash instead.",
)
@click.option("--verbose", "-v", is_flag=True, help="Print tritonserver's log while it runs.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the command that would start the server (mpirun and its environment for TensorRT-LLM) "
    "and exit; starts and checks nothing.",
)
def serve(
    target: str,
    overrides: tuple[str, ...],
    host: str | None,
    http_port: int | None,
    grpc_port: int | None,
    metrics_port: int | None,
    ready_timeout: float,
    log_verbose: int,
    openai_port: int | None,
    no_openai: bool,
    api_key: str | None,
    max_restarts: int,
    verbose: bool,
    dry_run: bool,
) -> None:
    """Serve a packaged model repository with NVIDIA Triton until Ctrl-C.

    CONFIG serves build/<name>/model_repo with the config's serving.* ports; MODEL_REPO serves that
    folder (ports 8000/8001/8002 unless given). Uses the tritonserver on PATH, else the one bundled in
    nvidia-pytriton. Binds 127.0.0.1 unless --host says otherwise; ports another process holds are refused
    before anything starts. A model that fails to load stops the server with its log lines. A crash while
    serving (tritonserver exits, or a model's Python stub dies, which Triton itself would go on reporting
    ready) kills the server at once, so in-flight requests fail now rather than hang, and restarts it on the
    same ports, up to --max-restarts times (a restart whose server fails to start counts, and the next one
    tries again); then serve exits 1 with the crash's log lines.

    Beside Triton, an OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions) answers on
    serving.openai_port (9000) over the repository's tensorrt_llm_bls model, unless --no-openai.

    A TensorRT-LLM (trtllm) repository is started as tensorrtllm_backend's launch_triton_server.py starts
    it: under mpirun, one tritonserver per GPU rank (tp*pp), or one orchestrator process for a draft-target
    build with tp*pp > 1. Before anything starts, the engine is checked against this machine: the
    TensorRT-LLM / TensorRT versions that built it, the GPU architecture, and the build flags the config's
    runtime features need.

    A trtllm_pytorch repository (TensorRT-LLM's llmapi model) runs in one tritonserver whatever its tp*pp:
    the LLM API starts its own MPI workers on the GPUs. It is checked first for TensorRT-LLM of the pinned
    release, GPUs that run the checkpoint's format, and the llmapi model.py of NVIDIA's serving image.

    \b
    Examples:
      llmpipe serve build_configs/smollm2-135m.yaml
      llmpipe serve build/tiny-llama/model_repo --http-port 9100 --grpc-port 9101 --metrics-port 9102
      llmpipe serve build_configs/smollm2-135m.yaml --dry-run
      llmpipe serve build_configs/llama3-8b-int4-awq-tp2.yaml --dry-run   # the mpirun command
      llmpipe serve build_configs/smollm2-135m-trtllm-pytorch-fp8.yaml --dry-run
    \b
    Then, from another terminal:
      llmpipe generate "Write a haiku about GPUs" --stream
      curl -X POST localhost:8000/v2/models/ensemble/generate -d '{"text_input": "Hi", "max_tokens": 32}'
      curl localhost:9000/v1/chat/completions -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'
    """
    path = Path(target)
    starting = not dry_run  # a dry run prints the command on any machine: no server or runtime checks
    if path.is_dir():
        options, trtllm_build, configured_openai_port = _from_repository(path, starting)
    else:
        options, trtllm_build, configured_openai_port = _from_config(target, overrides, starting)
    options = replace(
        options,
        log_verbose=log_verbose,
        host=options.host if host is None else host,
        http_port=options.http_port if http_port is None else http_port,
        grpc_port=options.grpc_port if grpc_port is None else grpc_port,
        metrics_port=options.metrics_port if metrics_port is None else metrics_port,
        trtllm=None if trtllm_build is None else _launch_for(trtllm_build.cfg),
    )
    server = TritonServer(options, ready_timeout_s=ready_timeout, echo_log=verbose)
    if dry_run:
        _print_plan(server, nvidia=trtllm_build is not None)
        return
    if trtllm_build is not None:
        _preflight(trtllm_build)
    front_port = None if no_openai else _either(openai_port, configured_openai_port)
    if front_port:
        check_ports_free(options.host, {"OpenAI": front_port})
    click.echo(f"starting tritonserver on {options.model_repository} ...", err=True)
    started = time.monotonic()
    with server, _openai_front_end(server, front_port, api_key) as front:
        click.echo(_ready_banner(server, time.monotonic() - started, front), err=True)
        _supervise(server, max_restarts)
    click.echo("tritonserver stopped.", err=True)


def _supervise(server: TritonServer, max_restarts: int) -> None:
    """Serve until stopped on request; restart the server after a crash, at most `max_restarts` times. A
    restart whose server fails to start counts as one and is tried again while restarts are left."""
    restarts = 0
    crash: str | None = None  # why the server must be started again; None while it serves
    while True:
        if crash is None:
            code = server.serve_forever()
            if server.stopped_on_request and server.health_failure is None:
                return
            crash = _crash_report(server, code)
        if restarts == max_restarts:
            raise ServingError(
                crash,
                hint="A stub dies of a crash or of the out-of-memory killer (`dmesg` tells which); "
                "--max-restarts sets how often serve starts the server again.",
            )
        restarts += 1
        click.echo(f"error: {crash}\nrestarting tritonserver ({restarts}/{max_restarts}) ...", err=True)
        started = time.monotonic()
        try:
            server.restart()
        except ServingError as failed:
            crash = f"the restarted server did not start: {failed.message}"
            continue
        crash = None
        click.echo(f"ready again in {time.monotonic() - started:.1f}s", err=True)


def _crash_report(server: TritonServer, code: int | None) -> str:
    """What went wrong, with what tritonserver logged while serving (not its shutdown after)."""
    if server.health_failure is not None:
        logged = failure_lines(server.health_failure_log, limit=20)
        return f"{server.health_failure}, so llmpipe stopped tritonserver. Its log while serving:\n  " + (
            "\n  ".join(logged) if logged else "(nothing since it became ready)"
        )
    lines = "\n  ".join(server.log_lines(since_ready=True)[-20:]) or "(nothing since it became ready)"
    return f"tritonserver exited with code {code} while serving:\n  {lines}"


def _print_plan(server: TritonServer, nvidia: bool) -> None:
    """The command (with the variables it adds to the environment) that would start the server. A
    TensorRT-LLM repository (`nvidia`) shows NVIDIA's tritonserver (the one on PATH, else the container's
    path) and is not checked against the engine: that needs the runtime, which serving checks first."""
    options = server.options
    if nvidia:
        binary = Path(shutil.which("tritonserver") or CONTAINER_TRITONSERVER)
        command = server_command(binary, options, None, server.shm_prefix)
        added = options.trtllm.env if options.trtllm is not None else {}
        env = [f"{key}={value}" for key, value in added.items()]
    else:
        install = find_tritonserver()
        backends = Path("<run dir>/backends") if install.bundled else None
        command, env = server_command(install.binary, options, backends, server.shm_prefix), []
    click.echo(" ".join(shlex.quote(part) for part in [*env, *command]))


@contextmanager
def _openai_front_end(
    server: TritonServer, port: int | None, api_key: str | None
) -> Iterator[BackgroundFrontEnd | None]:
    """The OpenAI-compatible API over the served repository's tensorrt_llm_bls model (inflight_batcher_llm
    repositories), once Triton is ready; None when turned off or the repository has no BLS model."""
    repo = server.options.model_repository
    if port is not None and not (repo / "tensorrt_llm_bls").is_dir():
        click.echo("note: no OpenAI-compatible API: the repository has no tensorrt_llm_bls model", err=True)
    if port is None or not (repo / "tensorrt_llm_bls").is_dir():
        yield None
        return
    from pipeline.serving.openai import BackgroundFrontEnd, OpenAIServerOptions

    host = server.options.host
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(
            f"warning: the OpenAI-compatible API listens on {host} without an API key (--api-key)", err=True
        )
    options = OpenAIServerOptions(repo, server.grpc_url, host, port or free_port(host), api_key or None)
    with BackgroundFrontEnd(options) as front:
        yield front


def _either(flag: int | None, configured: int | None) -> int | None:
    return configured if flag is None else flag


def _ready_banner(server: TritonServer, seconds: float, front: BackgroundFrontEnd | None = None) -> str:
    http = server.http_url
    if (server.options.model_repository / "ensemble").is_dir():
        model = "ensemble"
        attempt = f'llmpipe generate "Hello" --url {server.grpc_url} --stream'
    else:  # the llmapi interface: one model, tensorrt_llm, with upstream's sampling_param_* inputs
        model = "tensorrt_llm"
        request = '{"text_input": "Hello", "sampling_param_max_tokens": 32}'
        attempt = f"curl -s http://{http}/v2/models/{model}/generate -d '{request}'"
    return (
        f"ready in {seconds:.1f}s: {server.options.model_repository}\n"
        f"  HTTP     http://{http}   (POST /v2/models/{model}/generate, /generate_stream)\n"
        f"  gRPC     {server.grpc_url}\n"
        f"  metrics  {server.metrics_url}\n"
        + (f"  OpenAI   {front.url}/v1   (/models, /completions, /chat/completions)\n" if front else "")
        + f"  try:     {attempt}\n"
        "Press Ctrl-C to stop."
    )
