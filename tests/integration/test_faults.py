"""Faults: an engine error fails one request only; a build killed with SIGKILL mid-stage leaves nothing a later
run reuses (through the real `llmpipe` CLI); a truncated or tampered engine weight file is refused by
checksum before load, with an error naming the file, both by the engine and by a live `llmpipe serve`; a
Python stub killed under a running `llmpipe serve` makes it stop the server and exit non-zero with the log."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import IntegrityError
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.async_engine import EngineThread
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.serving.client import GenerationOptions, GrpcClient
from pipeline.serving.server.health import python_stubs
from tests.serving_helpers import require_tritonserver

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


def test_engine_error_on_one_request_fails_only_that_request(tiny_engine_dir: Path) -> None:
    # log-probs asked: the per-request retry after the failed step must carry them through too
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True)
    prompts = {f"ok{i}": [1, 20 + i, 30 + i] for i in range(4)} | {POISON: [1, 2, 3]}
    reference = LLMEngine.from_engine_dir(tiny_engine_dir)
    want = {
        rid: r.output_token_ids
        for rid, r in zip(
            [k for k in prompts if k != POISON],
            reference.generate([p for k, p in prompts.items() if k != POISON], [params] * 4),
            strict=True,
        )
    }
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)
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
    log_probs = {rid: [lp for o in outs for lp in o.new_logprobs] for rid, outs in outputs.items()}
    assert all(len(log_probs[rid]) == len(got[rid]) for rid in got), log_probs
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


def _write_tiny_config(folder: Path, hf_dir: Path) -> Path:
    config = folder / "tiny.yaml"
    config.write_text(
        f"name: tiny-faults\nsource: {{kind: local, path: {hf_dir}}}\nbackend: torch\ndtype: float32\n"
        "engine: {max_batch_size: 4, max_input_len: 64, max_seq_len: 1024, max_num_tokens: 128}\n"
        "kv_cache: {tokens_per_block: 16, max_tokens: 4096}\n"
    )
    return config


@pytest.fixture
def tiny_build_config(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    return _write_tiny_config(tmp_path, tiny_llama_dir)


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


# --- faults under a live `llmpipe serve` (real tritonserver) ---


@pytest.fixture(scope="module")
def served_repo(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model repository `llmpipe build` packages: its engine carries the engine stage's checksums."""
    require_tritonserver()
    root = tmp_path_factory.mktemp("served")
    _run("build", str(_write_tiny_config(root, tiny_llama_dir)), "--until", "package", cwd=root)
    repo = root / "build" / "tiny-faults" / "model_repo"
    assert (repo / "tensorrt_llm" / "1" / "engine" / "manifest.json").is_file()
    return repo


