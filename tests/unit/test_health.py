"""The serve watchdog's health checks (pipeline/serving/server/health.py) on a fake /proc: stubs found by process
group, a dead or zombie stub named, a server unready past its grace period. The real thing (a SIGKILLed stub
under `llmpipe serve`) is tests/integration/test_faults.py."""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeline.serving.server.health import HealthWatch, group_processes, python_stubs

SERVER, OTHER_GROUP = 100, 900
STUB = "/tmp/run/backends/python/triton_python_backend_stub"


def _process(proc: Path, pid: int, pgid: int, argv: list[str], state: str = "S", rss_kb: int = 2048) -> None:
    folder = proc / str(pid)
    folder.mkdir(parents=True)
    # comm may hold spaces and parentheses: the fields after the LAST ")" are what count
    (folder / "stat").write_text(f"{pid} (weird) name) {state} 1 {pgid} {pgid} 0 -1 4194560 0 0")
    (folder / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
    (folder / "status").write_text(f"Name:\tx\nVmRSS:\t{rss_kb} kB\n")


def _stub(model: str) -> list[str]:
    return [STUB, f"/repo/{model}/1/model.py", "prefix_1_", "4194304", "1048576", str(SERVER)]


def _fake_proc(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    _process(proc, SERVER, SERVER, ["/x/bin/tritonserver", "--model-repository=/repo"], rss_kb=40_000)
    _process(proc, 101, SERVER, _stub("tensorrt_llm"))
    _process(proc, 102, SERVER, _stub("preprocessing"))
    _process(proc, 901, OTHER_GROUP, _stub("tensorrt_llm"))  # another server's stub
    return proc


def test_stubs_are_found_by_process_group_with_their_model(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path)
    assert python_stubs(SERVER, proc) == {101: "tensorrt_llm", 102: "preprocessing"}
    assert sum(p.rss_bytes for p in group_processes(SERVER, proc)) == (40_000 + 2 * 2048) * 1024


def test_a_dead_or_zombie_stub_is_reported_by_model_and_pid(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path)
    watch = HealthWatch(SERVER, lambda: True, proc=proc)
    assert watch.check() is None
    shutil.rmtree(proc / "102")
    problem = watch.check()
    assert problem is not None and "stub of model 'preprocessing' (pid 102) died" in problem
    proc = _fake_proc(tmp_path / "again")
    watch = HealthWatch(SERVER, lambda: True, proc=proc)
    shutil.rmtree(proc / "101")
    _process(proc, 101, SERVER, _stub("tensorrt_llm"), state="Z")  # killed, not yet reaped
    problem = watch.check()
    assert problem is not None and "stub of model 'tensorrt_llm' (pid 101) died" in problem


def test_unready_is_tolerated_for_the_grace_period_only(tmp_path: Path) -> None:
    proc, now, ready = _fake_proc(tmp_path), [0.0], [True]
    watch = HealthWatch(
        SERVER, lambda: ready[0], unready_grace_s=10.0, ready_every_s=0.0, proc=proc, clock=lambda: now[0]
    )
    ready[0] = False
    assert watch.check() is None
    now[0] = 9.0
    assert watch.check() is None
    ready[0], now[0] = True, 9.5
    assert watch.check() is None  # ready again: the grace period starts over
    ready[0], now[0] = False, 10.0
    assert watch.check() is None
    now[0] = 21.0
    problem = watch.check()
    assert problem is not None and "has not been ready for 11s" in problem


def test_readiness_is_asked_at_most_every_period_while_stubs_are_checked_every_time(tmp_path: Path) -> None:
    proc, now, asked = _fake_proc(tmp_path), [0.0], []
    watch = HealthWatch(
        SERVER, lambda: asked.append(now[0]) is None, ready_every_s=2.0, proc=proc, clock=lambda: now[0]
    )
    for step in range(9):
        now[0] = step * 0.5
        assert watch.check() is None
    assert asked == [0.0, 2.0, 4.0]
    shutil.rmtree(proc / "101")
    now[0] = 4.25  # between two readiness probes: the dead stub is still caught at once
    problem = watch.check()
    assert problem is not None and "stub of model 'tensorrt_llm' (pid 101) died" in problem
