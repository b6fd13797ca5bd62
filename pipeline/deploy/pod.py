"""Pod templates: the Triton container (its command is `llmpipe serve`, or for a multi-node group the
mpirun launch of trtllm_launch.py spread over the group's pods), the OpenAI API sidecar, volumes, probes
and a non-root, read-only-root security context.

Upstream: LeaderWorkerSet's TensorRT-LLM example starts the same kind of group, one mpirun on the leader
with `--host <pod>:<gpus per pod>,...` and `plm_rsh_agent` a script that runs `kubectl exec` into the pod,
the workers idling until their ranks arrive (kubernetes-sigs/lws:docs/examples/tensorrt-llm/build/server.py
@4aaf9d5, after triton-inference-server/tutorials' EKS multi-node chart).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.deploy.target import Target
from pipeline.deploy.values import DeployValues
from pipeline.serving.server.options import ServerOptions
from pipeline.serving.server.trtllm_launch import CONTAINER_TRITONSERVER, MPIRUN, launch_for, trtllm_command

SHM_PREFIX = "llmpipe_"  # one server per pod: no other server's regions to avoid
RSH_AGENT_DIR = "/etc/llmpipe-mpi"
RSH_AGENT = "kubectl-rsh"
TOOLS_DIR = "/opt/llmpipe-tools"
# mpirun's remote shell in a group: wait for the worker pod, then run the command in it through the API.
RSH_AGENT_SCRIPT = f"""#!/bin/sh
pod="$1"; shift
{TOOLS_DIR}/kubectl wait --for=condition=Ready "pod/$pod" --timeout=900s >&2 || exit 1
exec {TOOLS_DIR}/kubectl exec -i "$pod" -c triton -- /bin/sh -c "$*"
"""


def labels(target: Target, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "llmpipe",
        "app.kubernetes.io/instance": target.name,
        "app.kubernetes.io/component": component,
    }


def _serve_command(target: Target) -> list[str]:
    s = target.cfg.serving
    # --max-restarts 0: a crash ends the container, so the kubelet restarts it and counts it (CrashLoopBackOff
    # shows a model that keeps dying) instead of serve hiding restarts inside a pod that stays Running.
    return [
        "llmpipe", "serve", target.repo_in_pod, "--host", "0.0.0.0", "--http-port", str(s.http_port),
        "--grpc-port", str(s.grpc_port), "--metrics-port", str(s.metrics_port), "--no-openai",
        "--max-restarts", "0",
    ]  # fmt: skip


def leader_command(target: Target) -> tuple[list[str], dict[str, str]]:
    """The group's mpirun launch (and the variables it adds): trtllm_launch.py's command for every rank, with
    the group's pods as hosts, `gpus_per_pod` ranks each, reached through the kubectl remote shell. The
    pods are named <leader>, <leader>-1, ... (LeaderWorkerSet's naming); $(POD_NAME) is expanded by the
    kubelet from the downward API."""
    cfg, s = target.cfg, target.cfg.serving
    launch = launch_for(cfg, target.gpus_per_pod, None)
    options = ServerOptions(
        model_repository=Path(target.repo_in_pod),
        host="0.0.0.0",
        http_port=s.http_port,
        grpc_port=s.grpc_port,
        metrics_port=s.metrics_port,
    )
    command = trtllm_command(launch, options, CONTAINER_TRITONSERVER, SHM_PREFIX)
    assert command[:2] == [MPIRUN, "--allow-run-as-root"]
    hosts = ["$(POD_NAME)", *(f"$(POD_NAME)-{i}" for i in range(1, target.num_nodes))]
    placement = [
        "--host", ",".join(f"{host}:{target.gpus_per_pod}" for host in hosts),
        "--mca", "plm_rsh_agent", f"{RSH_AGENT_DIR}/{RSH_AGENT}",
    ]  # fmt: skip
    return [*command[:2], *placement, *command[2:]], launch.env


def _resources(values: DeployValues, gpus: int) -> dict[str, Any]:
    amounts: dict[str, str] = {"cpu": values.resources.cpu, "memory": values.resources.memory}
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security(values: DeployValues) -> dict[str, Any]:
    uid = values.run_as_user
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _mounts(target: Target) -> list[dict[str, Any]]:
    return [
        {"name": "model", "mountPath": target.mount_path, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]


def _env(target: Target, extra: dict[str, str]) -> list[dict[str, Any]]:
    # HOME on the writable /tmp: caches (HF, Triton's Python stubs) must not need the read-only root.
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"}]
    if target.multi_node:
        env.append({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    return env + [{"name": key, "value": value} for key, value in sorted(extra.items())]


def triton_container(target: Target, values: DeployValues, image: str) -> dict[str, Any]:
    s = target.cfg.serving
    if target.multi_node:
        command, added = leader_command(target)
    else:
        command, added = _serve_command(target), {}
    mounts = _mounts(target)
    if target.multi_node:
        mounts += [
            {"name": "mpi-rsh", "mountPath": RSH_AGENT_DIR, "readOnly": True},
            {"name": "tools", "mountPath": TOOLS_DIR, "readOnly": True},
        ]
    return {
        "name": "triton",
        "image": image,
        "imagePullPolicy": values.image_pull_policy,
        "command": command,
        "env": _env(target, added),
        "ports": [
            {"name": "http", "containerPort": s.http_port, "protocol": "TCP"},
            {"name": "grpc", "containerPort": s.grpc_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": s.metrics_port, "protocol": "TCP"},
        ],
        # Engines load for minutes: the startup probe holds the others off until Triton is ready once.
        "startupProbe": _probe("/v2/health/ready", 10, 90),
        "readinessProbe": _probe("/v2/health/ready", 5, 3),
        "livenessProbe": _probe("/v2/health/live", 10, 3),
        "resources": _resources(values, target.gpus_per_pod),
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }


def worker_container(target: Target, values: DeployValues, image: str) -> dict[str, Any]:
    """A group's other pods hold GPUs and wait: the leader's mpirun starts their ranks in them."""
    return {
        "name": "triton",
        "image": image,
        "imagePullPolicy": values.image_pull_policy,
        "command": ["sleep", "infinity"],
        "env": _env(target, {}),
        "resources": _resources(values, target.gpus_per_pod),
        "securityContext": _container_security(),
        "volumeMounts": _mounts(target),
    }


def openai_container(target: Target, values: DeployValues, image: str) -> dict[str, Any]:
    port = target.cfg.serving.openai_port or 9000
    env = _env(target, {})
    if values.openai_api_key_secret:
        env.append(
            {
                "name": "LLMPIPE_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": values.openai_api_key_secret, "key": "api-key"}},
            }
        )
    command = [
        "llmpipe", "openai-server", target.repo_in_pod, "--triton-grpc",
        f"127.0.0.1:{target.cfg.serving.grpc_port}", "--host", "0.0.0.0", "--port", str(port),
    ]  # fmt: skip
    return {
        "name": "openai",
        "image": image,
        "imagePullPolicy": values.image_pull_policy,
        "command": command,
        "env": env,
        "ports": [{"name": "openai", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "openai"}, "periodSeconds": 5},
        "resources": {
            "requests": {"cpu": "250m", "memory": "512Mi"},
            "limits": {"cpu": "1", "memory": "1Gi"},
        },
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "model", "mountPath": target.mount_path, "readOnly": True},  # the tokenizer
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def init_containers(target: Target, values: DeployValues, leader: bool) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    source = values.model_repository
    if source.source == "image":
        found.append(
            {
                "name": "model-repository",
                "image": source.image,
                "imagePullPolicy": values.image_pull_policy,
                "command": ["cp", "-a", f"{source.image_path}/.", target.mount_path],
                "securityContext": _container_security(),
                "volumeMounts": [{"name": "model", "mountPath": target.mount_path}],
            }
        )
    if leader and target.multi_node:
        found.append(
            {
                "name": "kubectl",
                "image": values.kubectl_image,
                "imagePullPolicy": values.image_pull_policy,
                "command": ["cp", "/opt/bitnami/kubectl/bin/kubectl", f"{TOOLS_DIR}/kubectl"],
                "securityContext": _container_security(),
                "volumeMounts": [{"name": "tools", "mountPath": TOOLS_DIR}],
            }
        )
    return found


def volumes(target: Target, values: DeployValues, leader: bool) -> list[dict[str, Any]]:
    source = values.model_repository
    model: dict[str, Any] = {"name": "model"}
    if source.source == "pvc":
        model["persistentVolumeClaim"] = {"claimName": claim_name(target, values), "readOnly": True}
    else:
        model["emptyDir"] = {}
    found = [
        model,
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": values.resources.shm_size}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if leader and target.multi_node:
        found += [
            {"name": "mpi-rsh", "configMap": {"name": f"{target.name}-mpi", "defaultMode": 0o555}},
            {"name": "tools", "emptyDir": {}},
        ]
    return found


def claim_name(target: Target, values: DeployValues) -> str:
    return values.model_repository.claim_name or f"{target.name}-model"


def pod_spec(target: Target, values: DeployValues, image: str, leader: bool = True) -> dict[str, Any]:
    containers = [
        triton_container(target, values, image) if leader else worker_container(target, values, image)
    ]
    if leader and values.openai and target.has_bls:
        containers.append(openai_container(target, values, image))
    spec: dict[str, Any] = {
        "securityContext": pod_security(values),
        "containers": containers,
        "volumes": volumes(target, values, leader),
        # Triton drains in-flight requests on SIGTERM (llmpipe serve stops it with its exit timeout).
        "terminationGracePeriodSeconds": 60,
    }
    if target.multi_node and leader:
        spec["serviceAccountName"] = f"{target.name}-mpi"
    else:
        spec["automountServiceAccountToken"] = False
    initial = init_containers(target, values, leader)
    if initial:
        spec["initContainers"] = initial
    return spec
