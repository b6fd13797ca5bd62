"""Contract of the trtllm backend against TensorRT-LLM's documented interface (no GPU, no TensorRT-LLM):
the generated trtllm-build command lines and tensorrt_llm parameters equal hand-reviewed expected files,
every flag exists in the release it targets, every parameter is one the tensorrtllm backend reads, and
the parameters make a ModelConfig that Triton's protobuf schema parses."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pipeline.backends.trtllm.build_cmd import (
    SPECULATIVE_DECODING_MODE,
    check_argv,
    lookahead_max_draft_len,
    trtllm_build_argv,
)
from pipeline.backends.trtllm.triton_params import tensorrt_llm_header, tensorrt_llm_parameters
from pipeline.backends.trtllm.versions import FLAG_CHOICES, PINNED, PINNED_CONTAINER, RELEASES
from pipeline.config.build_config import BuildConfig
from pipeline.config.vocab import BACKEND_QUANT_MODES
from pipeline.errors import ConfigError
from pipeline.serving.repository.render import DRAFT_MODEL
from tests.contract.render import (
    CONFIG_DIR,
    EXPECTED_DIR,
    config_paths,
    contract_files,
    draft_of,
    load,
    work_paths,
)

CONFIGS = config_paths()


def _expected_flags() -> dict[str, set[str]]:
    per_release: dict[str, set[str]] = {version: set() for version in RELEASES}
    for line in (EXPECTED_DIR / "trtllm_build_flags.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        words = line.split()
        releases = [w for w in words if not w.startswith("--")]
        flags = {w for w in words if w.startswith("--")}
        for version in RELEASES if releases == ["all"] else releases:
            per_release[version] |= flags
    return per_release


def _parameter_names() -> set[str]:
    text = (EXPECTED_DIR / "tensorrt_llm_parameter_names.txt").read_text()
    return {line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")}


def test_the_four_required_configs_are_pinned() -> None:
    names = {p.stem for p in CONFIGS}
    assert {"fp16-tp1", "int4-awq-tp2", "fp8-kv-reuse-chunked", "draft-target"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_generated_files_match_expected(path: Path) -> None:
    cfg = load(path)
    for name, text in contract_files(cfg).items():
        expected = EXPECTED_DIR / cfg.name / name
        assert expected.is_file(), f"no expected file {expected}"
        assert text == expected.read_text(), f"{cfg.name}/{name} differs from the reviewed expected file"


def test_release_table_matches_the_transcribed_cli_reference() -> None:
    assert {v: set(r.build_flags) for v, r in RELEASES.items()} == _expected_flags()
    assert PINNED in RELEASES and PINNED.startswith("1.1")


def _config_matrix() -> list[BuildConfig]:
    """Every branch of the generator: quant modes x speculative modes x paged-FMHA x small/large batch."""
    configs = []
    spec_modes = ["none", *SPECULATIVE_DECODING_MODE]
    for mode, spec, paged, batch in itertools.product(
        BACKEND_QUANT_MODES["trtllm"], spec_modes, (True, False), (4, 64)
    ):
        spec_cfg = {"mode": spec, "draft_config": "draft.yaml"}
        if spec == "lookahead":
            spec_cfg["max_draft_len"] = lookahead_max_draft_len(4, 3, 4)
        configs.append(BuildConfig.model_validate({
            "name": "matrix", "backend": "trtllm", "source": {"kind": "local", "path": "m"},
            "dtype": "bfloat16" if batch == 4 else "auto",
            "quantization": {"mode": mode}, "kv_cache": {"use_paged_context_fmha": paged},
            "engine": {"max_batch_size": batch, "visualize_network": paged}, "speculative": spec_cfg,
            "parallel": {"tp_size": 1 + (batch == 64)},
        }))  # fmt: skip
    return configs


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_every_flag_the_generator_can_emit_exists_in_each_release(version: str) -> None:
    flags = _expected_flags()[version]
    emitted: set[str] = set()
    for cfg in _config_matrix():
        argv = trtllm_build_argv(cfg, Path("ckpt"), Path("engine"), target=RELEASES[version])
        assert argv[0] == "trtllm-build"
        for index, token in enumerate(argv):
            if token.startswith("--"):
                emitted.add(token)
                assert token in flags, f"{token} is not a trtllm-build {version} flag"
                if token in FLAG_CHOICES:
                    assert argv[index + 1] in FLAG_CHOICES[token]
    # The generator really exercised the plugin, speculative and visualize branches.
    assert {
        "--gemm_plugin",
        "--speculative_decoding_mode",
        "--max_draft_len",
        "--visualize_network",
    } <= emitted


def test_a_flag_missing_from_the_release_is_refused() -> None:
    with pytest.raises(ConfigError, match="--auto_parallel does not exist in TensorRT-LLM 1.2.0"):
        check_argv(["trtllm-build", "--auto_parallel", "2"], RELEASES["1.2.0"])
    with pytest.raises(ConfigError, match="--kv_cache_type fp8 is not valid"):
        check_argv(["trtllm-build", "--kv_cache_type", "fp8"], RELEASES["1.2.0"])


def test_fp8_gemm_plugin_only_at_small_batch_and_nvfp4_always() -> None:
    def argv_for(mode: str, batch: int) -> list[str]:
        cfg = BuildConfig.model_validate(
            {
                "name": "g",
                "backend": "trtllm",
                "source": {"kind": "local", "path": "m"},
                "quantization": {"mode": mode},
                "engine": {"max_batch_size": batch},
            }
        )
        return trtllm_build_argv(cfg, "c", "e")

    assert "--gemm_plugin" not in argv_for("fp8", 64)
    assert argv_for("fp8", 4)[argv_for("fp8", 4).index("--gemm_plugin") + 1] == "fp8"
    assert argv_for("nvfp4", 64)[argv_for("nvfp4", 64).index("--gemm_plugin") + 1] == "nvfp4"


def test_lookahead_draft_len_must_match_window_ngram_verification_set() -> None:
    assert lookahead_max_draft_len(4, 3, 4) == 15
    assert lookahead_max_draft_len(7, 7, 7) == 5 + 13 * 6  # TensorRT-LLM's [7,7,7] example: 83
    cfg = BuildConfig.model_validate(
        {
            "name": "l",
            "backend": "trtllm",
            "source": {"kind": "local", "path": "m"},
            "speculative": {"mode": "lookahead", "max_draft_len": 4},
        }
    )
    with pytest.raises(ConfigError, match="needs max_draft_len=15"):
        trtllm_build_argv(cfg, "c", "e")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_parameter_is_one_the_backend_reads(path: Path) -> None:
    cfg = load(path)
    params = tensorrt_llm_parameters(cfg, work_paths(cfg)[1])
    assert set(params) <= _parameter_names()
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert all("${" not in value for value in params.values())
    for key in ("enable_kv_cache_reuse", "enable_chunked_context", "exclude_input_in_output"):
        assert params[key] in ("true", "false")
    # The C++ backend reads these with no fallback since v0.19: a missing one fails the model's load
    # (NVIDIA/TensorRT-LLM:triton_backend/inflight_batcher_llm/src/model_instance_state.cc).
    for key in ("tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend"):
        assert key in params


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_rendered_config_pbtxt_parses_with_tritons_schema(path: Path) -> None:
    cfg = load(path)
    text = (EXPECTED_DIR / cfg.name / "tensorrt_llm.config.pbtxt").read_text()
    model = text_format.Parse(text, model_config_pb2.ModelConfig())
    header = tensorrt_llm_header(cfg)
    assert (model.name, model.backend) == ("tensorrt_llm", "tensorrtllm")
    assert model.max_batch_size == int(header["triton_max_batch_size"])
    assert model.model_transaction_policy.decoupled is (header["decoupled_mode"] == "true")
    assert {k: v.string_value for k, v in model.parameters.items()} == tensorrt_llm_parameters(
        cfg, work_paths(cfg)[1]
    )
    inputs = {i.name for i in model.input}
    assert {"input_ids", "input_lengths", "request_output_len", "streaming"} <= inputs
    assert {"output_ids", "sequence_length"} <= {o.name for o in model.output}


def test_dockerfile_builds_on_the_pinned_serving_image() -> None:
    dockerfile = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={PINNED_CONTAINER}\n" in dockerfile
    assert "FROM ${BASE_IMAGE}" in dockerfile
    # the image's torch / transformers / tensorrt_llm stay untouched: every installed version is a constraint
    assert "pip list --format=freeze > /tmp/image-versions.txt" in dockerfile
    assert "pip install --no-cache-dir -c /tmp/image-versions.txt -e ." in dockerfile


# tensorrtllm_backend's speculative tensors on tensorrt_llm (all_models/inflight_batcher_llm/tensorrt_llm/
# config.pbtxt): name -> (type, dims)
SPECULATIVE_INPUTS = {
    "draft_input_ids": ("TYPE_INT32", [-1]),
    "draft_logits": ("TYPE_FP32", [-1, -1]),  # ${logits_datatype}
    "draft_acceptance_threshold": ("TYPE_FP32", [1]),
    "return_perf_metrics": ("TYPE_BOOL", [1]),
}
SPECULATIVE_OUTPUTS = {
    "acceptance_rate": ("TYPE_FP32", [1]),
    "total_accepted_draft_tokens": ("TYPE_INT32", [1]),
    "total_draft_tokens": ("TYPE_INT32", [1]),
}


def _tensors(tensors) -> dict[str, tuple[str, list[int], bool]]:  # type: ignore[no-untyped-def]
    return {
        t.name: (model_config_pb2.DataType.Name(t.data_type), list(t.dims), getattr(t, "optional", False))
        for t in tensors
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_speculative_tensors_have_tensorrtllm_backends_types(path: Path) -> None:
    text = (EXPECTED_DIR / load(path).name / "tensorrt_llm.config.pbtxt").read_text()
    model = text_format.Parse(text, model_config_pb2.ModelConfig())
    inputs, outputs = _tensors(model.input), _tensors(model.output)
    for name, (dtype, dims) in SPECULATIVE_INPUTS.items():
        assert inputs[name] == (dtype, dims, True), name  # optional: plain requests never send them
    for name, (dtype, dims) in SPECULATIVE_OUTPUTS.items():
        assert outputs[name][:2] == (dtype, dims), name


def test_draft_target_serves_the_draft_engine_and_names_it_in_the_bls() -> None:
    cfg = load(CONFIG_DIR / "draft-target.yaml")
    draft = draft_of(cfg)
    assert draft is not None and draft.cfg.name == "draft-target.draft"
    files = contract_files(cfg)
    bls = json.loads(files["tensorrt_llm_bls.parameters.json"])
    assert bls["tensorrt_llm_model_name"] == "tensorrt_llm"
    assert bls["tensorrt_llm_draft_model_name"] == DRAFT_MODEL == "tensorrt_llm_draft"
    assert bls["num_draft_tokens"] == str(cfg.speculative.max_draft_len)
    model = text_format.Parse(files[f"{DRAFT_MODEL}.config.pbtxt"], model_config_pb2.ModelConfig())
    assert (model.name, model.backend) == (DRAFT_MODEL, "tensorrtllm")
    params = {k: v.string_value for k, v in model.parameters.items()}
    assert params == tensorrt_llm_parameters(draft.cfg, work_paths(draft.cfg)[1])
    assert params["gpt_model_path"] == "build/draft-target.draft/engine"
    assert set(params) <= _parameter_names()
    # Same tensors as the target: the BLS calls both the same way.
    target = text_format.Parse(files["tensorrt_llm.config.pbtxt"], model_config_pb2.ModelConfig())
    assert _tensors(model.input) == _tensors(target.input)
    assert _tensors(model.output) == _tensors(target.output)
    for other in CONFIGS:
        if other.stem != "draft-target":
            other_bls = json.loads(contract_files(load(other))["tensorrt_llm_bls.parameters.json"])
            assert (other_bls["tensorrt_llm_draft_model_name"], other_bls["num_draft_tokens"]) == ("", "0")
