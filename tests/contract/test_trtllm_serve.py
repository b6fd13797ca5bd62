"""`llmpipe serve` on a TensorRT-LLM repository: the launch command and environment against tensorrtllm_backend's
launcher, the serve-time guards before anything starts, `--dry-run`.

Upstream facts the expected commands are written from (scripts/launch_triton_server.py `get_cmd` and
`__main__`, the same for these options in triton-inference-server/tensorrtllm_backend@89ee0f2 (v0.19.0) and
NVIDIA/TensorRT-LLM:triton_backend/scripts/launch_triton_server.py@0b06796):
- `mpirun --allow-run-as-root`, then per rank i: `-n 1 <tritonserver> --model-repository=<repo>`, the three
  port flags (--grpc-port, --http-port, --metrics-port), for i > 0 `--model-control-mode=explicit
  --load-model=tensorrt_llm`, [--multi-model: `--pinned-memory-pool-byte-size=0 --enable-peer-access=false`
  and `--cuda-memory-pool-byte-size=<j>:0` per GPU, when NVIDIA_TRITON_SERVER_VERSION > 24.06], the three
  port flags again, `--disable-auto-complete-config --backend-config=python,shm-region-prefix-name=prefix<i>_`
  and `:`.
- `--multi-model` needs --world_size 1 and sets TRTLLM_ORCHESTRATOR=1, TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1;
  draft-target with tensor parallelism is launched with it (TensorRT-LLM examples/draft_target_model/README.md).
llmpipe appends its own flags to every rank (LLMPIPE below: bind address, exit timeout, log level).

No mpirun or NVIDIA tritonserver exists here: the CLI tests put recording stand-ins on PATH, and patch the
probes of the installed TensorRT-LLM / TensorRT and of the GPUs.
"""

from __future__ import annotations

import shlex
import stat
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from pipeline.backends.trtllm import env
from pipeline.cli.package import package
from pipeline.cli.serve import serve
from pipeline.config.build_config import BuildConfig
from pipeline.errors import BackendUnavailableError, ServingError
from pipeline.serving.server.command import ServerOptions, TritonInstall, server_env
from pipeline.serving.server.trtllm_launch import launch_for, trtllm_command
from tests.fake_trtllm_engine import engine_config, write_build_config, write_engine_dir

BIN = "/opt/tritonserver/bin/tritonserver"
REPO = "/models/repo"
PORTS = ["--grpc-port=8001", "--http-port=8000", "--metrics-port=8002"]
LLMPIPE = ["--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
           "--exit-timeout-secs=5", "--log-verbose=0"]  # fmt: skip
ORCHESTRATOR = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}
H100 = env.Gpu(0, "NVIDIA H100 80GB HBM3", "9.0", 81559, 80000)
A100 = env.Gpu(0, "NVIDIA A100-SXM4-80GB", "8.0", 81920, 80000)


def rank0(prefix: str = "prefix", repo: str = REPO, binary: str = BIN) -> list[str]:
    return [binary, f"--model-repository={repo}", *PORTS, *PORTS, "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name={prefix}0_", *LLMPIPE]  # fmt: skip


def rank1(prefix: str = "prefix", repo: str = REPO, binary: str = BIN) -> list[str]:
    return [binary, f"--model-repository={repo}", *PORTS, "--model-control-mode=explicit", "--load-model=tensorrt_llm",
            *PORTS, "--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name={prefix}1_",
            *LLMPIPE]  # fmt: skip


def orchestrator(num_gpus: int, prefix: str = "prefix", repo: str = REPO, binary: str = BIN) -> list[str]:
    pools = ["--pinned-memory-pool-byte-size=0", "--enable-peer-access=false"]
    pools += [f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(num_gpus)]
    return [binary, f"--model-repository={repo}", *PORTS, *pools, *PORTS, "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name={prefix}0_", *LLMPIPE]  # fmt: skip


def trtllm_cfg(**sections: Any) -> BuildConfig:
    return BuildConfig.model_validate(
        {"name": "t", "backend": "trtllm", "source": {"kind": "local", "path": "m"}, **sections}
    )


