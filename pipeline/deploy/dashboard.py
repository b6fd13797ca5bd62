"""A Grafana dashboard (JSON model, Prometheus data source picked at import) of one deployment: TTFT and
inter-token latency quantiles from the engine's histograms, KV-cache blocks, requests by state, tokens per
second and the autoscaling metrics, each per pod."""

from __future__ import annotations

from typing import Any

from pipeline.deploy.autoscaling import KV_UTILIZATION, PENDING, QUEUE_COMPUTE, queries
from pipeline.serving.triton_models.metrics import (
    ITL_FAMILY,
    KV_FAMILY,
    REQUEST_FAMILY,
    TOKENS_FAMILY,
    TTFT_FAMILY,
)

_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _quantiles(family: str, matchers: str) -> list[str]:
    return [
        f"histogram_quantile({q}, sum by (le, pod) (rate({family}_bucket{{{matchers}}}[1m])))"
        for q in (0.5, 0.95, 0.99)
    ]


def _panel(number: int, title: str, exprs: list[str], unit: str, legends: list[str]) -> dict[str, Any]:
    return {
        "id": number,
        "type": "timeseries",
        "title": title,
        "datasource": _DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": 12 * ((number - 1) % 2), "y": 8 * ((number - 1) // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": _DATASOURCE}
            for i, (expr, legend) in enumerate(zip(exprs, legends, strict=True))
        ],
    }


def dashboard(title: str, matchers: str) -> dict[str, Any]:
    """The dashboard of the series `matchers` selects (the same selector the autoscalers use)."""
    per_pod = queries(matchers, "pod")
    quantile_legends = ["p50 {{pod}}", "p95 {{pod}}", "p99 {{pod}}"]
    kv = [f'{KV_FAMILY}{{{matchers},kv_cache_block_type="{kind}"}}' for kind in ("used", "free", "max")]
    states = [
        f'{REQUEST_FAMILY}{{{matchers},request_type="{kind}"}}' for kind in ("waiting", "scheduled", "max")
    ]
    panels = [
        _panel(1, "Time to first token", _quantiles(TTFT_FAMILY, matchers), "s", quantile_legends),
        _panel(2, "Inter-token latency", _quantiles(ITL_FAMILY, matchers), "s", quantile_legends),
        _panel(3, "KV-cache blocks", kv, "short", ["used {{pod}}", "free {{pod}}", "max {{pod}}"]),
        _panel(
            4, "Requests by state", states, "short", ["waiting {{pod}}", "scheduled {{pod}}", "max {{pod}}"]
        ),
        _panel(
            5,
            "Output tokens per second",
            [f"sum by (pod) (rate({TOKENS_FAMILY}{{{matchers}}}[1m]))"],
            "short",
            ["{{pod}}"],
        ),
        _panel(
            6,
            "Autoscaling metrics",
            [per_pod[QUEUE_COMPUTE], per_pod[PENDING], per_pod[KV_UTILIZATION]],
            "short",
            ["queue/compute {{pod}}", "pending {{pod}}", "KV utilisation {{pod}}"],
        ),
    ]
    return {
        "title": title,
        "uid": f"llmpipe-{title}"[:40],
        "schemaVersion": 39,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "tags": ["llmpipe", "triton"],
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
            ]
        },
        "panels": panels,
    }
