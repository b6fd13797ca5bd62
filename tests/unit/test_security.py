"""Security defaults: loopback binding, no pickle loading, HF_TOKEN never printed or written, safe YAML."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config.build_config import ServingSection, load_build_config
from pipeline.errors import ConfigError, PipelineError
from pipeline.serving.server.command import ServerOptions, server_args

SECRET = "hf_SECRETxyz"
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_servers_bind_loopback_by_default() -> None:
    assert ServingSection().host == "127.0.0.1"
    args = server_args(ServerOptions(Path("repo")), None, "p_")
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert f"{flag}=127.0.0.1" in args, args
    assert not [a for a in args if "0.0.0.0" in a]


def test_a_pickle_only_checkpoint_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from pipeline.sources.local import inspect_local_checkpoint

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_llama_dir, pickled)
    for weights in pickled.glob("*.safetensors*"):
        weights.unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(PipelineError, match=r"pickle|\.bin|safetensors"):
        inspect_local_checkpoint(pickled)


def test_yaml_python_tags_are_refused_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "evil.yaml"
    config.write_text(
        "name: !!python/object/apply:os.system ['echo pwned']\nsource: {kind: local, path: x}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_build_config(config)
    assert "python/object" in str(err.value) and "\n" not in err.value.message.strip()


def _cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_hf_token_is_never_printed_or_written(tiny_llama_dir: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "HF_TOKEN": SECRET,
        "LLMPIPE_DEBUG": "1",  # tracebacks on: the token must not be in them either
        "PYTHONPATH": str(REPO_ROOT),
    }
    local = tmp_path / "local.yaml"
    local.write_text(f"name: tok-local\nsource: {{kind: local, path: {tiny_llama_dir}}}\nbackend: torch\n")
    hub = tmp_path / "hub.yaml"
    hub.write_text(
        "name: tok-hub\nsource: {kind: hub, repo_id: HuggingFaceTB/SmolLM2-135M-Instruct, revision: main}\n"
        "backend: torch\n"
    )
    ok = _cli("fetch", str(local), cwd=tmp_path, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    offline = _cli("fetch", str(hub), cwd=tmp_path, env=env)  # no network here: it fails, and says why
    assert offline.returncode != 0
    shown = _cli("config", "show", str(hub), cwd=tmp_path, env=env)
    for proc in (ok, offline, shown):
        assert SECRET not in proc.stdout + proc.stderr
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size < 50_000_000]
    assert any(p.name == "manifest.json" for p in written)
    leaks = [p for p in written if SECRET.encode() in p.read_bytes()]
    assert leaks == []
