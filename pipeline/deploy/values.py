"""The deployment's values: one strict pydantic model, read from a YAML file (Helm's values.yaml role) plus
`--value a.b=v` overrides. Everything the build config already says (ports, tp/pp, backend) is not repeated
here: the bundle reads it from the build config recorded with the model repository."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.config.build_config import format_validation_error, parse_override
from pipeline.errors import ConfigError

# DNS-1123 label: what Kubernetes accepts as an object name that also names Services and pods.
K8S_NAME = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelRepositoryValues(_Strict):
    source: Literal["pvc", "image"] = Field(
        "pvc",
        description="Where pods find the build's work dir (model_repo/, and engine/ for trtllm): a "
        "PersistentVolumeClaim, or an image whose `image_path` an init container copies into an emptyDir.",
    )
    claim_name: str | None = Field(
        None, pattern=K8S_NAME, description="pvc: the claim's name; None = <name>-model."
    )
    create_claim: bool = Field(
        True,
        description="pvc: also render the claim (ReadWriteMany: filled once, mounted read-only by every pod).",
    )
    storage_class: str | None = Field(None, description="pvc: storageClassName of a rendered claim.")
    size: str = Field("20Gi", pattern=QUANTITY, description="pvc: requested size of a rendered claim.")
    image: str | None = Field(None, description="image: the image holding the work dir (source=image).")
    image_path: str = Field("/model", description="image: the work dir's folder inside that image.")
    mount_path: str | None = Field(
        None,
        description="Where the work dir is mounted in the pods; None = /models/<name> (torch, trtllm_pytorch: "
        "the repository is relocatable), or the folder the build wrote (trtllm: config.pbtxt names the "
        "engine by absolute path).",
    )


class ResourcesValues(_Strict):
    cpu: str = Field("4", pattern=QUANTITY, description="CPU request and limit per pod.")
    memory: str = Field("16Gi", pattern=QUANTITY, description="Memory request and limit per pod.")
    shm_size: str = Field(
        "2Gi",
        pattern=QUANTITY,
        description="/dev/shm (memory-backed emptyDir): Triton's Python backend moves every tensor through it.",
    )
    gpus_per_node: int | None = Field(
        None,
        ge=1,
        description="GPUs one pod (one node) gets; None = tp*pp on one node. Fewer than tp*pp: a "
        "LeaderWorkerSet of tp*pp/gpus_per_node pods (multiple of tp).",
    )


class AutoscalingValues(_Strict):
    kind: Literal["hpa", "keda", "none"] = Field(
        "hpa",
        description="hpa: autoscaling/v2 on prometheus-adapter custom metrics (rules rendered); keda: a KEDA "
        "ScaledObject querying Prometheus; none: fixed replicas.",
    )
    min_replicas: int = Field(1, ge=1, description="Fewest serving replicas (a replica: a pod or a group).")
    max_replicas: int = Field(4, ge=1, description="Most serving replicas.")
    queue_compute_ratio: float = Field(
        1.0,
        gt=0,
        description="Target of triton:queue_compute:ratio (time queued / time computing) per replica.",
    )
    pending_requests: float = Field(
        8.0,
        gt=0,
        description="Target of requests waiting for the engine (nv_trt_llm_request_metrics) per replica.",
    )
    kv_cache_utilization: float = Field(
        0.85, gt=0, le=1, description="Target share of KV-cache blocks in use per replica."
    )
    prometheus_address: str = Field(
        "http://prometheus-operated.monitoring.svc:9090",
        description="keda: the Prometheus the ScaledObject queries.",
    )

    @model_validator(mode="after")
    def _check_range(self) -> AutoscalingValues:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.min_replicas={self.min_replicas} exceeds autoscaling.max_replicas={self.max_replicas}"
            )
        return self


class MonitoringValues(_Strict):
    service_monitor: bool = Field(True, description="Render a prometheus-operator ServiceMonitor.")
    scrape_interval: str = Field("15s", pattern=r"^[0-9]+(ms|s|m)$", description="Scrape interval.")
    namespace: str = Field(
        "monitoring", pattern=K8S_NAME, description="Namespace of Prometheus: allowed to scrape the pods."
    )


class DeployValues(_Strict):
    name: str | None = Field(
        None, pattern=K8S_NAME, description="Object name prefix; None = the build's name."
    )
    namespace: str = Field("llmpipe", pattern=K8S_NAME, description="Namespace (kustomization.yaml).")
    image: str | None = Field(
        None,
        description="Serving image; None = llmpipe:cpu (Dockerfile.cpu) for a CPU torch build, llmpipe:trtllm "
        "(Dockerfile) otherwise. Its TensorRT-LLM must be the release that built a trtllm engine.",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="imagePullPolicy of every container."
    )
    replicas: int = Field(1, ge=1, description="Replicas when autoscaling.kind=none.")
    openai: bool = Field(
        True,
        description="Run the OpenAI-compatible API sidecar (repositories with a tensorrt_llm_bls model).",
    )
    openai_api_key_secret: str | None = Field(
        None, pattern=K8S_NAME, description="Secret (key `api-key`) whose value the OpenAI API requires."
    )
    ingress_namespaces: list[str] = Field(
        default_factory=list,
        description="Namespaces whose pods may call the APIs (NetworkPolicy); empty = the bundle's own only.",
    )
    run_as_user: int = Field(1000, ge=1, description="Non-root uid (and gid, fsGroup) of every container.")
    kubectl_image: str = Field(
        "docker.io/bitnami/kubectl:latest",
        description="Multi-node: image an init container copies kubectl from (mpirun reaches the worker pods "
        "through `kubectl exec`); its binary at /opt/bitnami/kubectl/bin/kubectl.",
    )
    model_repository: ModelRepositoryValues = Field(default_factory=ModelRepositoryValues)
    resources: ResourcesValues = Field(default_factory=ResourcesValues)
    autoscaling: AutoscalingValues = Field(default_factory=AutoscalingValues)
    monitoring: MonitoringValues = Field(default_factory=MonitoringValues)


def load_values(path: Path | None, overrides: tuple[str, ...] = ()) -> DeployValues:
    """The values file (none: every default) with `a.b=value` overrides applied; one-line errors."""
    data: dict[str, Any] = {}
    origin = "deploy values"
    if path is not None:
        origin = str(path)
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of values, got {type(loaded).__name__}")
        data = loaded or {}
    for text in overrides:
        key, value = parse_override(text)
        node = data
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--value {text}: {part!r} is not a section of the deploy values")
        node[last] = value
    try:
        return DeployValues.model_validate(data)
    except ValidationError as err:
        raise ConfigError(
            format_validation_error(err, origin), hint="`llmpipe deploy k8s --help` lists the values."
        ) from None
