"""Scaling on what the server exports: Triton's queue/compute time ratio, the engine's waiting requests and
its KV-cache use. The PromQL lives here once; the prometheus-adapter rules (for an autoscaling/v2 HPA), the
KEDA ScaledObject and the dashboard all take it from `queries`. Scraping: a ServiceMonitor for
prometheus-operator and a plain scrape config for any other Prometheus, both giving each series the
`namespace`, `service` and `pod` labels the queries select on.

Upstream: the queue/compute ratio (rate of nv_inference_queue_duration_us over
nv_inference_compute_infer_duration_us, named triton:queue_compute:ratio) is the scaling metric of
triton-inference-server/tutorials:Deployment/Kubernetes/TensorRT-LLM_Autoscaling_and_Load_Balancing.
"""

from __future__ import annotations

from typing import Any

from pipeline.deploy.target import Target
from pipeline.deploy.values import DeployValues
from pipeline.deploy.workload import metrics_service
from pipeline.serving.triton_models.metrics import KV_FAMILY, REQUEST_FAMILY

QUEUE_US = "nv_inference_queue_duration_us"  # Triton's per-model counters (microseconds)
COMPUTE_US = "nv_inference_compute_infer_duration_us"
QUEUE_COMPUTE = "triton:queue_compute:ratio"
PENDING = "llmpipe:pending_requests:sum"
KV_UTILIZATION = "llmpipe:kv_cache_utilization:ratio"
WINDOW = "1m"

Manifest = dict[str, Any]


def selector(target: Target, values: DeployValues) -> str:
    """The series of this deployment, as both scrape paths label them."""
    return f'namespace="{values.namespace}",service="{metrics_service(target)}"'


def queries(matchers: str, by: str = "") -> dict[str, str]:
    """Metric name -> PromQL over the series `matchers` selects, summed by the labels `by` (none: one value
    for the whole deployment). Ratios divide by at least 1 so an idle server reads 0, not NaN."""
    group = f"sum by ({by})"
    used, total = 'kv_cache_block_type="used"', 'kv_cache_block_type="max"'
    return {
        QUEUE_COMPUTE: f"{group} (rate({QUEUE_US}{{{matchers}}}[{WINDOW}])) / "
        f"clamp_min({group} (rate({COMPUTE_US}{{{matchers}}}[{WINDOW}])), 1)",
        PENDING: f'{group} ({REQUEST_FAMILY}{{{matchers},request_type="waiting"}})',
        KV_UTILIZATION: f"{group} ({KV_FAMILY}{{{matchers},{used}}}) / "
        f"clamp_min({group} ({KV_FAMILY}{{{matchers},{total}}}), 1)",
    }


def _targets(values: DeployValues) -> dict[str, float]:
    a = values.autoscaling
    return {
        QUEUE_COMPUTE: a.queue_compute_ratio,
        PENDING: a.pending_requests,
        KV_UTILIZATION: a.kv_cache_utilization,
    }


def _scale_target(target: Target) -> dict[str, str]:
    if target.multi_node:
        return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": target.name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": target.name}


def _meta(target: Target, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "labels": {"app.kubernetes.io/name": "llmpipe", "app.kubernetes.io/instance": target.name},
    }


def horizontal_pod_autoscaler(target: Target, values: DeployValues) -> Manifest:
    """autoscaling/v2 on the per-pod custom metrics prometheus-adapter serves (adapter_rules)."""
    metrics = [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": name},
                "target": {"type": "AverageValue", "averageValue": _quantity(value)},
            },
        }
        for name, value in _targets(values).items()
    ]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(target, target.name),
        "spec": {
            "scaleTargetRef": _scale_target(target),
            "minReplicas": values.autoscaling.min_replicas,
            "maxReplicas": values.autoscaling.max_replicas,
            "metrics": metrics,
            # Engines take minutes to load: scale down slowly, so a short lull does not drop warm replicas.
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }


def _quantity(value: float) -> str:
    """A Kubernetes quantity: milli-units keep fractional targets exact (0.85 -> 850m)."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def adapter_rules(target: Target, values: DeployValues) -> dict[str, Any]:
    """prometheus-adapter's rules for the HPA's metrics: its config.yaml `rules` (the prometheus-adapter Helm
    chart's `rules.custom`)."""
    series = {QUEUE_COMPUTE: QUEUE_US, PENDING: REQUEST_FAMILY, KV_UTILIZATION: KV_FAMILY}
    per_pod = queries("<<.LabelMatchers>>", "<<.GroupBy>>")
    return {
        "rules": [
            {
                "seriesQuery": f'{series[name]}{{{selector(target, values)},pod!=""}}',
                "resources": {
                    "overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
                },
                "name": {"matches": f"^{series[name]}$", "as": name},
                "metricsQuery": query,
            }
            for name, query in per_pod.items()
        ]
    }


def scaled_object(target: Target, values: DeployValues) -> Manifest:
    """KEDA: the deployment-wide values from Prometheus. Pending requests are averaged over the replicas
    (AverageValue); the ratios already are per-server averages (Value)."""
    whole = queries(selector(target, values))
    triggers = [
        {
            "type": "prometheus",
            "name": name.replace(":", "-").replace("_", "-"),
            "metricType": "AverageValue" if name == PENDING else "Value",
            "metadata": {
                "serverAddress": values.autoscaling.prometheus_address,
                "query": whole[name],
                "threshold": f"{value:g}",
            },
        }
        for name, value in _targets(values).items()
    ]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _meta(target, target.name),
        "spec": {
            "scaleTargetRef": _scale_target(target),
            "minReplicaCount": values.autoscaling.min_replicas,
            "maxReplicaCount": values.autoscaling.max_replicas,
            "cooldownPeriod": 300,
            "triggers": triggers,
        },
    }


def service_monitor(target: Target, values: DeployValues) -> Manifest:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(target, metrics_service(target)),
        "spec": {
            "selector": {
                "matchLabels": {
                    "app.kubernetes.io/instance": target.name,
                    "app.kubernetes.io/component": "metrics",
                }
            },
            "endpoints": [
                {"port": "metrics", "path": "/metrics", "interval": values.monitoring.scrape_interval}
            ],
        },
    }


def scrape_config(target: Target, values: DeployValues) -> dict[str, Any]:
    """A Prometheus scrape job (prometheus.yml `scrape_configs`) finding the pods through the metrics
    Service's endpoints, labelled as a ServiceMonitor would label them."""
    service = metrics_service(target)
    return {
        "scrape_configs": [
            {
                "job_name": service,
                "scrape_interval": values.monitoring.scrape_interval,
                "metrics_path": "/metrics",
                "kubernetes_sd_configs": [{"role": "endpoints", "namespaces": {"names": [values.namespace]}}],
                "relabel_configs": [
                    {
                        "source_labels": [
                            "__meta_kubernetes_service_name",
                            "__meta_kubernetes_endpoint_port_name",
                        ],
                        "regex": f"{service};metrics",
                        "action": "keep",
                    },
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                ],
            }
        ]
    }
