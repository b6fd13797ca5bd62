"""`llmpipe deploy k8s`: a Kubernetes bundle for a packaged build."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.cli.options import CONTEXT, overrides_option


@click.group("deploy", context_settings=CONTEXT)
def deploy() -> None:
    """Deployment bundles for a packaged model repository.

    \b
    Example:
      llmpipe deploy k8s build_configs/smollm2-135m.yaml && kubectl apply -k build/smollm2-135m/k8s
    """


@deploy.command("k8s", context_settings=CONTEXT)
@click.argument("config", type=click.Path(dir_okay=False))
@overrides_option()
@click.option(
    "--values",
    "values_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Deploy values (YAML): image, replicas, GPUs per node, model repository source, autoscaling, "
    "monitoring. A bundle's own values.yaml renders it again.",
)
@click.option(
    "--value",
    "value_overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override one deploy value, e.g. --value resources.gpus_per_node=4 (repeatable).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Bundle folder; default: build/<name>/k8s beside the model repository.",
)
def deploy_k8s(
    config: str,
    overrides: tuple[str, ...],
    values_file: Path | None,
    value_overrides: tuple[str, ...],
    out: Path | None,
) -> None:
    """Write a Kubernetes bundle (kustomize) that serves CONFIG's packaged model repository.

    One replica is a Deployment pod (tp*pp GPUs, or CPU for a torch build), or, when resources.gpus_per_node
    is below tp*pp (backend trtllm), a LeaderWorkerSet group of tp*pp/gpus_per_node pods that the leader's
    mpirun spans. Beside Triton: Services (HTTP, gRPC, metrics, the OpenAI API), a NetworkPolicy, a
    non-root read-only-root pod, an HPA on prometheus-adapter metrics or a KEDA ScaledObject (queue/compute
    ratio, pending requests, KV-cache use), a ServiceMonitor, a scrape config and a Grafana dashboard.
    Values that cannot work (tp*pp not the engine's, fewer GPUs per node than tp, no model repository) are
    refused, naming the value.

    \b
    Values (all optional; the bundle's values.yaml holds every one it was rendered with):
      name, namespace, image, image_pull_policy, replicas, openai, openai_api_key_secret,
      ingress_namespaces, run_as_user, kubectl_image,
      model_repository.{source, claim_name, create_claim, storage_class, size, image, image_path, mount_path},
      resources.{cpu, memory, shm_size, gpus_per_node},
      autoscaling.{kind, min_replicas, max_replicas, queue_compute_ratio, pending_requests,
                   kv_cache_utilization, prometheus_address},
      monitoring.{service_monitor, scrape_interval, namespace}

    \b
    Examples:
      llmpipe deploy k8s build_configs/smollm2-135m.yaml
      llmpipe deploy k8s build_configs/llama3-8b-int4-awq-tp2.yaml --value autoscaling.kind=keda
      llmpipe deploy k8s my-tp2-pp2.yaml --value resources.gpus_per_node=2 --out deploy/
      kubectl apply -k build/smollm2-135m/k8s
    """
    from pipeline.config.build_config import load_build_config
    from pipeline.config.workdir import resolve_workdir
    from pipeline.deploy.bundle import write_bundle
    from pipeline.deploy.values import load_values

    cfg = load_build_config(config, overrides)
    values = load_values(values_file, value_overrides)
    target = out or resolve_workdir(cfg) / "k8s"
    manifest = write_bundle(cfg, values, target)
    facts = manifest.facts
    click.echo(
        f"wrote {target}: {facts['workload']} of {facts['pods_per_replica']} pod(s) a replica, "
        f"{facts['gpus_per_pod']} GPU(s) a pod, image {facts['image']}"
    )
    click.echo(f"install: kubectl apply -k {target}")
