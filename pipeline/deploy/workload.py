"""The serving objects: a Deployment (one node per replica) or a LeaderWorkerSet (a group of nodes per
replica, leaderworkerset.x-k8s.io/v1), the Services, the NetworkPolicy and the model repository's claim."""

from __future__ import annotations

from typing import Any

from pipeline.deploy.pod import RSH_AGENT, RSH_AGENT_SCRIPT, claim_name, labels, pod_spec
from pipeline.deploy.target import Target
from pipeline.deploy.values import DeployValues

Manifest = dict[str, Any]


def default_image(target: Target) -> str:
    return "llmpipe:cpu" if target.gpus_per_pod == 0 else "llmpipe:trtllm"


def _meta(target: Target, name: str, component: str = "server") -> dict[str, Any]:
    return {"name": name, "labels": labels(target, component)}


def _annotations(target: Target) -> dict[str, str]:
    """What a rollout changes when the engine does: the pods restart on a new repository."""
    found = {"llmpipe.dev/model-repository-digest": target.manifest.digest}
    if target.engine_version:
        found["llmpipe.dev/tensorrt-llm-version"] = target.engine_version
    return found


def deployment(target: Target, values: DeployValues, image: str) -> Manifest:
    selector = labels(target, "server")
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(target, target.name),
        "spec": {
            "replicas": values.replicas
            if values.autoscaling.kind == "none"
            else values.autoscaling.min_replicas,
            "selector": {"matchLabels": selector},
            # A new engine comes up beside the old one and takes traffic only once ready.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": selector, "annotations": _annotations(target)},
                "spec": pod_spec(target, values, image),
            },
        },
    }


def leader_worker_set(target: Target, values: DeployValues, image: str) -> Manifest:
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": _meta(target, target.name),
        "spec": {
            "replicas": values.replicas
            if values.autoscaling.kind == "none"
            else values.autoscaling.min_replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "leaderWorkerTemplate": {
                "size": target.num_nodes,
                # One lost rank breaks the MPI world: the whole group restarts.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {"labels": labels(target, "server"), "annotations": _annotations(target)},
                    "spec": pod_spec(target, values, image, leader=True),
                },
                "workerTemplate": {
                    "metadata": {"labels": labels(target, "worker"), "annotations": _annotations(target)},
                    "spec": pod_spec(target, values, image, leader=False),
                },
            },
        },
    }


def mpi_objects(target: Target) -> list[Manifest]:
    """The leader's remote shell (a script) and the right to exec into its group's pods."""
    name = f"{target.name}-mpi"
    meta = _meta(target, name, "mpi")
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {RSH_AGENT: RSH_AGENT_SCRIPT}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name}],
        },
    ]


def services(target: Target, values: DeployValues) -> list[Manifest]:
    """The APIs (HTTP, gRPC, OpenAI) and, apart, the metrics port that Prometheus scrapes."""
    s = target.cfg.serving
    ports = [
        {"name": "http", "port": s.http_port, "targetPort": "http", "protocol": "TCP"},
        {"name": "grpc", "port": s.grpc_port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"},
    ]
    if values.openai and target.has_bls:
        ports.append(
            {"name": "openai", "port": s.openai_port or 9000, "targetPort": "openai", "protocol": "TCP"}
        )
    selector = labels(target, "server")
    metrics = {"name": "metrics", "port": s.metrics_port, "targetPort": "metrics", "protocol": "TCP"}
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(target, target.name),
            "spec": {"type": "ClusterIP", "selector": selector, "ports": ports},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(target, metrics_service(target), "metrics"),
            "spec": {"type": "ClusterIP", "selector": selector, "ports": [metrics]},
        },
    ]


def metrics_service(target: Target) -> str:
    return f"{target.name}-metrics"


def network_policy(target: Target, values: DeployValues) -> Manifest:
    """Ingress only: the APIs from the bundle's namespace (and ingress_namespaces), metrics from the
    monitoring namespace, and within a group everything (MPI and NCCL pick their own ports)."""
    s = target.cfg.serving
    api_ports = [{"protocol": "TCP", "port": port} for port in (s.http_port, s.grpc_port)]
    if values.openai and target.has_bls:
        api_ports.append({"protocol": "TCP", "port": s.openai_port or 9000})
    callers: list[dict[str, Any]] = [{"podSelector": {}}]
    callers += [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
        for ns in values.ingress_namespaces
    ]
    monitoring = {"kubernetes.io/metadata.name": values.monitoring.namespace}
    rules: list[dict[str, Any]] = [
        {"from": callers, "ports": api_ports},
        {
            "from": [{"podSelector": {}}, {"namespaceSelector": {"matchLabels": monitoring}}],
            "ports": [{"protocol": "TCP", "port": s.metrics_port}],
        },
    ]
    instance = {"app.kubernetes.io/instance": target.name}
    if target.multi_node:
        rules.append({"from": [{"podSelector": {"matchLabels": instance}}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(target, target.name),
        "spec": {"podSelector": {"matchLabels": instance}, "policyTypes": ["Ingress"], "ingress": rules},
    }


def claim(target: Target, values: DeployValues) -> Manifest:
    source = values.model_repository
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": source.size}},
    }
    if source.storage_class:
        spec["storageClassName"] = source.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(target, claim_name(target, values), "model"),
        "spec": spec,
    }
