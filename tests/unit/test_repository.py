"""render_model_repository on a real tiny engine: layout, strict rendering, Triton-schema checks, the trtllm
variant; and the launcher's pure parts (command lines, environment, failure extraction)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pipeline.errors import ConfigError, MissingArtifactError
from pipeline.serving import client
from pipeline.serving.repository.pbtxt import parse_model_config
from pipeline.serving.repository.render import MODELS, render_model_repository, templates_dir
from pipeline.serving.server.command import ServerOptions, TritonInstall, server_args, server_env
from pipeline.serving.server.launcher import failure_lines, with_free_ports
from pipeline.serving.triton_models import io
from tests.serving_helpers import tiny_config


@pytest.fixture(scope="module")
def repo(tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rendered") / "model_repo"
    facts = render_model_repository(tiny_config(tiny_llama_dir), tiny_engine_dir, out)
    assert facts["models"] == list(MODELS) and facts["engine"] == "tensorrt_llm/1/engine"
    return out


def _config(repo: Path, model: str):  # type: ignore[no-untyped-def]
    return parse_model_config(model, (repo / model / "config.pbtxt").read_text())


def test_layout_carries_engine_and_tokenizers_by_hardlink(repo: Path, tiny_engine_dir: Path) -> None:
    for model in MODELS:
        assert (repo / model / "config.pbtxt").is_file() and (repo / model / "1").is_dir()
    weights = repo / "tensorrt_llm" / "1" / "engine" / "rank0.safetensors"
    assert os.stat(weights).st_ino == os.stat(tiny_engine_dir / "rank0.safetensors").st_ino
    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert (repo / model / "1" / "tokenizer" / "tokenizer.json").is_file()
        assert "TritonPythonModel" in (repo / model / "1" / "model.py").read_text()
    text = "".join((repo / m / "config.pbtxt").read_text() for m in MODELS)
    assert "${" not in text and str(tiny_engine_dir) not in text and "/tmp" not in text  # relocatable


def test_rendered_configs_follow_the_build_config(repo: Path) -> None:
    engine = _config(repo, "tensorrt_llm")
    assert engine.backend == "python" and engine.max_batch_size == 16
    assert engine.model_transaction_policy.decoupled
    assert engine.dynamic_batching.default_queue_policy.max_queue_size == 64
    params = {k: v.string_value for k, v in engine.parameters.items()}
    assert params["gpt_model_path"] == "engine" and params["max_tokens_in_paged_kv_cache"] == "16384"
    assert (
        params["batch_scheduler_policy"] == "guaranteed_no_evict"
        and params["exclude_input_in_output"] == "false"  # tensorrtllm_backend's default: echo the prompt
    )
    pre = {k: v.string_value for k, v in _config(repo, "preprocessing").parameters.items()}
    assert pre["tokenizer_dir"] == "tokenizer" and pre["max_input_len"] == "256"


def test_tensor_names_match_the_serving_code(repo: Path) -> None:
    engine = _config(repo, "tensorrt_llm")
    assert [i.name for i in engine.input] == list(io.ENGINE_INPUTS)
    assert [o.name for o in engine.output] == list(io.ENGINE_OUTPUTS)
    for model, inputs, outputs in (
        ("ensemble", io.CLIENT_INPUTS, io.CLIENT_OUTPUTS),
        ("tensorrt_llm_bls", io.BLS_INPUTS, io.BLS_OUTPUTS),
    ):
        config = _config(repo, model)
        assert tuple(i.name for i in config.input) == inputs
        assert tuple(o.name for o in config.output) == outputs
    assert set(client.request_json("x", client.GenerationOptions(stream=True))) <= set(io.CLIENT_INPUTS)


def test_non_decoupled_and_trtllm_variants(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path: Path
) -> None:
    unary = tmp_path / "unary"
    render_model_repository(tiny_config(tiny_llama_dir, decoupled=False), tiny_engine_dir, unary)
    assert not _config(unary, "tensorrt_llm").model_transaction_policy.decoupled
    assert not _config(unary, "tensorrt_llm_bls").model_transaction_policy.decoupled

    trt = tmp_path / "trtllm"
    facts = render_model_repository(tiny_config(tiny_llama_dir, backend="trtllm"), tiny_engine_dir, trt)
    engine = _config(trt, "tensorrt_llm")
    params = {k: v.string_value for k, v in engine.parameters.items()}
    assert engine.backend == "tensorrtllm" and params["gpt_model_type"] == "inflight_fused_batching"
    assert params["gpt_model_path"] == str(tiny_engine_dir) and facts["engine"] == str(tiny_engine_dir)
    assert not (trt / "tensorrt_llm" / "1" / "model.py").exists()
    assert not (trt / "tensorrt_llm" / "1" / "engine").exists()


def test_serving_ensemble_bls_serves_the_ensembles_tensors_with_the_bls_code(
    repo: Path, tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path: Path
) -> None:
    python = tmp_path / "bls"
    render_model_repository(tiny_config(tiny_llama_dir, serving={"ensemble": "bls"}), tiny_engine_dir, python)
    ensemble, bls = _config(python, "ensemble"), _config(python, "tensorrt_llm_bls")
    assert ensemble.backend == "python" and not ensemble.platform and not ensemble.ensemble_scheduling.step
    assert ensemble.model_transaction_policy.decoupled and ensemble.max_batch_size == bls.max_batch_size
    assert dict(ensemble.parameters) == dict(bls.parameters) and list(ensemble.instance_group) == list(
        bls.instance_group
    )
    assert (python / "ensemble" / "1" / "model.py").read_text() == (
        python / "tensorrt_llm_bls" / "1" / "model.py"
    ).read_text()
    assert (python / "ensemble" / "1" / "tokenizer" / "tokenizer.json").is_file()

    scheduled = repo  # the default: Triton's ensemble scheduler
    config = _config(scheduled, "ensemble")
    assert config.platform == "ensemble" and config.backend == ""
    assert [step.model_name for step in config.ensemble_scheduling.step] == [
        "preprocessing",
        "tensorrt_llm",
        "postprocessing",
    ]
    assert tuple(i.name for i in config.input) == tuple(i.name for i in ensemble.input)
    assert tuple(o.name for o in config.output) == tuple(o.name for o in ensemble.output)
    assert not (scheduled / "ensemble" / "1" / "model.py").exists()


def _templates(tmp_path: Path, model: str, old: str, new: str) -> Path:
    copy = tmp_path / "templates"
    shutil.copytree(templates_dir(), copy)
    path = copy / model / "config.pbtxt.tmpl"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return copy


@pytest.mark.parametrize(
    ("model", "old", "new", "message"),
    [
        (
            "preprocessing",
            "${max_seq_len}",
            "${max_sequence_length}",
            "model 'preprocessing': template placeholder ${max_sequence_length} has no value",
        ),
        (
            "postprocessing",
            "max_batch_size: ${triton_max_batch_size}",
            "max_batch_size: ${triton_max_batch_size}x",
            "model 'postprocessing': config.pbtxt line 5: field max_batch_size value '16x' is invalid",
        ),
        (
            "tensorrt_llm",
            "data_type: TYPE_INT32 dims: [ -1 ] allow",
            "data_type: TYPE_INT33 dims: [ -1 ] allow",
            "model 'tensorrt_llm': config.pbtxt line 16: field data_type value 'TYPE_INT33' is invalid (Enum type",
        ),
        (
            "ensemble",
            'key: "streaming" value: "stream"',
            'key: "streamed" value: "stream"',
            "field input_map key 'streamed' is not an input of tensorrt_llm",
        ),
        (
            "ensemble",
            'value: "_TOKENS_BATCH" }\n      input_map',
            'value: "_TOKEN_BATCH" }\n      input_map',
            "field input_map value '_TOKEN_BATCH' is neither an ensemble input",
        ),
        (
            "tensorrt_llm_bls",
            'name: "tensorrt_llm_bls"',
            'name: "bls"',
            "model 'tensorrt_llm_bls': field name value 'bls' must equal the folder name",
        ),
        (
            "preprocessing",
            "count: ${preprocessing_instance_count}",
            "count: 0",
            "model 'preprocessing': field instance_group.count value 0 must be >= 1",
        ),
    ],
)
def test_bad_templates_are_rejected_naming_model_field_and_value(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path: Path, model: str, old: str, new: str, message: str
) -> None:
    templates = _templates(tmp_path, model, old, new)
    with pytest.raises(ConfigError) as err:
        render_model_repository(
            tiny_config(tiny_llama_dir), tiny_engine_dir, tmp_path / "out", templates=templates
        )
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()  # nothing written before every config checks out


def test_engine_dir_must_hold_a_valid_engine_and_tokenizer(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(MissingArtifactError, match="no config.json"):
        render_model_repository(tiny_config(tiny_llama_dir), tmp_path, tmp_path / "out")
    partial = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, partial, ignore=shutil.ignore_patterns("tokenizer"))
    with pytest.raises(MissingArtifactError, match="tokenizer"):
        render_model_repository(tiny_config(tiny_llama_dir), partial, tmp_path / "out2")


# --- launcher: pure parts ---

BUNDLED = TritonInstall(
    Path("/w/bin/tritonserver"), Path("/w/backends/python"), Path("/w/stub"), Path("/w/libs")
)


def test_server_args_bind_loopback_and_apply_the_cpu_recipe() -> None:
    opts = ServerOptions(Path("/repo"), http_port=1, grpc_port=2, metrics_port=3)
    args = server_args(opts, Path("/run/backends"), "pfx_")
    for flag in (
        "--model-repository=/repo",
        "--backend-directory=/run/backends",
        "--http-address=127.0.0.1",
        "--grpc-address=127.0.0.1",
        "--metrics-address=127.0.0.1",
        "--http-port=1",
        "--grpc-port=2",
        "--metrics-port=3",
        "--backend-config=python,shm-region-prefix-name=pfx_",
        "--pinned-memory-pool-byte-size=0",
        "--allow-gpu-metrics=false",
        "--exit-timeout-secs=5",
    ):
        assert flag in args


def test_server_env_puts_bundled_libs_and_this_python_first() -> None:
    env = server_env(BUNDLED, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/x"})
    assert env["LD_LIBRARY_PATH"].startswith("/w/libs:") and env["LD_LIBRARY_PATH"].endswith(":/x")
    assert env["PATH"].split(":")[0] == str(Path(os.sys.executable).parent)  # type: ignore[attr-defined]
    assert Path(env["PYTHONPATH"].split(":")[0], "pipeline").is_dir()
    plain = server_env(TritonInstall(Path("/opt/tritonserver/bin/tritonserver")), {"PATH": "/usr/bin"})
    assert plain["PATH"] == "/usr/bin" and "LD_LIBRARY_PATH" not in plain


def test_failure_lines_pick_the_failing_model_and_free_ports_are_concrete() -> None:
    log = [
        "I1129 starting",
        "E1129 12:00:00 1 model_lifecycle.cc:1] failed to load 'tensorrt_llm' version 1: "
        "Internal: ValueError: model 'tensorrt_llm': parameter device='tpu' is invalid",
        "I1129 unrelated",
        "| tensorrt_llm | 1 | UNAVAILABLE: Internal: ... |",
    ]
    picked = failure_lines(log)
    assert picked == [log[1], log[3]]
    opts = with_free_ports(ServerOptions(Path("/repo"), http_port=0, grpc_port=0, metrics_port=0))
    assert len({opts.http_port, opts.grpc_port, opts.metrics_port}) == 3 and opts.http_port > 0


# --- llmpipe serve: argument checks (no server started) ---


def test_serve_dry_run_prints_a_loopback_command(repo: Path) -> None:
    from click.testing import CliRunner

    from pipeline.cli.serve import serve

    result = CliRunner().invoke(serve, [str(repo), "--dry-run", "--http-port", "9000"])
    assert result.exit_code == 0, result.output
    assert f"--model-repository={repo}" in result.output and "--http-address=127.0.0.1" in result.output
    assert "--http-port=9000" in result.output and "--grpc-port=8001" in result.output


def test_serve_explains_what_is_missing(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from pipeline.cli.serve import serve
    from pipeline.errors import BackendUnavailableError

    not_a_repo = CliRunner().invoke(serve, [str(tmp_path)])
    assert isinstance(not_a_repo.exception, MissingArtifactError) and "no */config.pbtxt" in str(
        not_a_repo.exception
    )
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "tiny.yaml"
    config.write_text(f"name: tiny\nsource: {{kind: local, path: {tiny_llama_dir}}}\n")
    unbuilt = CliRunner().invoke(serve, [str(config)])
    assert isinstance(unbuilt.exception, MissingArtifactError)
    assert "tiny has no packaged model repository" in str(unbuilt.exception)
    assert f"llmpipe build {config}" in (unbuilt.exception.hint or "")
    trt = tmp_path / "trt"
    render_model_repository(tiny_config(tiny_llama_dir, backend="trtllm"), tiny_engine_dir, trt)
    monkeypatch.setattr("pipeline.cli.serve.find_tritonserver", lambda: BUNDLED)
    refused = CliRunner().invoke(serve, [str(trt)])
    assert isinstance(refused.exception, BackendUnavailableError) and "trtllm" in (
        refused.exception.hint or ""
    )


def test_a_changed_template_renders_the_repository_again(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repository is reused only while the templates it was rendered from are unchanged (a newer llmpipe
    renders it anew), like a stage whose inputs changed."""
    from pipeline.serving.repository import render
    from pipeline.stages.chain import run_chain, stages_until

    cfg = tiny_config(tiny_llama_dir, workdir=str(tmp_path / "work"))
    run_chain(cfg, stages_until("package"))
    assert all(result.reused for result in run_chain(cfg, stages_until("package")).values())

    edited = _templates(tmp_path, "postprocessing", 'backend: "python"', 'backend: "python"  # edited')
    monkeypatch.setattr(render, "templates_dir", lambda: edited)
    results = run_chain(cfg, stages_until("package"))
    assert not results["package"].reused and results["engine"].reused
    assert "# edited" in (results["package"].dir / "postprocessing" / "config.pbtxt").read_text()
