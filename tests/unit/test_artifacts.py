"""Atomic stage outputs and manifests: killed runs leave nothing trusted; tampering is detected."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.artifacts import Manifest, is_fresh, list_files, read_manifest, write_atomically
from pipeline.errors import IntegrityError


def _manifest(tmp: Path, config_hash: str = "c1") -> Manifest:
    return Manifest(
        stage="s", config_hash=config_hash, inputs={"a": "d1"}, files=list_files(tmp), tool_versions={}
    )


def _produce(tmp: Path) -> Manifest:
    (tmp / "weights.bin").write_bytes(os.urandom(4096))
    (tmp / "sub").mkdir()
    (tmp / "sub" / "config.json").write_text("{}")
    return _manifest(tmp)


def test_write_then_reuse(tmp_path: Path) -> None:
    out = tmp_path / "stage"
    written = write_atomically(out, _produce)
    assert sorted(f.path for f in written.files) == ["sub/config.json", "weights.bin"]
    assert is_fresh(out, "c1", {"a": "d1"}) == read_manifest(out)
    assert is_fresh(out, "c2", {"a": "d1"}) is None, "another config must not reuse it"
    assert is_fresh(out, "c1", {"a": "other"}) is None, "other inputs must not reuse it"


@pytest.mark.parametrize("damage", ["modify", "truncate", "delete"])
def test_damaged_output_is_detected_by_name(tmp_path: Path, damage: str) -> None:
    out = tmp_path / "stage"
    write_atomically(out, _produce)
    target = out / "weights.bin"
    if damage == "modify":
        data = bytearray(target.read_bytes())
        data[100] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:1000])
    else:
        target.unlink()
    with pytest.raises(IntegrityError, match="weights.bin"):
        is_fresh(out, "c1", {"a": "d1"})


def test_rewrite_replaces_the_old_output(tmp_path: Path) -> None:
    out = tmp_path / "stage"
    first = write_atomically(out, _produce)
    second = write_atomically(out, _produce)
    assert first.digest != second.digest
    assert [p.name for p in tmp_path.iterdir()] == ["stage"]


def test_failing_producer_leaves_previous_output_intact(tmp_path: Path) -> None:
    out = tmp_path / "stage"
    good = write_atomically(out, _produce)

    def explode(tmp: Path) -> Manifest:
        (tmp / "weights.bin").write_bytes(b"half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_atomically(out, explode)
    assert is_fresh(out, "c1", {"a": "d1"}) == good
    assert [p.name for p in tmp_path.iterdir()] == ["stage"]


def test_sigkill_mid_write_leaves_nothing_trusted(tmp_path: Path) -> None:
    out = tmp_path / "stage"
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from pipeline.artifacts import Manifest, list_files, write_atomically

        def produce(tmp):
            (tmp / "weights.bin").write_bytes(b"x" * 100000)
            Path({str(tmp_path / "started")!r}).write_text("1")
            time.sleep(60)
            return Manifest("s", "c1", {{}}, list_files(tmp), {{}})

        write_atomically(Path({str(out)!r}), produce)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists():
        assert time.monotonic() < deadline, "child never started writing"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "a killed stage must not leave output under the final name"
    assert is_fresh(out, "c1", {}) is None
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("stage.tmp-")]
    assert leftovers, "the temporary folder is where the partial write went"
    write_atomically(out, _produce)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("stage")) == ["stage"]


def test_link_tree_refuses_symlinks_that_escape(tmp_path: Path) -> None:
    from pipeline.artifacts import link_tree

    src = tmp_path / "src"
    (src / "tokenizer").mkdir(parents=True)
    (src / "tokenizer" / "vocab.json").write_text("{}")
    (src / "alias.json").symlink_to(src / "tokenizer" / "vocab.json")
    link_tree(src, tmp_path / "ok")
    assert (tmp_path / "ok" / "alias.json").read_text() == "{}"

    secret = tmp_path / "secret.txt"
    secret.write_text("do not ship")
    (src / "tokenizer" / "merges.txt").symlink_to(secret)
    with pytest.raises(IntegrityError, match="outside"):
        link_tree(src, tmp_path / "bad")
