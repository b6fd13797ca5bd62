"""Faults: an engine error fails one request only; a build killed with SIGKILL mid-stage leaves nothing a later
run reuses (through the real `llmpipe` CLI); a truncated or tampered engine weight file is refused by
checksum before load, with an error naming the file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import IntegrityError
from pipeline.runtime.async_engine import EngineThread
from pipeline.runtime.engine import LLMEngine
from pipeline.runtime.sampling_params import SamplingParams
from tests.serving_helpers import build_tiny_engine

POISON = "poison"


class _PoisonedRunner:
    """The real runner, except that any step scheduling request `poison` raises (a model bug on one input)."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def execute(self, scheduler_output: Any) -> Any:
        if any(s.request.request_id == POISON for s in scheduler_output.scheduled):
            raise RuntimeError("boom on the poisoned request")
        return self._runner.execute(scheduler_output)


def test_engine_error_on_one_request_fails_only_that_request(tiny_llama_dir: Path, tmp_path: Path) -> None:
    engine_dir = build_tiny_engine(tiny_llama_dir, tmp_path)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = {f"ok{i}": [1, 20 + i, 30 + i] for i in range(4)} | {POISON: [1, 2, 3]}
    reference = LLMEngine.from_engine_dir(engine_dir)
    want = {
        rid: r.output_token_ids
        for rid, r in zip(
            [k for k in prompts if k != POISON],
            reference.generate([p for k, p in prompts.items() if k != POISON], [params] * 4),
            strict=True,
        )
    }
    engine = LLMEngine.from_engine_dir(engine_dir)
    engine.runner = _PoisonedRunner(engine.runner)
    with EngineThread(engine) as thread:
        streams = {rid: thread.submit(rid, ids, params) for rid, ids in prompts.items()}
        outputs = {rid: list(stream) for rid, stream in streams.items()}
        assert thread.stats().num_kv_blocks_used == 0
        # the engine thread survived: it still serves
        assert list(thread.submit("after", [1, 2], params))[-1].finish_reason == "length"
    failed = outputs.pop(POISON)[-1]
    assert failed.finish_reason == "error" and "boom on the poisoned request" in (failed.error or "")
    got = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}
    assert got == want
    assert all(outs[-1].finish_reason == "length" for outs in outputs.values())


def _llmpipe(*args: str, cwd: Path, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        **kwargs,
    )


def _run(*args: str, cwd: Path) -> str:
    proc = _llmpipe(*args, cwd=cwd)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out


@pytest.fixture
def tiny_build_config(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    config = tmp_path / "tiny.yaml"
    config.write_text(
        f"name: tiny-faults\nsource: {{kind: local, path: {tiny_llama_dir}}}\nbackend: torch\ndtype: float32\n"
        "engine: {max_batch_size: 4, max_input_len: 64, max_seq_len: 128, max_num_tokens: 128}\n"
        "kv_cache: {tokens_per_block: 16, max_tokens: 1024}\n"
    )
    return config


def test_sigkill_mid_stage_leaves_nothing_a_later_run_reuses(tiny_build_config: Path, tmp_path: Path) -> None:
    work = tmp_path / "build" / "tiny-faults"
    _run("fetch", str(tiny_build_config), cwd=tmp_path)
    proc = _llmpipe("convert", str(tiny_build_config), cwd=tmp_path)
    killed_at = None
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if any(p.name.startswith("convert.tmp-") for p in work.glob("*")) or any(
            p.name.startswith("checkpoint") and ".tmp-" in p.name for p in work.glob("*")
        ):
            proc.send_signal(signal.SIGKILL)
            killed_at = sorted(p.name for p in work.glob("*"))
            break
        time.sleep(0.002)
    proc.communicate(timeout=60)
    if killed_at is None:
        pytest.skip("the convert stage finished before it could be killed (machine too fast to catch it)")
    assert proc.returncode == -signal.SIGKILL
    finals = [p for p in work.iterdir() if ".tmp-" not in p.name]
    # only the fetch stage is complete; the killed stage left at most a temporary folder, never a manifest
    assert all((p / "manifest.json").is_file() for p in finals), finals
    assert {p.name for p in finals} == {"fetch"} or all("convert" not in p.name for p in finals), finals
    out = _run("convert", str(tiny_build_config), cwd=tmp_path)
    assert "convert: done" in out and "reused" not in out.split("convert:", 2)[-1], out
    assert not [p for p in work.iterdir() if ".tmp-" in p.name], "leftover temporary folders"


def test_tampered_or_truncated_engine_weights_are_refused_by_checksum(
    tiny_build_config: Path, tmp_path: Path
) -> None:
    out = _run("build", str(tiny_build_config), "--until", "engine", cwd=tmp_path)
    engine_dir = tmp_path / "build" / "tiny-faults" / "engine"
    assert (engine_dir / "manifest.json").is_file(), out
    LLMEngine.from_engine_dir(engine_dir)  # intact: loads
    weights = engine_dir / "rank0.safetensors"
    data = weights.read_bytes()
    weights.unlink()  # never write through a hard link into another stage's file
    weights.write_bytes(data[:-100])
    with pytest.raises(
        IntegrityError, match=r"rank0\.safetensors is \d+ bytes, manifest says \d+: truncated"
    ):
        LLMEngine.from_engine_dir(engine_dir)
    flipped = bytearray(data)
    flipped[-10] ^= 0xFF
    weights.unlink()
    weights.write_bytes(bytes(flipped))
    with pytest.raises(IntegrityError, match=r"rank0\.safetensors does not match its sha256"):
        LLMEngine.from_engine_dir(engine_dir)
    # the next build notices too: it refuses to reuse the stage, and --force rebuilds it
    proc = _llmpipe("build", str(tiny_build_config), "--until", "engine", cwd=tmp_path)
    refused, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "rank0.safetensors does not match its sha256" in refused, refused
    rebuilt = _run("build", str(tiny_build_config), "--until", "engine", "--force", cwd=tmp_path)
    assert "engine: done" in rebuilt, rebuilt
    LLMEngine.from_engine_dir(engine_dir)
