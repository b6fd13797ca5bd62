"""`llmpipe deploy k8s` on packaged builds (a torch CPU build; trtllm builds packaged from trtllm-build-shaped
folders: tp=1 on one GPU node, tp=2 x pp=2 over two nodes): every object validates offline against the
Kubernetes API schema (kubernetes-validate, strict) or its CRD's published schema (tests/data/k8s_crds), as
written and as `kubectl kustomize` renders the folder; values that cannot work are refused naming them."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner, Result

from pipeline.backends.trtllm import env
from pipeline.cli.main import cli
from tests.fake_trtllm_engine import engine_config, write_build_config, write_engine_dir

CRDS = Path(__file__).resolve().parents[1] / "data" / "k8s_crds"
CRD_SCHEMAS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_v1_leaderworkerset.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_scaledobject.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_v1_servicemonitor.json",
}
K8S_VERSION = "1.32.0"


@pytest.fixture(autouse=True)
def _no_gpu_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env, "gpus", lambda: env.Probe(None, "nvidia-smi not found"))


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def _closed(schema: Any) -> Any:
    """The schema with every object that lists its properties refusing any other (kubectl's strict mode)."""
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    return schema


def validate(document: dict[str, Any]) -> None:
    """Strict offline validation: built-in kinds by the API schema, CRDs by theirs."""
    crd = CRD_SCHEMAS.get((document["apiVersion"], document["kind"]))
    if crd is None:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)
        return
    schema = _closed(json.loads((CRDS / crd).read_text()))
    jsonschema.validate({k: v for k, v in document.items() if k != "metadata"}, schema)
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": document["metadata"]}, K8S_VERSION, strict=True
    )
    if document["kind"] == "LeaderWorkerSet":
        templates = document["spec"]["leaderWorkerTemplate"]
        for role in ("leaderTemplate", "workerTemplate"):
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()}}
            kubernetes_validate.validate(
                {**pod_template, "template": templates[role]}, K8S_VERSION, strict=True
            )


def documents(bundle: Path) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((bundle / "kustomization.yaml").read_text())
    found = []
    for name in kustomization["resources"]:
        found += [doc for doc in yaml.safe_load_all((bundle / name).read_text()) if doc]
    return found


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in docs if doc["kind"] == kind]
    return found