DRAFT_TARGET = {"mode": "draft_model", "draft_config": "draft.yaml"}
REUSE = {"enable_block_reuse": True}  # the target's executor requires KV block reuse for draft-target


@pytest.mark.parametrize(
    ("sections", "num_gpus", "expected", "expected_env"),
    [
        ({}, 1, ["mpirun", "--allow-run-as-root", "-n", "1", *rank0(), ":"], {}),
        ({"parallel": {"tp_size": 2}}, 2,
         ["mpirun", "--allow-run-as-root", "-n", "1", *rank0(), ":", "-n", "1", *rank1(), ":"], {}),
        ({"parallel": {"pp_size": 2}}, 2,
         ["mpirun", "--allow-run-as-root", "-n", "1", *rank0(), ":", "-n", "1", *rank1(), ":"], {}),
        ({"parallel": {"tp_size": 2}, "speculative": DRAFT_TARGET, "kv_cache": REUSE}, 2,
         ["mpirun", "--allow-run-as-root", "-n", "1", *orchestrator(2), ":"], ORCHESTRATOR),
        # One GPU: leader mode runs both models in its one rank.
        ({"speculative": DRAFT_TARGET, "kv_cache": REUSE}, 1, ["mpirun", "--allow-run-as-root", "-n", "1", *rank0(), ":"], {}),
    ],
    ids=["tp1", "tp2", "pp2", "draft-target-tp2", "draft-target-tp1"],
)  # fmt: skip
def test_the_launch_is_upstreams_command_and_environment(
    sections: dict[str, Any], num_gpus: int, expected: list[str], expected_env: dict[str, str]
) -> None:
    launch = launch_for(trtllm_cfg(**sections), num_gpus, "25.12")
    assert trtllm_command(launch, ServerOptions(Path(REPO), trtllm=launch), Path(BIN), "prefix") == expected
    environment = server_env(TritonInstall(Path(BIN)), {"PATH": "/usr/bin"}, launch)
    assert {k: v for k, v in environment.items() if k.startswith("TRTLLM_")} == expected_env


def test_orchestrator_memory_pools_follow_the_gpu_count_and_triton_version() -> None:
    cfg = trtllm_cfg(parallel={"tp_size": 2}, speculative=DRAFT_TARGET, kv_cache=REUSE)
    opts = ServerOptions(Path(REPO))
    eight = launch_for(cfg, 8, "25.12")
    assert [a for a in trtllm_command(eight, opts, Path(BIN), "p") if a.startswith("--cuda-memory-pool")] == [
        f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(8)
    ]
    old = launch_for(cfg, 2, "24.06")  # upstream adds the pools only on a Triton newer than 24.06
    assert trtllm_command(old, opts, Path(BIN), "prefix") == [
        "mpirun", "--allow-run-as-root", "-n", "1", BIN, f"--model-repository={REPO}", *PORTS, *PORTS,
        "--disable-auto-complete-config", "--backend-config=python,shm-region-prefix-name=prefix0_", *LLMPIPE, ":",
    ]  # fmt: skip
    assert launch_for(cfg, None, None).num_gpus == 2  # no nvidia-smi here: the engine's own GPUs


