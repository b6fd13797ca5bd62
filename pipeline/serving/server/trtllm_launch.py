"""How a TensorRT-LLM model repository is started: the command and environment of tensorrtllm_backend's
`scripts/launch_triton_server.py`, flag for flag, plus the few flags llmpipe adds. Pure functions.

Upstream facts (the script's `get_cmd` and `__main__`; identical for the options used here in
triton-inference-server/tensorrtllm_backend:scripts/launch_triton_server.py@89ee0f2 (v0.19.0, the last
release whose tree holds the script) and in its later home
NVIDIA/TensorRT-LLM:triton_backend/scripts/launch_triton_server.py@0b06796 and @0a2e2c1 (1.x; their extra
--trtllm_llmapi_launch / --exit_timeout / --no-mpi options are not used here):

- The command is always `mpirun --allow-run-as-root`, then per rank i of `--world_size`:
  `-n 1 <tritonserver> --model-repository=<repo> --grpc-port=G --http-port=H --metrics-port=M`,
  for i > 0 `--model-control-mode=explicit` and one `--load-model=<name>` per `--tensorrt_llm_model_name`
  (comma list, default `tensorrt_llm`), then (multi-model only, below) the memory-pool flags, then the three
  port flags again (`add_port_config` is called twice), then `--disable-auto-complete-config
  --backend-config=python,shm-region-prefix-name=prefix{i}_` and `:` (after every rank, the last too).
- Leader mode (the default): one tritonserver per GPU rank; only rank 0 loads the whole repository. The other
  ranks are given the same ports but never open them: they do not return from the tensorrt_llm model's
  initialization (tensorrtllm_backend:README.md@v0.18.0, "Leader Mode").
- `--multi-model` (orchestrator mode): the environment gets `TRTLLM_ORCHESTRATOR=1` and
  `TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1`, `--world_size` must be 1 (the tensorrt_llm models spawn their
  own MPI workers), and, when `NVIDIA_TRITON_SERVER_VERSION` > 24.06, rank 0 gets
  `--pinned-memory-pool-byte-size=0 --enable-peer-access=false` and `--cuda-memory-pool-byte-size=<j>:0`
  for each GPU j that `nvidia-smi --list-gpus` lists.

Orchestrator mode is the one for several tensorrt_llm models in one repository
(tensorrtllm_backend:README.md@v0.18.0, "TRT-LLM Multi-instance Support"), and draft-target speculation
(target and draft engines: two models) needs it once the engines use tensor parallelism
(NVIDIA/TensorRT-LLM:examples/draft_target_model/README.md@11925f6, Triton workflow step 4: `--multi-model`
with `--world_size=1`). So llmpipe launches draft-target builds with tp*pp > 1 in orchestrator mode and
everything else in leader mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.serving.server.options import ORCHESTRATOR_ENV, ServerOptions, TrtllmLaunch

if TYPE_CHECKING:
    from pipeline.config.build_config import BuildConfig

__all__ = ["ORCHESTRATOR_ENV", "TrtllmLaunch", "launch_for", "trtllm_command"]

MPIRUN = "mpirun"
# The path launch_triton_server.py assumes (its --tritonserver default): where NVIDIA's containers put it.
CONTAINER_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")
# Orchestrator mode adds its memory-pool flags only on a Triton newer than this (check_triton_version).
_POOLS_AFTER_TRITON = (24, 6)


def launch_for(cfg: BuildConfig, num_gpus: int | None, triton_version: str | None) -> TrtllmLaunch:
    """The launch of a trtllm build's repository. `num_gpus`: the GPUs nvidia-smi lists (None where there is
    none, e.g. a dry run on another machine: the engine's own GPUs stand in)."""
    world_size = cfg.parallel.world_size
    return TrtllmLaunch(
        world_size=world_size,
        orchestrator=cfg.speculative.mode == "draft_model" and world_size > 1,
        num_gpus=num_gpus or world_size,
        triton_version=triton_version,
    )


def _pools_apply(triton_version: str | None) -> bool:
    if triton_version is None:
        return True
    try:
        parts = tuple(int(p) for p in triton_version.split(".")[:2])
    except ValueError:
        return True
    return parts > _POOLS_AFTER_TRITON


def _upstream_rank_args(
    launch: TrtllmLaunch, opts: ServerOptions, binary: Path, rank: int, shm_prefix: str
) -> list[str]:
    """One rank's part of the mpirun command as launch_triton_server.py builds it (without `-n 1` and `:`)."""
    ports = [
        f"--grpc-port={opts.grpc_port}",
        f"--http-port={opts.http_port}",
        f"--metrics-port={opts.metrics_port}",
    ]
    args = [str(binary), f"--model-repository={opts.model_repository}", *ports]
    if rank > 0:
        args += ["--model-control-mode=explicit", *(f"--load-model={name}" for name in launch.model_names)]
    if launch.orchestrator and _pools_apply(launch.triton_version):
        args += ["--pinned-memory-pool-byte-size=0", "--enable-peer-access=false"]
        args += [f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(launch.num_gpus)]
    # NOTE: the ports again, as upstream passes them: the same values, so the repeat changes nothing.
    return [
        *args,
        *ports,
        "--disable-auto-complete-config",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}{rank}_",
    ]


def _llmpipe_rank_args(opts: ServerOptions) -> list[str]:
    """What llmpipe adds after upstream's flags on every rank: bind addresses (loopback unless serving.host
    says otherwise; upstream binds every interface), the exit timeout its stop() waits on, the log level."""
    return [
        f"--http-address={opts.host}",
        f"--grpc-address={opts.host}",
        f"--metrics-address={opts.host}",
        f"--exit-timeout-secs={opts.exit_timeout_s}",
        f"--log-verbose={opts.log_verbose}",
        *opts.extra_args,
    ]


def trtllm_command(launch: TrtllmLaunch, opts: ServerOptions, binary: Path, shm_prefix: str) -> list[str]:
    """`mpirun --allow-run-as-root -n 1 tritonserver ... : [-n 1 tritonserver ... :]`; each rank's shared
    memory prefix is `<shm_prefix><rank>_` (upstream: prefix0_, prefix1_, ...)."""
    command = [MPIRUN, "--allow-run-as-root"]
    for rank in range(launch.num_ranks):
        command += ["-n", "1", *_upstream_rank_args(launch, opts, binary, rank, shm_prefix)]
        command += [*_llmpipe_rank_args(opts), ":"]
    return command
