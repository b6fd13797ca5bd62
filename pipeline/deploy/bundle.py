"""`llmpipe deploy k8s`: the bundle of one packaged build, a kustomize directory that `kubectl apply -k`
installs (kubectl's built-in kustomize, no network, no helm), written atomically with a manifest.json.

    kustomization.yaml          namespace, the resources below, the dashboard's ConfigMap
    workload.yaml               Deployment, or LeaderWorkerSet + the leader's MPI remote shell and its RBAC
    services.yaml               <name> (HTTP, gRPC, OpenAI) and <name>-metrics
    network-policy.yaml
    model-claim.yaml            the model repository's PersistentVolumeClaim (model_repository.create_claim)
    autoscaling.yaml            HorizontalPodAutoscaler or KEDA ScaledObject (autoscaling.kind)
    service-monitor.yaml        prometheus-operator ServiceMonitor (monitoring.service_monitor)
    grafana-dashboard.json      also a ConfigMap labelled grafana_dashboard=1 (Grafana's sidecar)
    prometheus-adapter-rules.yaml   autoscaling.kind=hpa: the adapter rules serving the HPA's metrics
    prometheus-scrape.yaml      a scrape job for a Prometheus without the operator
    values.yaml                 the values rendered with (`--values` takes it back)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from pipeline.artifacts import Manifest, list_files, tool_versions, write_atomically
from pipeline.config.build_config import BuildConfig
from pipeline.deploy import autoscaling, workload
from pipeline.deploy.dashboard import dashboard
from pipeline.deploy.target import Target, resolve_target
from pipeline.deploy.values import DeployValues

STAGE = "deploy-k8s"
DASHBOARD = "grafana-dashboard.json"


class _PlainDumper(yaml.SafeDumper):
    """Writes a dict shared by two places twice, never as an anchor and alias: kubectl and humans read it."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _yaml(*documents: dict[str, Any]) -> str:
    return yaml.dump_all(documents, Dumper=_PlainDumper, sort_keys=False, width=1000)


def manifests(target: Target, values: DeployValues) -> dict[str, list[dict[str, Any]]]:
    """File name -> the Kubernetes objects in it (the kustomization's resources)."""
    image = values.image or workload.default_image(target)
    if target.multi_node:
        serving = [*workload.mpi_objects(target), workload.leader_worker_set(target, values, image)]
    else:
        serving = [workload.deployment(target, values, image)]
    found = {
        "workload.yaml": serving,
        "services.yaml": workload.services(target, values),
        "network-policy.yaml": [workload.network_policy(target, values)],
    }
    if values.model_repository.source == "pvc" and values.model_repository.create_claim:
        found["model-claim.yaml"] = [workload.claim(target, values)]
    if values.autoscaling.kind == "hpa":
        found["autoscaling.yaml"] = [autoscaling.horizontal_pod_autoscaler(target, values)]
    elif values.autoscaling.kind == "keda":
        found["autoscaling.yaml"] = [autoscaling.scaled_object(target, values)]
    if values.monitoring.service_monitor:
        found["service-monitor.yaml"] = [autoscaling.service_monitor(target, values)]
    return found


def render_bundle(target: Target, values: DeployValues) -> dict[str, str]:
    """File name -> text of every file of the bundle (manifest.json aside)."""
    objects = manifests(target, values)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": values.namespace,
        "resources": list(objects),
        "configMapGenerator": [
            {
                "name": f"{target.name}-grafana-dashboard",
                "files": [DASHBOARD],
                "options": {"disableNameSuffixHash": True, "labels": {"grafana_dashboard": "1"}},
            }
        ],
    }
    files = {name: _yaml(*docs) for name, docs in objects.items()}
    files["kustomization.yaml"] = _yaml(kustomization)
    files[DASHBOARD] = json.dumps(dashboard(target.name, autoscaling.selector(target, values)), indent=2)
    if values.autoscaling.kind == "hpa":
        files["prometheus-adapter-rules.yaml"] = _yaml(autoscaling.adapter_rules(target, values))
    files["prometheus-scrape.yaml"] = _yaml(autoscaling.scrape_config(target, values))
    files["values.yaml"] = _yaml(values.model_dump(mode="json"))
    return files


def write_bundle(cfg: BuildConfig, values: DeployValues, out: Path) -> Manifest:
    """Check the values against the packaged build, then write the bundle into `out` atomically."""
    target = resolve_target(cfg, values)
    files = render_bundle(target, values)

    def produce(tmp: Path) -> Manifest:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        return Manifest(
            stage=STAGE,
            config_hash=cfg.config_hash(),
            inputs={"package": target.manifest.digest},
            files=list_files(tmp),
            tool_versions=tool_versions(),
            facts={
                "values": values.model_dump(mode="json"),
                "image": values.image or workload.default_image(target),
                "workload": "LeaderWorkerSet" if target.multi_node else "Deployment",
                "pods_per_replica": target.num_nodes,
                "gpus_per_pod": target.gpus_per_pod,
                "model_repository_in_pods": target.repo_in_pod,
            },
        )

    return write_atomically(out, produce)
