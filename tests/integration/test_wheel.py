"""llmpipe as a wheel, not only as the editable checkout: the checkout's wheel carries every file of pipeline/
(templates, kernel sources, data), and installed into a fresh venv it builds, packages and serves the tiny
model from a folder outside the checkout through its own `llmpipe` script, answering what the engine answers
in-process."""

from __future__ import annotations

import os
import re
import shutil
import signal
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.serving.client import GenerationOptions, HttpClient
from pipeline.serving.triton_models.tokenization import PromptEncoder
from tests.serving_helpers import require_tritonserver

REPO_ROOT = Path(__file__).resolve().parents[2]
WHEEL_SOURCES = ("pyproject.toml", "README.md", "pipeline")  # README.md: the wheel's long description
PROMPT = "The quick brown fox"
MAX_TOKENS = 16


def _env() -> dict[str, str]:
    # A PYTHONPATH could put the checkout's `pipeline` back in front of the installed one.
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(*args: str | Path, cwd: Path) -> str:
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{args} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what the wheel is built from: a build in the checkout leaves build/ and *.egg-info there,
    and a stale build/lib can carry deleted files into a later wheel."""
    src = tmp_path_factory.mktemp("wheel-src")
    for name in WHEEL_SOURCES:
        if (REPO_ROOT / name).is_dir():
            shutil.copytree(
                REPO_ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(REPO_ROOT / name, src / name)
    return src


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # The source as an absolute path: pip looks a bare folder name up on the index as a project name.
    _run(
        *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"),
        *("-w", out, source.resolve()),
        cwd=out,
    )
    [built] = out.glob("llmpipe-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel, with llmpipe's dependencies taken from this environment."""
    venv = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv, cwd=venv)
    python = venv / "bin" / "python"
    _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "--no-deps",
        "--no-index",
        "-q",
        wheel,
        cwd=venv,
    )
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=venv).strip()
    # --system-site-packages reaches the base interpreter's packages only, not those of a venv this runs in
    # (`make install`'s .venv). A .pth line adds that folder without running the .pth files in it, so an
    # editable llmpipe installed there stays out. Written after the install, so that pip never sees it.
    (Path(purelib) / "llmpipe-test-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv


def test_the_wheel_carries_every_file_of_the_package(source: Path, wheel: Path) -> None:
    shipped = set(zipfile.ZipFile(wheel).namelist())
    # .gitkeep only keeps an empty folder in git; render_model_repository creates the folders it needs.
    files = {
        p.relative_to(source).as_posix()
        for p in (source / "pipeline").rglob("*")
        if p.is_file() and p.name != ".gitkeep"
    }
    missing = sorted(files - shipped)
    assert missing == [], f"not in the wheel: {missing}"


@pytest.mark.triton
def test_the_installed_wheel_builds_packages_and_serves_the_tiny_model(
    venv: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    require_tritonserver()
    imported = _run(venv / "bin" / "python", "-c", "import pipeline; print(pipeline.__file__)", cwd=tmp_path)
    assert Path(imported.strip()).is_relative_to(venv), imported
    config = yaml.safe_load((REPO_ROOT / "build_configs" / "tiny-llama.yaml").read_text())
    config["source"]["path"] = str(tiny_llama_dir)
    (tmp_path / "tiny-llama.yaml").write_text(yaml.safe_dump(config))
    llmpipe = venv / "bin" / "llmpipe"
    _run(llmpipe, "build", "tiny-llama.yaml", "--until", "engine", cwd=tmp_path)
    _run(llmpipe, "package", "tiny-llama.yaml", cwd=tmp_path)
    workdir = tmp_path / "build" / "tiny-llama"

    log = tmp_path / "serve.log"
    ports = ("--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--openai-port", "0")
    with log.open("w") as out:
        serve = subprocess.Popen(
            [str(llmpipe), "serve", str(workdir / "model_repo"), *ports],
            cwd=tmp_path,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 240
        while not (ready := re.search(r"^  HTTP +http://(\S+)", log.read_text(), re.MULTILINE)):
            assert serve.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        served = HttpClient(ready.group(1)).generate(PROMPT, GenerationOptions(max_tokens=MAX_TOKENS)).text
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0, log.read_text()
    finally:
        if serve.poll() is None:
            serve.kill()

    encoder = PromptEncoder.from_dir(workdir / "engine" / "tokenizer")
    [done] = LLMEngine.from_engine_dir(workdir / "engine").generate(
        [encoder.encode_prompt(PROMPT)],
        [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, end_id=encoder.end_id)],
    )
    assert served and served == encoder.tokenizer.decode(done.output_token_ids, skip_special_tokens=True)
