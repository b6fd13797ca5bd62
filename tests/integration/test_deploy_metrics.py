"""The bundle's autoscaling and dashboard queries against a real served model: every metric name they
reference is one the running tritonserver exports, and (slow) a real Prometheus, scraping the server with
the bundle's scrape job, evaluates the KEDA queries to values that move under load."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.artifacts import Manifest
from pipeline.deploy.autoscaling import KV_UTILIZATION, PENDING, QUEUE_COMPUTE
from pipeline.deploy.bundle import render_bundle
from pipeline.deploy.target import Target
from pipeline.deploy.values import DeployValues
from pipeline.serving.server.launcher import TritonServer, free_port
from tests.serving_helpers import post_generate, scrape_metrics, serve_tiny, tiny_config

pytestmark = pytest.mark.triton

NAMESPACE, POD = "llmpipe", "tiny-serving-0"
TRIGGER_NAMES = {QUEUE_COMPUTE: "triton-queue-compute-ratio", PENDING: "llmpipe-pending-requests-sum",
                 KV_UTILIZATION: "llmpipe-kv-cache-utilization-ratio"}  # fmt: skip


def bundle(hf_dir: Path, kind: str) -> dict[str, str]:
    """The bundle's files for the tiny served model (autoscaling.kind `kind`), rendered as for its build."""
    target = Target(
        cfg=tiny_config(hf_dir),
        name="tiny-serving",
        manifest=Manifest(stage="package", config_hash="", inputs={}, files=[], tool_versions={}),
        mount_path="/models/tiny-serving",
        has_bls=True,
        gpus_per_pod=0,
        num_nodes=1,
        engine_version=None,
    )
    values = DeployValues.model_validate({"namespace": NAMESPACE, "autoscaling": {"kind": kind}})
    return render_bundle(target, values)


def keda_queries(files: dict[str, str]) -> dict[str, str]:
    scaled = yaml.safe_load(files["autoscaling.yaml"])
    return {trigger["name"]: trigger["metadata"]["query"] for trigger in scaled["spec"]["triggers"]}


def referenced_series(hf_dir: Path) -> set[str]:
    """Every series name in a PromQL expression of the bundle: HPA adapter rules, KEDA, the dashboard."""
    expressions = list(keda_queries(bundle(hf_dir, "keda")).values())
    hpa = bundle(hf_dir, "hpa")
    for rule in yaml.safe_load(hpa["prometheus-adapter-rules.yaml"])["rules"]:
        expressions += [rule["seriesQuery"], rule["metricsQuery"]]
    for panel in json.loads(hpa["grafana-dashboard.json"])["panels"]:
        expressions += [target["expr"] for target in panel["targets"]]
    return {name for expr in expressions for name in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{", expr)}


def test_every_metric_the_bundle_references_is_exported_by_the_server(
    tiny_server: TritonServer, tiny_llama_dir: Path
) -> None:
    status, _ = post_generate(tiny_server.http_url, "ensemble", {"text_input": "scale me", "max_tokens": 4})
    assert status == 200
    exported = {key.split("{", 1)[0] for key in scrape_metrics(tiny_server.metrics_url)}
    referenced = referenced_series(tiny_llama_dir)
    assert {"nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us"} <= referenced
    assert "llmpipe_time_to_first_token_seconds_bucket" in referenced
    assert referenced - exported == set(), f"exported: {sorted(exported)}"


# --- a real Prometheus ---------------------------------------------------------------------------------


def _prometheus_config(files: dict[str, str], metrics_port: int) -> dict[str, Any]:
    """The bundle's scrape job pointed at the local server: the same job, labels a pod of the Service would
    get from the endpoints' relabelling, a 1 s interval so that a short test sees several scrapes."""
    (job,) = yaml.safe_load(files["prometheus-scrape.yaml"])["scrape_configs"]
    relabelled = {rule["target_label"] for rule in job.pop("relabel_configs") if "target_label" in rule}
    assert relabelled == {"namespace", "service", "pod"}
    job.pop("kubernetes_sd_configs")
    labels = {"namespace": NAMESPACE, "service": job["job_name"], "pod": POD}
    job |= {
        "scrape_interval": "1s",
        "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"], "labels": labels}],
    }
    return {"global": {"evaluation_interval": "1s"}, "scrape_configs": [job]}


@pytest.fixture
def prometheus(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path: Path
) -> Iterator[tuple[TritonServer, str]]:
    """A fresh tritonserver (counters from zero) and a Prometheus on loopback scraping it."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (`make test-slow` installs Debian's package)")
    with serve_tiny(tiny_llama_dir, tiny_engine_dir, tmp_path / "model_repo") as server:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(_prometheus_config(bundle(tiny_llama_dir, "keda"), server.options.metrics_port))
        )
        address = f"127.0.0.1:{free_port()}"
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address={address}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            _wait(lambda: _get(f"http://{address}/-/ready") is not None, 60, "prometheus ready")
            yield server, address
        finally:
            process.terminate()
            process.wait(timeout=30)


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.read()
    except OSError:
        return None


def _wait(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _evaluate(address: str, query: str) -> float | None:
    body = _get(f"http://{address}/api/v1/query?" + urllib.parse.urlencode({"query": query}))
    assert body is not None
    reply = json.loads(body)
    assert reply["status"] == "success", reply
    result = reply["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _load(http_url: str, stop: threading.Event) -> None:
    while not stop.is_set():
        post_generate(http_url, "ensemble", {"text_input": "keep the engine busy " * 8, "max_tokens": 200})


@pytest.mark.slow
def test_prometheus_evaluates_the_autoscaling_queries_and_they_move_under_load(
    prometheus: tuple[TritonServer, str], tiny_llama_dir: Path
) -> None:
    server, address = prometheus
    queries = keda_queries(bundle(tiny_llama_dir, "keda"))
    assert set(queries) == set(TRIGGER_NAMES.values())
    # Idle: every query has a value (no NaN, no empty result) once a few scrapes are in.
    _wait(lambda: all(_evaluate(address, q) is not None for q in queries.values()), 60, "idle values")
    idle = {name: _evaluate(address, q) for name, q in queries.items()}
    assert idle == {name: 0.0 for name in queries}, idle

    stop = threading.Event()
    # More concurrent requests than engine.max_batch_size (16): some must wait for the engine.
    threads = [threading.Thread(target=_load, args=(server.http_url, stop), daemon=True) for _ in range(24)]
    for thread in threads:
        thread.start()
    peaks = dict(idle)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not all(peaks[name] for name in queries):
            time.sleep(1)
            for name, query in queries.items():
                peaks[name] = max(peaks[name] or 0.0, _evaluate(address, query) or 0.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert all(value and value > 0 for value in peaks.values()), peaks
    assert peaks[TRIGGER_NAMES[KV_UTILIZATION]] <= 1.0
