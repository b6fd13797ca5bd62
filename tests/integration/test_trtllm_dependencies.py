"""llmpipe on the Hugging Face stack that TensorRT-LLM's pinned release installs (the GPU image's), not only on
the newest one this venv holds.

TensorRT-LLM 1.1.0 requires transformers==4.56.0 (PyPI, tensorrt_llm-1.1.0.tar.gz, PKG-INFO Requires-Dist),
and transformers 4.56.0 requires huggingface-hub>=0.34.0,<1.0 and tokenizers>=0.22.0,<=0.23.0 (PyPI,
transformers-4.56.0 wheel METADATA). Those three, at the lowest versions allowed (llmpipe's floors), are
installed once with --no-deps into an overlay folder cached under .cache/trtllm-deps/, and one subprocess
with the overlay first on PYTHONPATH runs llmpipe's code that the image runs: every module's import, the
trtllm plan, `doctor`, `config validate`, a Hub fetch's error, the serving tokenizer and the validate
reference. torch, accelerate and safetensors stay this venv's (TensorRT-LLM 1.1.0's torch 2.9 is a CUDA
build of several GB).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pipeline.backends.trtllm.versions import PINNED

REPO_ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
OVERLAY_CACHE = REPO_ROOT / ".cache" / "trtllm-deps"
# The stack the image runs llmpipe on: TensorRT-LLM's exact transformers pin, and the lowest huggingface-hub
# and tokenizers that transformers release accepts (where their APIs are furthest from the newest).
STACK = {"transformers": "4.56.0", "huggingface-hub": "0.34.0", "tokenizers": "0.22.0"}
# TensorRT-LLM 1.1.0's requirements on packages in llmpipe's own dependency tree (PKG-INFO as above), and
# transformers 4.56.0's on the packages its pin brings along.
TRTLLM_REQUIRES = (
    "transformers==4.56.0", "torch>=2.9.0a0,<=2.9.0", "numpy<2", "pydantic>=2.9.1", "accelerate>=1.7.0",
    "onnx>=1.18.0,<1.20.0", "click", "setuptools<80", "urllib3>=2.6.0", "nvidia-modelopt[torch]~=0.37.0",
)  # fmt: skip
TRANSFORMERS_REQUIRES = ("huggingface-hub>=0.34.0,<1.0", "tokenizers>=0.22.0,<=0.23.0", "safetensors>=0.4.3")
PROMPT = "The quick brown fox <|im_end|> jumps"


def _llmpipe_requirements() -> dict[str, Requirement]:
    reqs = (Requirement(text) for text in PYPROJECT["project"]["dependencies"])
    return {canonicalize_name(r.name): r for r in reqs}


# ---- the declared ranges ----------------------------------------------------------------------------------
def test_the_trtllm_extra_is_the_pinned_release() -> None:
    assert PYPROJECT["project"]["optional-dependencies"]["trtllm"] == [f"tensorrt-llm=={PINNED}"]
    assert PINNED == "1.1.0", "a new pinned release needs its own STACK and TRTLLM_REQUIRES here"


@pytest.mark.parametrize("dist, version", sorted(STACK.items()))
def test_llmpipe_admits_the_stack(dist: str, version: str) -> None:
    """The overlay installs with --no-deps, so this is what ties the tested versions to pyproject's ranges."""
    ours = _llmpipe_requirements()[canonicalize_name(dist)]
    assert ours.specifier.contains(version, prereleases=True), f"{ours} excludes {dist} {version}"
    theirs = [Requirement(t) for t in (*TRTLLM_REQUIRES, *TRANSFORMERS_REQUIRES)]
    (required,) = [r for r in theirs if canonicalize_name(r.name) == canonicalize_name(dist)]
    assert required.specifier.contains(version), f"{dist} {version} is not what {required} allows"


