"""How to run one server: plain data, shared by the command builders (command.py, trtllm_launch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# What tensorrtllm_backend's launch_triton_server.py --multi-model adds to the environment.
ORCHESTRATOR_ENV = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}


@dataclass(frozen=True)
class TrtllmLaunch:
    """What launch_triton_server.py would be given for one TensorRT-LLM repository."""

    world_size: int = 1  # tp*pp of the engine (--world_size in leader mode)
    orchestrator: bool = False  # --multi-model: one tritonserver, the models spawn their MPI workers
    num_gpus: int = 1  # GPUs the host lists (orchestrator mode zeroes each one's CUDA memory pool)
    # NVIDIA_TRITON_SERVER_VERSION of the container ("25.12"); None: the variable is unset, which happens
    # only outside NVIDIA's containers, so the pinned (newer than 24.06) container is assumed.
    triton_version: str | None = None
    model_names: tuple[str, ...] = ("tensorrt_llm",)  # --tensorrt_llm_model_name: what ranks > 0 load

    @property
    def num_ranks(self) -> int:
        return 1 if self.orchestrator else self.world_size

    @property
    def env(self) -> dict[str, str]:
        """The variables the launch adds to the server's environment."""
        return dict(ORCHESTRATOR_ENV) if self.orchestrator else {}


@dataclass(frozen=True)
class ServerOptions:
    """How to run one server. Ports must be concrete (pick free ones before building a command)."""

    model_repository: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    exit_timeout_s: int = 5
    log_verbose: int = 0
    # A TensorRT-LLM repository: started the way tensorrtllm_backend's launcher starts it (under mpirun,
    # trtllm_launch.py); None: one plain tritonserver.
    trtllm: TrtllmLaunch | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)
