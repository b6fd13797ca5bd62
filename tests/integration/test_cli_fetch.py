"""`llmpipe fetch` through the CLI on real files: run, reuse, force, tamper, bad sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli.main import cli


def _config(tmp: Path, source: dict, name: str = "t") -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "source": source, "workdir": str(tmp / "work")}))
    return path


def _fetch(config: Path, *extra: str):
    return CliRunner().invoke(cli, ["fetch", str(config), *extra])


def test_fetch_local_then_reuse_then_force(tmp_path: Path, tiny_llama_dir: Path) -> None:
    config = _config(tmp_path, {"kind": "local", "path": str(tiny_llama_dir)})
    first = _fetch(config)
    assert first.exit_code == 0, first.output
    assert "fetch: done" in first.output
    manifest = json.loads((tmp_path / "work" / "hf" / "manifest.json").read_text())
    assert manifest["facts"]["architecture"] == "LlamaForCausalLM"
    assert any(f["path"] == "@external/model.safetensors" for f in manifest["files"])

    again = _fetch(config)
    assert again.exit_code == 0 and "fetch: reused" in again.output
    forced = _fetch(config, "--force")
    assert forced.exit_code == 0 and "fetch: done" in forced.output


def test_tampered_source_is_detected_on_reuse(tmp_path: Path, tiny_llama_dir: Path) -> None:
    source = tmp_path / "model"
    source.mkdir()
    for item in tiny_llama_dir.iterdir():
        (source / item.name).write_bytes(item.read_bytes())
    config = _config(tmp_path, {"kind": "local", "path": str(source)})
    assert _fetch(config).exit_code == 0
    weights = source / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0x01
    weights.write_bytes(bytes(data))
    result = _fetch(config)
    assert result.exit_code == 1
    assert "model.safetensors does not match its sha256" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"kind": "local", "path": "/nonexistent/model"}, "/nonexistent/model"),
        ({"kind": "gguf", "path": "missing.gguf"}, "GGUF file not found"),
        (
            {"kind": "gguf", "package": "no_such_pkg_xyz", "path": "m.gguf"},
            "source.package=no_such_pkg_xyz is not installed",
        ),
        ({"kind": "hub", "repo_id": "org/model", "revision": "0" * 40}, "org/model"),
    ],
)
def test_bad_sources_fail_with_one_line(tmp_path: Path, source: dict, message: str) -> None:
    result = _fetch(_config(tmp_path, source))
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "work" / "hf").exists(), "a failed fetch leaves no output"


def test_pickle_only_checkpoint_is_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    source = tmp_path / "pickled"
    source.mkdir()
    for item in tiny_llama_dir.iterdir():
        if item.suffix != ".safetensors":
            (source / item.name).write_bytes(item.read_bytes())
    (source / "pytorch_model.bin").write_bytes(b"not really a pickle")
    result = _fetch(_config(tmp_path, {"kind": "local", "path": str(source)}))
    assert result.exit_code == 1
    assert "allow_pickle" in result.output


def test_dry_run_changes_nothing(tmp_path: Path, tiny_llama_dir: Path) -> None:
    config = _config(tmp_path, {"kind": "local", "path": str(tiny_llama_dir)})
    result = CliRunner().invoke(cli, ["build", str(config), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "[1/5] fetch: validate local checkpoint" in result.output
    assert "[5/5] package" in result.output
    assert not (tmp_path / "work").exists()