# ---- the stack at run time ---------------------------------------------------------------------------------
def _pip(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def overlay() -> Path:
    """The stack in a folder of its own, installed on first use and reused (keyed by versions and Python)."""
    key = "-".join(f"{dist}-{version}" for dist, version in STACK.items())
    folder = OVERLAY_CACHE / f"{key}-{sys.implementation.cache_tag}-{platform.machine()}"
    if folder.is_dir():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    specs = [f"{dist}=={version}" for dist, version in STACK.items()]
    proc = _pip("install", "--quiet", "--no-deps", "--no-compile", "--target", str(partial), *specs)
    if proc.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        reach = _pip("index", "versions", "transformers", timeout=120)
        if reach.returncode != 0:
            pytest.skip(f"pip cannot reach PyPI: {(reach.stderr.strip().splitlines() or ['?'])[-1]}")
        pytest.fail(f"pip install {' '.join(specs)} failed:\n{proc.stdout}\n{proc.stderr}")
    partial.rename(folder)
    return folder


def _attempt(fn: Callable[..., Any], *args: Any) -> Any:
    """fn's result, or the error as text: one failing step of the probe must not hide the others."""
    try:
        return fn(*args)
    except Exception as err:
        return {"error": repr(err)}


def _tokenize(folder: Path) -> dict[str, Any]:
    from pipeline.serving.triton_models.tokenization import end_ids, load_tokenizer

    tokenizer = load_tokenizer(folder)
    ids = tokenizer(PROMPT).input_ids
    return {
        "ids": ids,
        "text": tokenizer.decode(ids, skip_special_tokens=True),
        "end_ids": end_ids(tokenizer, folder),
    }


def probe(out_file: str, v5_checkpoint: str, scratch: str) -> None:
    """Run in the subprocess (the stack first on sys.path): what llmpipe does in the image, as JSON."""
    import importlib
    import pkgutil

    import huggingface_hub
    import tokenizers
    import transformers
    from click.testing import CliRunner

    import pipeline
    from pipeline.cli.main import cli
    from pipeline.sources.tiny import make_tiny_checkpoint
    from pipeline.validate.reference import ReferenceModel
    from tests import stub_pb_utils

    stub_pb_utils.install()  # Triton's module, so the serving models import as they do in tritonserver
    failures = {}
    for module in pkgutil.walk_packages(pipeline.__path__, "pipeline."):
        if not module.name.startswith("pipeline.serving.templates"):
            try:
                importlib.import_module(module.name)
            except Exception as err:  # recorded: the parent asserts there are none
                failures[module.name] = repr(err)

    configs = sorted(str(p) for p in (REPO_ROOT / "build_configs").glob("*.yaml"))
    trtllm_configs = [c for c in configs if yaml.safe_load(Path(c).read_text()).get("backend") == "trtllm"]
    # offline, a Hub source must fail in one line (a packaged GGUF would be dequantized: minutes, no news)
    hub_configs = [
        c for c in trtllm_configs if yaml.safe_load(Path(c).read_text())["source"]["kind"] == "hub"
    ]
    runner = CliRunner()
    commands = {
        "config validate": ["config", "validate", *configs],
        "doctor": ["doctor"],
        **{f"build --dry-run {Path(c).name}": ["build", c, "--dry-run"] for c in trtllm_configs},
        **{f"fetch {Path(c).name}": ["fetch", c] for c in hub_configs},
    }
    cli_results = {}
    for label, args in commands.items():
        run = runner.invoke(cli, args)
        unexpected = None if isinstance(run.exception, SystemExit | None) else repr(run.exception)
        cli_results[label] = {"exit_code": run.exit_code, "output": run.output, "exception": unexpected}

    v4_checkpoint = Path(scratch) / "tiny-written-by-transformers-4"
    make_tiny_checkpoint(v4_checkpoint)
    tokenized = {
        label: _attempt(_tokenize, folder)
        for label, folder in (("v5", Path(v5_checkpoint)), ("v4", v4_checkpoint))
    }
    # A checkpoint of transformers 4's time, as the image fetches them: its AutoTokenizer knows no tokenizer
    # class that only transformers 5 writes (TokenizersBackend).
    greedy = _attempt(lambda: ReferenceModel(v4_checkpoint).generate([tokenized["v4"]["ids"]], 8))
    stack = {"transformers": transformers, "huggingface-hub": huggingface_hub, "tokenizers": tokenizers}
    result = {
        "versions": {
            dist: {"version": module.__version__, "file": module.__file__} for dist, module in stack.items()
        },
        "pipeline_file": pipeline.__file__,
        "trtllm_configs": [Path(c).name for c in trtllm_configs],
        "hub_configs": [Path(c).name for c in hub_configs],
        "import_failures": failures,
        "cli": cli_results,
        "tokenized": tokenized,
        "greedy": {"checkpoint": str(v4_checkpoint), "ids": greedy},
    }
    Path(out_file).write_text(json.dumps(result))


@pytest.fixture(scope="module")
def probed(overlay: Path, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    scratch = tmp_path_factory.mktemp("trtllm-deps")
    out_file = scratch / "probe.json"
    # Offline with an empty HF cache, as conftest makes every test (its fixture is function-scoped: set here
    # too). The checkout goes before the venv's editable install, so a worktree probes its own `pipeline`.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "LLMPIPE_DEBUG")}
    env.update(HF_HOME=str(scratch / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(overlay), str(REPO_ROOT)]))  # fmt: skip
    code = "import sys; from tests.integration.test_trtllm_dependencies import probe; probe(*sys.argv[1:])"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out_file), str(tiny_llama_dir), str(scratch)],
        cwd=scratch, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"the probe failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out_file.read_text())