class _Serve:
    """`llmpipe serve REPO` on free ports, its output collected line by line as it comes."""

    def __init__(self, repo: Path, cwd: Path, *args: str) -> None:
        ports = ("--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--openai-port", "0")
        self.proc = _llmpipe("serve", str(repo), *ports, *args, cwd=cwd)
        self.lines: list[str] = []
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._pump.join(timeout=10)
        return code

    def wait_ready(self, timeout_s: float = 240, banner: str = r"^ready in ") -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(banner, self.output, re.MULTILINE):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output
            time.sleep(0.2)

    def server_pid(self) -> int:
        """tritonserver, the child of the CLI (it leads its own process group)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                name, rest = stat.read_text().split(" (", 1)[1].split(")", 1)
            except (OSError, IndexError, ValueError):
                continue
            if name == "tritonserver" and int(rest.split()[1]) == self.proc.pid:
                return int(stat.parent.name)
        raise AssertionError(f"no tritonserver under pid {self.proc.pid}")

    def url(self, name: str) -> str:
        found = re.search(rf"^  {name} +(\S+)", self.output, re.MULTILINE)
        assert found, self.output
        return found[1]


@pytest.mark.triton
def test_a_killed_python_stub_without_restarts_makes_serve_exit_nonzero(
    served_repo: Path, tmp_path: Path
) -> None:
    serve = _Serve(served_repo, tmp_path, "--max-restarts", "0")
    try:
        serve.wait_ready()
        server = serve.server_pid()
        stubs = python_stubs(server)
        assert sorted(stubs.values()) == sorted(
            ["preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"]
        ), stubs
        engine_stub = next(pid for pid, model in stubs.items() if model == "tensorrt_llm")
        # serve runs the OpenAI-compatible API beside Triton, on the port its banner names
        openai_url = re.search(r"^  OpenAI   (http://\S+)", serve.output, re.MULTILINE)
        assert openai_url, serve.output
        with urllib.request.urlopen(f"{openai_url[1]}/models", timeout=10) as reply:
            assert json.load(reply)["data"][0]["id"] == "tiny-faults"
        os.kill(engine_stub, signal.SIGKILL)
        killed = time.monotonic()
        code = serve.wait(timeout_s=90)
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()
    assert code != 0, serve.output
    assert time.monotonic() - killed < 60
    out = serve.output
    assert f"the Python backend stub of model 'tensorrt_llm' (pid {engine_stub}) died while serving" in out
    # what tritonserver logged while serving (2.51 logs nothing about the stub), not its shutdown after
    assert "so llmpipe stopped tritonserver. Its log while serving:" in out, out
    assert "unloading models" not in out and "Started HTTPService" not in out, out
    # nothing is left running: the server and every other stub are gone, and the OpenAI API with them
    assert python_stubs(server) == {} and not Path(f"/proc/{server}").exists()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{openai_url[1]}/models", timeout=5)


@pytest.mark.triton
def test_a_serve_killed_with_sigkill_takes_its_tritonserver_and_stubs_with_it(
    served_repo: Path, tmp_path: Path
) -> None:
    serve = _Serve(served_repo, tmp_path)
    try:
        serve.wait_ready()
        server = serve.server_pid()
        assert python_stubs(server)
        serve.proc.send_signal(signal.SIGKILL)
        serve.wait(timeout_s=30)
        # the server was told (SIGTERM) when its launcher died, and stops its stubs on the way out
        deadline = time.monotonic() + 60
        while Path(f"/proc/{server}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(f"/proc/{server}").exists() and python_stubs(server) == {}
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()


@pytest.mark.triton
def test_a_tampered_engine_in_the_served_repository_fails_serve_naming_the_file(
    served_repo: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "model_repo"
    shutil.copytree(served_repo, repo)  # real copies: the build's engine files stay intact
    weights = repo / "tensorrt_llm" / "1" / "engine" / "rank0.safetensors"
    flipped = bytearray(weights.read_bytes())
    flipped[-10] ^= 0xFF
    weights.unlink()
    weights.write_bytes(bytes(flipped))
    serve = _Serve(repo, tmp_path)
    try:
        code = serve.wait(timeout_s=300)
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()
    out = serve.output
    assert code != 0, out
    assert "tritonserver exited with code" in out and "before it was ready" in out, out
    assert re.search(r"model 'tensorrt_llm'.*rank0\.safetensors does not match its sha256", out), out
    assert "ready in" not in out


STREAM_TOKENS = 900  # two waves of the engine's batch of 4 at ~1 ms a step: about 2 s of decoding


def _stream_until_cut(
    grpc_url: str, ended: dict[int, tuple[float, str]], index: int, streaming: threading.Event
) -> None:
    """One long streamed request; records when it ended and how (finished, or the error it got)."""
    options = GenerationOptions(max_tokens=STREAM_TOKENS, min_tokens=STREAM_TOKENS, top_k=1)
    try:
        with GrpcClient(grpc_url, timeout_s=120) as client:
            for _ in client.stream("a b c", options):
                streaming.set()
        ended[index] = (time.monotonic(), "finished")
    except Exception as exc:  # noqa: BLE001 - what a client sees when its server dies is the point
        ended[index] = (time.monotonic(), f"error: {exc}")


@pytest.mark.triton
def test_a_dead_stub_fails_in_flight_requests_at_once_and_serve_restarts_the_server(
    served_repo: Path, tmp_path: Path
) -> None:
    serve = _Serve(served_repo, tmp_path)
    try:
        serve.wait_ready()
        grpc_url = serve.url("gRPC")
        engine_stub = next(p for p, m in python_stubs(serve.server_pid()).items() if m == "tensorrt_llm")
        ended: dict[int, tuple[float, str]] = {}
        # twice the engine's batch: the rest wait in its queue, in flight all the same
        streaming = threading.Event()
        clients = [
            threading.Thread(target=_stream_until_cut, args=(grpc_url, ended, i, streaming)) for i in range(8)
        ]
        for client in clients:
            client.start()
        # killed at the first streamed token; the engine runs ahead of what the clients have read, and
        # STREAM_TOKENS keeps it busy for seconds after that
        assert streaming.wait(timeout=60)
        os.kill(engine_stub, signal.SIGKILL)
        killed = time.monotonic()
        for client in clients:
            client.join(timeout=60)
        cut = {i: (at - killed, how) for i, (at, how) in ended.items() if how != "finished"}
        assert len(ended) == 8 and cut, ended
        print(
            f"in-flight requests cut {len(cut)}/8, seconds after the kill: {sorted(d for d, _ in cut.values())}"
        )
        # the watch polls every 0.25 s and kills the server: no request waits for its own timeout
        assert max(delay for delay, _ in cut.values()) < 3.0, cut
        serve.wait_ready(timeout_s=240, banner=r"^ready again in ")
        out = serve.output
        # The watchdog finds the dead stub first, or tritonserver aborts on its own (its Python backend
        # throws on the shared-memory lock the killed stub held): either is a crash that serve reports.
        assert (
            f"stub of model 'tensorrt_llm' (pid {engine_stub}) died while serving" in out
            or "tritonserver exited with code -6 while serving" in out
        ), out
        assert "restarting tritonserver (1/3)" in out, out
        # the same ports serve again, through Triton and the OpenAI-compatible API
        with GrpcClient(grpc_url) as client:
            done = client.generate("a b c", GenerationOptions(max_tokens=8, top_k=1))
        assert done.text and len(done.chunks) >= 1
        with urllib.request.urlopen(f"{serve.url('OpenAI')}/models", timeout=10) as reply:
            assert json.load(reply)["data"][0]["id"] == "tiny-faults"
    finally:
        serve.proc.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout_s=60)
        finally:
            if serve.proc.poll() is None:
                serve.proc.kill()
    assert serve.proc.returncode == 0, serve.output


@pytest.mark.triton
def test_serve_refuses_a_port_another_process_holds_before_starting_anything(
    served_repo: Path, tmp_path: Path
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        serve = _Serve(served_repo, tmp_path, "--grpc-port", str(port))  # the later flag wins
        started = time.monotonic()
        code = serve.wait(timeout_s=120)
        took = time.monotonic() - started
    out = serve.output
    assert code != 0, out
    assert f"port {port} (gRPC) on 127.0.0.1 is in use by pid {os.getpid()}" in out, out
    assert "ready in" not in out and took < 60, out
