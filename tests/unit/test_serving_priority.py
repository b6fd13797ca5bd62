"""lower_priority on a real process with several threads, and where the front-end niceness comes from."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config.build_config import load_build_config
from pipeline.errors import ConfigError
from pipeline.serving.triton_models.priority import lower_priority
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux /proc")

SMOLLM2 = REPO_ROOT / "build_configs" / "smollm2-135m.yaml"
TRTLLM = REPO_ROOT / "build_configs" / "llama3-8b-int4-awq-tp2.yaml"
THREADED_SLEEPER = (
    "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def _nices(pid: int) -> list[int]:
    return sorted(
        int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
        for task in Path(f"/proc/{pid}/task").iterdir()
    )


@pytest.fixture
def sleeper() -> int:
    process = subprocess.Popen([sys.executable, "-c", THREADED_SLEEPER], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


def test_every_thread_is_lowered_and_never_raised_back(sleeper: int) -> None:
    base = _nices(sleeper)[0]  # inherited from this test process
    if base > 12:
        pytest.skip(f"this process already runs at niceness {base}")
    assert _nices(sleeper) == [base, base]
    lower_priority(sleeper, 0)
    assert _nices(sleeper) == [base, base]
    lower_priority(sleeper, base + 7)
    assert _nices(sleeper) == [base + 7, base + 7]
    lower_priority(sleeper, base + 3)  # already nicer: unchanged (raising priority needs privileges anyway)
    assert _nices(sleeper) == [base + 7, base + 7]


def test_a_process_that_is_gone_is_not_an_error() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    time.sleep(0.05)
    lower_priority(process.pid, 5)


def test_frontend_nice_defaults_per_backend_and_trtllm_refuses_it() -> None:
    assert load_build_config(SMOLLM2).serving.frontend_nice == 0
    assert load_build_config(SMOLLM2, ["serving.frontend_nice=19"]).serving.frontend_nice == 19
    assert load_build_config(SMOLLM2, ["serving.frontend_nice=0"]).serving.frontend_nice == 0
    assert load_build_config(TRTLLM).serving.frontend_nice == 0
    with pytest.raises(ConfigError, match=r"serving\.frontend_nice=5 with backend=trtllm"):
        load_build_config(TRTLLM, ["serving.frontend_nice=5"])