# ---- the CLI on packaged repositories -------------------------------------------------------------------
@pytest.fixture
def nvidia_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Stand-ins for NVIDIA's tritonserver and mpirun on PATH; mpirun records its argv and TRTLLM_*
    environment into the returned folder and exits 3."""
    bin_dir, record = tmp_path / "nvidia-bin", tmp_path / "launched"
    bin_dir.mkdir()
    record.mkdir()
    scripts = {
        "tritonserver": "exit 1\n",
        "mpirun": f'printf "%s\\n" "$@" > {record}/argv\nenv | grep "^TRTLLM_" | sort > {record}/env\nexit 3\n',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path('/usr/bin')}:{Path('/bin')}")
    return record


def runtime(monkeypatch: pytest.MonkeyPatch, trtllm: str | None, gpus: list[env.Gpu] | None) -> None:
    monkeypatch.setattr(
        env, "tensorrt_llm_version", lambda: env.Probe(trtllm, None if trtllm else "not installed")
    )
    monkeypatch.setattr(env, "tensorrt_version", lambda: env.Probe(None, "not installed"))
    monkeypatch.setattr(env, "gpus", lambda: env.Probe(gpus, None if gpus else "nvidia-smi not found"))


def byo(workdir: Path, hf_dir: Path, name: str, tp: int = 1, **sections: Any) -> Path:
    """`llmpipe package` of a tp-rank trtllm-build output (engine_config's limits); the config path."""
    config = write_build_config(workdir / f"{name}.yaml", hf_dir, parallel={"tp_size": tp}, **sections)
    recorded = engine_config(tp=tp)
    if sections.get("speculative", {}).get("mode") == "draft_model":  # the default max_draft_len, 4
        # trtllm-build records max_seq_len + max_draft_len for a speculative engine
        recorded["build_config"].update(
            max_draft_len=4, max_seq_len=recorded["build_config"]["max_seq_len"] + 4
        )
    built = write_engine_dir(workdir / f"{name}-engine", recorded)
    result = CliRunner().invoke(
        package, [str(config), "--engine-dir", str(built), "--compute-capability", "9.0"]
    )
    assert result.exit_code == 0, result.output
    return config


def served(target: Path, *extra: str) -> Result:
    return CliRunner().invoke(serve, [str(target), *extra])


def _prefix(argv: list[str]) -> str:
    flag = next(a for a in argv if a.startswith("--backend-config=python,shm-region-prefix-name="))
    return flag.split("=", 2)[2].removesuffix("0_")


def test_serve_refuses_a_mismatched_engine_before_starting_anything(
    tiny_llama_dir: Path, in_tmp_workdir: Path, nvidia_host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime(monkeypatch, None, None)
    config = byo(in_tmp_workdir, tiny_llama_dir, "byo", tp=2)
    for trtllm, gpus, message in (
        ("1.0.0", [H100, H100], "engine built with TensorRT-LLM 1.1.0, runtime has 1.0.0"),
        ("1.1.0", [A100, A100], "engine built for compute capability 9.0, this machine has 8.0"),
        (None, [H100, H100], "TensorRT-LLM is not installed here"),
    ):
        runtime(monkeypatch, trtllm, gpus)
        result = served(config)
        assert isinstance(result.exception, ServingError) and message in result.exception.message, (
            result.output
        )
        assert not (nvidia_host / "argv").exists()  # neither mpirun nor tritonserver was started

    # A matching runtime gets past the guards to upstream's launch (the stand-in mpirun then exits).
    runtime(monkeypatch, "1.1.0", [H100, H100])
    result = served(config)
    assert isinstance(result.exception, ServingError) and "exited with code 3" in result.exception.message
    argv = (nvidia_host / "argv").read_text().splitlines()
    repo, prefix = str((in_tmp_workdir / "build/byo/model_repo").resolve()), _prefix(argv)
    binary = str(nvidia_host.parent / "nvidia-bin" / "tritonserver")  # NVIDIA's, found on PATH
    assert argv == ["--allow-run-as-root", "-n", "1", *rank0(prefix, repo, binary), ":",
                    "-n", "1", *rank1(prefix, repo, binary), ":"]  # fmt: skip
    assert (nvidia_host / "env").read_text() == ""


def test_draft_target_with_tensor_parallelism_starts_one_orchestrator(
    tiny_llama_dir: Path, in_tmp_workdir: Path, nvidia_host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime(monkeypatch, None, None)
    byo(in_tmp_workdir, tiny_llama_dir, "draft", tp=2)
    config = byo(
        in_tmp_workdir, tiny_llama_dir, "target", tp=2,
        speculative={"mode": "draft_model", "draft_config": "draft.yaml"}, kv_cache={"enable_block_reuse": True},
    )  # fmt: skip
    repo = str((in_tmp_workdir / "build/target/model_repo").resolve())
    binary = str(nvidia_host.parent / "nvidia-bin" / "tritonserver")  # NVIDIA's, found on PATH

    dry = served(config, "--dry-run")
    assert dry.exit_code == 0, dry.output
    words = shlex.split(dry.stdout)
    assert words[:2] == ["TRTLLM_ORCHESTRATOR=1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1"]
    prefix = _prefix(words)
    assert words[2:] == [
        "mpirun",
        "--allow-run-as-root",
        "-n",
        "1",
        *orchestrator(2, prefix, repo, binary),
        ":",
    ]

    # The draft engine is checked too: one built by another release stops serve before anything starts.
    runtime(monkeypatch, "1.0.0", [H100, H100])
    write_engine_dir(in_tmp_workdir / "draft-engine", engine_config(tp=2, version="1.0.0"))
    CliRunner().invoke(package, [str(in_tmp_workdir / "draft.yaml"), "--engine-dir",
                                 str(in_tmp_workdir / "draft-engine"), "--compute-capability", "9.0"])  # fmt: skip
    runtime(monkeypatch, "1.1.0", [H100, H100])
    refused = served(config)
    assert isinstance(refused.exception, ServingError) and "TensorRT-LLM 1.0.0, runtime has 1.1.0" in str(
        refused.exception
    )
    assert not (nvidia_host / "argv").exists()

    byo(in_tmp_workdir, tiny_llama_dir, "draft", tp=2)
    result = served(config)
    assert isinstance(result.exception, ServingError) and "exited with code 3" in result.exception.message
    argv = (nvidia_host / "argv").read_text().splitlines()
    assert argv == ["--allow-run-as-root", "-n", "1", *orchestrator(2, _prefix(argv), repo, binary), ":"]
    assert (nvidia_host / "env").read_text().splitlines() == [f"{k}={v}" for k, v in ORCHESTRATOR.items()]


def test_dry_run_prints_the_launch_without_runtime_or_server(
    tiny_llama_dir: Path, in_tmp_workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime(monkeypatch, None, None)  # a CPU machine: no TensorRT-LLM, no GPU, no NVIDIA tritonserver
    monkeypatch.setattr("pipeline.cli.serve.find_tritonserver", lambda: BUNDLED)
    config = byo(in_tmp_workdir, tiny_llama_dir, "byo", tp=2)
    repo = (in_tmp_workdir / "build/byo/model_repo").resolve()
    for target in (config, repo):  # a build config, or the repository (its recorded config sizes the launch)
        result = served(target, "--dry-run", "--http-port", "9000")
        assert result.exit_code == 0, result.output
        words = shlex.split(result.stdout)
        assert words[:2] == ["mpirun", "--allow-run-as-root"] and words.count(BIN) == 2 and words[-1] == ":"
        assert words.count("--http-port=9000") == 4 and "--load-model=tensorrt_llm" in words
    unbuilt = served(
        write_build_config(in_tmp_workdir / "fresh.yaml", tiny_llama_dir, parallel={"pp_size": 2}),
        "--dry-run",
    )
    assert unbuilt.exit_code == 0 and "fresh has no packaged model repository" in unbuilt.stderr
    assert shlex.split(unbuilt.stdout).count(":") == 2
    refused = served(config)  # the existing clear error, not a failed start
    assert isinstance(refused.exception, BackendUnavailableError) and "trtllm" in (
        refused.exception.hint or ""
    )


def test_a_repository_without_its_build_config_is_not_served_unchecked(
    tiny_llama_dir: Path, in_tmp_workdir: Path, nvidia_host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.config.build_config import load_build_config
    from pipeline.serving.repository.render import render_model_repository

    runtime(monkeypatch, "1.1.0", [H100])
    config = byo(in_tmp_workdir, tiny_llama_dir, "byo")
    bare = in_tmp_workdir / "bare_repo"  # rendered by hand: no manifest
    render_model_repository(load_build_config(config), in_tmp_workdir / "build/byo/engine", bare)
    result = served(bare)
    assert (
        isinstance(result.exception, ServingError) and "records no build config" in result.exception.message
    )
    assert "llmpipe serve CONFIG" in (result.exception.hint or "")
    assert not (nvidia_host / "argv").exists()


BUNDLED = TritonInstall(
    Path("/w/bin/tritonserver"), Path("/w/backends/python"), Path("/w/stub"), Path("/w/libs")
)
