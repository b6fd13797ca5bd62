"""`llmpipe bench`: user mistakes end as one-line errors, and a run writes its table and results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.cli.main import main

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = str(REPO_ROOT / "build_configs" / "tiny-llama.yaml")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no-such.yaml"], "is neither a build config file nor a host:port URL"),
        ([TINY_CONFIG, "--concurrency", "1,x"], "--concurrency must be comma-separated integers"),
        ([TINY_CONFIG, "--concurrency", "0"], "--concurrency must be integers >= 1"),
        ([TINY_CONFIG, "--rate", "-1"], "--rate must be numbers > 0"),
        ([TINY_CONFIG, "--compare", "hf,vllm"], "--compare: unknown peer 'vllm'"),
        ([TINY_CONFIG, "--compare", "llamacpp-q2_k"], "unknown peer 'llamacpp-q2_k'"),
        (["localhost:8001"], "a URL target needs --hf-model DIR"),
        (["http://localhost"], "is neither a build config file nor a host:port URL"),
    ],
)
def test_user_mistakes_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], in_tmp_workdir: Path
) -> None:
    code, _out, err = _run(argv, capsys)
    assert code == 1
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["localhost:8001", "--in-process"], "--in-process needs a CONFIG"),
        ([TINY_CONFIG, "--compare", "hf", "--rate", "1"], "peers are measured closed-loop"),
        ([TINY_CONFIG, "--log-probs", "--protocol", "openai"], "the OpenAI front-end returns no log-probs"),
        ([TINY_CONFIG, "--log-probs", "--model", "tensorrt_llm"], "token ids count themselves"),
        ([TINY_CONFIG, "--in-process", "--log-probs", "--speculation", "ngram"], "run them separately"),
    ],
)
def test_conflicting_flags_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], in_tmp_workdir: Path
) -> None:
    code, _out, err = _run(argv, capsys)
    assert code == 2 and message in err


def test_missing_engine_build_names_the_stage_to_run(
    capsys: pytest.CaptureFixture[str], in_tmp_workdir: Path
) -> None:
    code, _out, err = _run([TINY_CONFIG, "--in-process"], capsys)
    assert code == 1
    assert "no fetch output" in err and "llmpipe fetch CONFIG" in err


def test_unreachable_endpoint_is_a_serving_error(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str], in_tmp_workdir: Path
) -> None:
    code, _out, err = _run(["http://127.0.0.1:9", "--hf-model", str(tiny_llama_dir)], capsys)
    assert code == 1 and "cannot reach Triton at http://127.0.0.1:9" in err


@pytest.mark.parametrize("log_probs", [False, True])
def test_in_process_run_writes_table_and_results(
    log_probs: bool,
    tiny_llama_dir: Path,
    capsys: pytest.CaptureFixture[str],
    in_tmp_workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipeline.bench import builds
    from pipeline.runtime.engine.llm_engine import LLMEngine
    from tests.helpers import make_engine

    loaded: list[Path] = []

    def fake_from_engine_dir(cls: type, engine_dir: Path, args: object = None) -> LLMEngine:
        loaded.append(engine_dir)
        return make_engine(num_blocks=128, block_size=4)[0]

    monkeypatch.setattr(LLMEngine, "from_engine_dir", classmethod(fake_from_engine_dir))
    monkeypatch.setattr(builds, "fetched_checkpoint", lambda cfg: tiny_llama_dir)
    monkeypatch.setattr(builds, "stage_output", lambda cfg, stage: in_tmp_workdir)
    out_dir = in_tmp_workdir / "results"
    code, out, _err = _run(
        [
            TINY_CONFIG,
            "--in-process",
            "--concurrency",
            "1,2",
            "--requests",
            "4",
            "--input-mean",
            "12",
            "--output-mean",
            "5",
            "--out",
            str(out_dir),
            "--no-plots",
            "--no-progress",
            *(["--log-probs"] if log_probs else []),
        ],
        capsys,
    )
    assert code == 0
    assert loaded == [in_tmp_workdir]
    assert "out tok/s" in out and "c=1" in out and "c=2" in out
    data = json.loads((out_dir / "results.json").read_text())
    assert [run["concurrency"] for run in data["runs"]] == [1, 2]
    assert all(run["ok"] == 4 and run["err"] == 0 for run in data["runs"])
    assert all(req["output_tokens"] == 5 for run in data["runs"] for req in run["requests"])
    # with log-probs, tokens are counted by them: forced lengths come out whole only if every token had one
    key = "llmpipe.fp32.inprocess.logprobs.c2_tok_s" if log_probs else "llmpipe.fp32.inprocess.c2_tok_s"
    assert key in data["measurements"] and data["meta"]["log_probs"] is log_probs
    assert (out_dir / "results.csv").read_text().count("\n") == 3


@pytest.mark.parametrize(
    ("config", "precision"),
    [
        ("smollm2-135m.yaml", "fp32"),
        ("smollm2-135m-bf16.yaml", "bf16"),
        ("smollm2-135m-int8.yaml", "int8"),
        ("smollm2-135m-int8-sq.yaml", "w8a8"),
        ("smollm2-135m-int4-awq.yaml", "int4"),
    ],
)
def test_rows_are_named_by_the_configs_precision(config: str, precision: str) -> None:
    # The row label and the comparisons key on it: an unquantized bfloat16 build is bf16, not fp32.
    from pipeline.bench.builds import precision_of
    from pipeline.config.build_config import load_build_config

    assert precision_of(load_build_config(str(REPO_ROOT / "build_configs" / config), [])) == precision


def test_a_served_run_refuses_a_repository_packaged_from_other_settings(
    tiny_llama_dir: Path,
    capsys: pytest.CaptureFixture[str],
    in_tmp_workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipeline.artifacts import MANIFEST_NAME, Manifest
    from pipeline.bench import builds
    from pipeline.bench.builds import packaged_repository
    from pipeline.config.build_config import load_build_config
    from pipeline.stages.chain import STAGES
    from pipeline.stages.runner import stage_dir

    cfg = load_build_config(TINY_CONFIG, [])
    package = STAGES["package"]
    repo = stage_dir(cfg, package)
    repo.mkdir(parents=True)
    manifest = Manifest("package", cfg.config_hash(*package.config_sections), {}, [], {})
    (repo / MANIFEST_NAME).write_text(manifest.to_json())
    assert packaged_repository(cfg) == repo
    monkeypatch.setattr(builds, "fetched_checkpoint", lambda cfg: tiny_llama_dir)
    code, _out, err = _run([TINY_CONFIG, "--set", "serving.stream_interval=4", "--requests", "1"], capsys)
    assert code == 1 and "Traceback" not in err
    assert f"the model repository at {repo} was packaged from other settings" in err
    assert "`llmpipe build CONFIG` with the same --set options" in err