def test_the_probe_ran_on_the_stack(probed: dict[str, Any], overlay: Path) -> None:
    for dist, version in STACK.items():
        seen = probed["versions"][dist]
        assert seen["version"] == version
        assert Path(seen["file"]).is_relative_to(overlay), f"{dist} came from {seen['file']}"
    assert Path(probed["pipeline_file"]).is_relative_to(REPO_ROOT)


def test_every_module_imports(probed: dict[str, Any]) -> None:
    assert probed["import_failures"] == {}


def test_configs_validate_and_trtllm_plans_print(probed: dict[str, Any]) -> None:
    cli = probed["cli"]
    assert cli["config validate"]["exit_code"] == 0, cli["config validate"]["output"]
    assert probed["trtllm_configs"], "no shipped trtllm config"
    for name in probed["trtllm_configs"]:
        plan = cli[f"build --dry-run {name}"]
        assert plan["exit_code"] == 0, plan["output"]
        assert "trtllm-build \\" in plan["output"] and f"TensorRT-LLM {PINNED}" in plan["output"]


def test_doctor_reports(probed: dict[str, Any]) -> None:
    doctor = probed["cli"]["doctor"]
    assert doctor["exit_code"] == 0, doctor["output"]
    assert re.search(rf"pinned release +TensorRT-LLM {re.escape(PINNED)}", doctor["output"])


def test_a_hub_fetch_fails_in_one_line(probed: dict[str, Any]) -> None:
    """Offline (conftest), so huggingface-hub 0.34 raises its own not-in-cache error, which llmpipe must
    still know: a traceback here means an exception class it does not translate."""
    assert probed["hub_configs"], "no shipped trtllm config with a Hub source"
    for name in probed["hub_configs"]:
        fetch = probed["cli"][f"fetch {name}"]
        assert fetch["exit_code"] == 1 and fetch["exception"] is None, fetch
        errors = [line for line in fetch["output"].splitlines() if line.startswith("Error: ")]
        assert len(errors) == 1 and "not (completely) in the local Hugging Face cache" in errors[0]


def test_tokenizers_of_either_transformers_major_encode_alike(
    probed: dict[str, Any], tiny_llama_dir: Path
) -> None:
    """The image's serving tokenizer (transformers 4) on a folder saved by transformers 5 (this venv) and on
    one saved by transformers 4: the same ids, text and end ids as transformers 5 gives here."""
    expected = _tokenize(tiny_llama_dir)
    assert probed["tokenized"] == {"v5": expected, "v4": expected}


def test_the_validate_reference_generates_as_on_transformers_5(probed: dict[str, Any]) -> None:
    from pipeline.validate.reference import ReferenceModel

    greedy = probed["greedy"]
    expected = ReferenceModel(Path(greedy["checkpoint"])).generate([probed["tokenized"]["v4"]["ids"]], 8)
    assert greedy["ids"] == expected


# ---- resolution against PyPI ---------------------------------------------------------------------------------
# The image's platform: Ubuntu 24.04 (glibc 2.39) with Python 3.12 on x86_64, as Triton's release notes give it
# for the 24.12 container (docs.nvidia.com/deeplearning/triton-inference-server, release notes 24.12).
CONTAINER_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]  # fmt: skip


@pytest.mark.slow
def test_pip_resolves_llmpipe_with_the_pinned_release(tmp_path: Path) -> None:
    """pip's resolver on llmpipe's dependencies plus TensorRT-LLM 1.1.0's requirements on the same tree
    (TensorRT-LLM itself and its NVIDIA-index-only requirements cannot resolve from PyPI). Downloads the
    wheels: about 4 GB where the index serves no separate metadata files."""
    report = tmp_path / "report.json"
    platforms = [arg for tag in CONTAINER_PLATFORMS for arg in ("--platform", tag)]
    proc = _pip(
        "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
        "--python-version", "3.12", *platforms, "--only-binary=:all:", "--target", str(tmp_path / "target"),
        *PYPROJECT["project"]["dependencies"], *TRTLLM_REQUIRES,
    )  # fmt: skip
    if proc.returncode != 0 and "ResolutionImpossible" not in proc.stderr:
        reach = _pip("index", "versions", "transformers", timeout=120)
        if reach.returncode != 0:
            pytest.skip(f"pip cannot reach PyPI: {(reach.stderr.strip().splitlines() or ['?'])[-1]}")
    assert proc.returncode == 0, proc.stderr
    chosen = {
        str(canonicalize_name(item["metadata"]["name"])): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert chosen["transformers"] == "4.56.0" and chosen["torch"] == "2.9.0"
    assert chosen["huggingface-hub"].startswith("0.") and chosen["nvidia-modelopt"].startswith("0.37.")