@pytest.fixture(scope="module")
def builds(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Packaged build configs: a torch CPU build, trtllm tp=1 and tp=2 x pp=2 (workdirs absolute)."""
    root = tmp_path_factory.mktemp("deploy-builds")
    torch_config = root / "tiny-cpu.yaml"
    torch_config.write_text(
        json.dumps(
            {
                "name": "tiny-cpu",
                "source": {"kind": "local", "path": str(tiny_llama_dir)},
                "dtype": "float32",
                "engine": {
                    "max_batch_size": 4,
                    "max_input_len": 64,
                    "max_seq_len": 128,
                    "max_num_tokens": 128,
                },
                "kv_cache": {"tokens_per_block": 16, "max_tokens": 2048},
                "workdir": str(root / "build" / "tiny-cpu"),
            }
        )
    )
    configs = {"cpu": torch_config}
    for key, (tp, pp) in {"tp1": (1, 1), "tp2pp2": (2, 2)}.items():
        config = write_build_config(
            root / f"trt-{key}.yaml",
            tiny_llama_dir,
            parallel={"tp_size": tp, "pp_size": pp},
            workdir=str(root / "build" / f"trt-{key}"),
        )
        built = write_engine_dir(root / f"engine-{key}", engine_config(tp=tp, pp=pp))
        result = CliRunner().invoke(
            cli, ["package", str(config), "--engine-dir", str(built), "--compute-capability", "9.0"]
        )
        assert result.exit_code == 0, result.output
        configs[key] = config
    result = run("build", str(torch_config))
    assert result.exit_code == 0, result.output
    return configs


CASES = {
    "cpu": ("cpu", []),
    "cpu-keda-image": (
        "cpu",
        ["--value", "autoscaling.kind=keda", "--value", "model_repository.source=image",
         "--value", "model_repository.image=registry.example/tiny-cpu-model:1"],
    ),
    "gpu-tp1": ("tp1", ["--value", "openai_api_key_secret=llm-key"]),
    "gpu-tp2pp2-one-node": ("tp2pp2", ["--value", "autoscaling.kind=none", "--value", "replicas=2"]),
    "gpu-tp2pp2-multi-node": ("tp2pp2", ["--value", "resources.gpus_per_node=2"]),
    "gpu-tp2pp2-multi-node-keda": (
        "tp2pp2", ["--value", "resources.gpus_per_node=2", "--value", "autoscaling.kind=keda"]
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_every_object_validates_strictly_as_written_and_as_kustomize_renders_it(
    case: str, builds: dict[str, Path], tmp_path: Path
) -> None:
    build, extra = CASES[case]
    out = tmp_path / "bundle"
    result = run("deploy", "k8s", str(builds[build]), "--out", str(out), *extra)
    assert result.exit_code == 0, result.output
    docs = documents(out)
    assert docs
    for doc in docs:
        validate(doc)
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return
    rendered = subprocess.run([kubectl, "kustomize", str(out)], capture_output=True, text=True, check=True)
    kustomized = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    assert len(kustomized) == len(docs) + 1  # the dashboard's ConfigMap
    for doc in kustomized:
        validate(doc)
        assert doc["metadata"]["namespace"] == "llmpipe"


def test_cpu_bundle_serves_the_repository_with_llmpipe_serve_and_no_gpus(
    builds: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "bundle"
    assert run("deploy", "k8s", str(builds["cpu"]), "--out", str(out)).exit_code == 0
    docs = documents(out)
    pod = by_kind(docs, "Deployment")["spec"]["template"]["spec"]
    triton, openai = pod["containers"]
    assert triton["image"] == "llmpipe:cpu"
    assert triton["command"][:3] == ["llmpipe", "serve", "/models/tiny-cpu/model_repo"]
    assert "nvidia.com/gpu" not in triton["resources"]["limits"]
    assert openai["command"][:2] == ["llmpipe", "openai-server"]
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert triton["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert all(c["securityContext"]["readOnlyRootFilesystem"] for c in pod["containers"])
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    services = [doc for doc in docs if doc["kind"] == "Service"]
    service_ports = {p["name"]: p["port"] for svc in services for p in svc["spec"]["ports"]}
    assert service_ports == {"http": 8000, "grpc": 8001, "openai": 9000, "metrics": 8002}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "deploy-k8s" and manifest["facts"]["workload"] == "Deployment"


def test_one_gpu_node_gets_tp_times_pp_gpus(builds: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    assert run("deploy", "k8s", str(builds["tp2pp2"]), "--out", str(out)).exit_code == 0
    deployment = by_kind(documents(out), "Deployment")
    (triton, _) = deployment["spec"]["template"]["spec"]["containers"]
    assert triton["image"] == "llmpipe:trtllm"
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == "4"
    # A trtllm repository names its engine by absolute path: the work dir is mounted where it was built.
    workdir = str(Path(yaml.safe_load(builds["tp2pp2"].read_text())["workdir"]).resolve())
    assert triton["command"][2] == f"{workdir}/model_repo"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["llmpipe.dev/tensorrt-llm-version"] == "1.1.0"


def test_multi_node_group_runs_upstreams_mpirun_launch_across_its_pods(
    builds: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "bundle"
    result = run(
        "deploy", "k8s", str(builds["tp2pp2"]), "--out", str(out), "--value", "resources.gpus_per_node=2"
    )
    assert result.exit_code == 0, result.output
    docs = documents(out)
    lws = by_kind(docs, "LeaderWorkerSet")["spec"]
    assert lws["leaderWorkerTemplate"]["size"] == 2
    leader = lws["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    worker = lws["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert (
        leader["resources"]["limits"]["nvidia.com/gpu"]
        == worker["resources"]["limits"]["nvidia.com/gpu"]
        == "2"
    )
    command = leader["command"]
    assert command[:4] == ["mpirun", "--allow-run-as-root", "--host", "$(POD_NAME):2,$(POD_NAME)-1:2"]
    ranks = " ".join(command).split(" : ")
    assert len([r for r in ranks if "tritonserver" in r]) == 4  # one tritonserver per rank, tp*pp
    assert sum("--load-model=tensorrt_llm" in r for r in ranks) == 3  # ranks > 0 load the engine only
    autoscaler = by_kind(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert autoscaler["kind"] == "LeaderWorkerSet"
    role = by_kind(docs, "Role")
    assert {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]} in role["rules"]


@pytest.mark.parametrize(
    ("build", "args", "named"),
    [
        ("tp2pp2", ["--set", "parallel.tp_size=4"], "parallel.tp_size=4 parallel.pp_size=2 does not match"),
        ("tp2pp2", ["--value", "resources.gpus_per_node=1"], "resources.gpus_per_node=1 is fewer than parallel.tp_size=2"),
        ("tp2pp2", ["--value", "resources.gpus_per_node=3"], "resources.gpus_per_node=3 does not divide"),
        ("tp1", ["--value", "model_repository.mount_path=/models"], "model_repository.mount_path=/models"),
        ("cpu", ["--value", "resources.gpus_per_node=1"], "resources.gpus_per_node=1: this torch build runs on CPU"),
        ("cpu", ["--value", "autoscaling.min_replicas=5"], "autoscaling.min_replicas=5 exceeds"),
        ("cpu", ["--value", "autoscaling.target=1"], "autoscaling.target: unknown field"),
        ("cpu", ["--value", "model_repository.source=image"], "model_repository.source=image needs"),
    ],
)  # fmt: skip
def test_values_that_cannot_work_are_refused_naming_the_value(
    build: str, args: list[str], named: str, builds: dict[str, Path], tmp_path: Path
) -> None:
    result = run("deploy", "k8s", str(builds[build]), "--out", str(tmp_path / "bundle"), *args)
    assert result.exit_code == 1, result.output
    assert named in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "bundle").exists()


def test_a_missing_model_repository_is_refused_naming_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    config = write_build_config(tmp_path / "unbuilt.yaml", tiny_llama_dir, workdir=str(tmp_path / "w"))
    result = run("deploy", "k8s", str(config))
    assert result.exit_code == 1
    assert f"model repository {tmp_path / 'w' / 'model_repo'} is missing" in result.output


def test_the_bundles_values_render_it_again(builds: dict[str, Path], tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    args = ["--value", "autoscaling.kind=keda", "--value", "resources.gpus_per_node=2"]
    assert run("deploy", "k8s", str(builds["tp2pp2"]), "--out", str(first), *args).exit_code == 0
    values = str(first / "values.yaml")
    assert (
        run("deploy", "k8s", str(builds["tp2pp2"]), "--out", str(second), "--values", values).exit_code == 0
    )
    for name in (p.name for p in first.iterdir() if p.name != "manifest.json"):
        assert (first / name).read_text() == (second / name).read_text(), name


def test_strict_validation_catches_a_misspelt_field() -> None:
    """The validator itself: a field no schema has fails, for a built-in kind and for a CRD."""
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
                  "spec": {"selector": {}, "template": {"spec": {"containers": []}}, "replica": 1}}  # fmt: skip
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "x"},
               "spec": {"selector": {}, "endpoints": [{"port": "metrics", "intervall": "15s"}]}}  # fmt: skip
    with pytest.raises(jsonschema.ValidationError):
        validate(copy.deepcopy(monitor))
