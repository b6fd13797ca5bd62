"""Contract of the trtllm backend against TensorRT-LLM 1.1.0's recorded interface (tests/contract/upstream/,
each file citing its upstream source; no GPU, no TensorRT-LLM here): every trtllm-build flag llmpipe emits
parses with the release's recorded command line, the rendered tensorrt_llm model carries only upstream's
parameter keys (and every upstream key, or says why not) and only upstream's tensors with upstream's types
and shapes, and so does the ensemble. The byte-for-byte comparison with expected/ stays as a review aid for
intended changes."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
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
from pipeline.runtime import engine_config
from pipeline.serving.repository.render import DRAFT_MODEL, render_configs, templates_dir
from tests.contract import fake_trtllm_build, upstream_facts
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

# Upstream tensorrt_llm parameter keys llmpipe does not write, and why: a key left out makes the C++ backend
# use its own default (it logs "... is not specified, will use default").
OMITTED_PARAMETERS: dict[str, str] = {
    "encoder_model_path": "encoder-decoder models only; llmpipe builds decoder-only engines",
    "cross_kv_cache_fraction": "encoder-decoder models only",
    "max_tokens_in_paged_kv_cache": "written only when kv_cache.max_tokens is set; else the memory fraction rules",
    "max_attention_window_size": "llmpipe attends to the whole sequence (the backend's default)",
    "sink_token_length": "no attention sinks (StreamingLLM is not built)",
    "kv_cache_host_memory_bytes": "no host offloading of the KV cache",
    "kv_cache_onboard_blocks": "internal to the backend (the template says so)",
    "cancellation_check_period_ms": "the backend's default period",
    "stats_check_period_ms": "the backend's default period",
    "iter_stats_max_iterations": "the backend's default statistics window",
    "request_stats_max_iterations": "the backend's default statistics window",
    "normalize_log_probs": "the backend's default (normalised)",
    "gpu_device_ids": "every visible GPU (the backend's default)",
    "participant_ids": "leader mode only; llmpipe does not run orchestrator mode",
    "num_nodes": "single node",
    "lora_cache_optimal_adapter_size": "no LoRA",
    "lora_cache_max_adapter_size": "no LoRA",
    "lora_cache_gpu_memory_fraction": "no LoRA",
    "lora_cache_host_memory_bytes": "no LoRA",
    "lora_prefetch_dir": "no LoRA",
    "decoding_mode": "left out for draft-target: the executor picks the mode of external draft tokens",
    "lookahead_window_size": "written only with speculative.mode=lookahead",
    "lookahead_ngram_size": "written only with speculative.mode=lookahead",
    "lookahead_verification_set_size": "written only with speculative.mode=lookahead",
    "medusa_choices": "no Medusa heads (refused by the build guards)",
    "eagle_choices": "no EAGLE heads (refused by the build guards)",
    "gpu_weights_percent": "engines are not built with weight streaming",
    "enable_context_fmha_fp32_acc": "the backend's default (off)",
    "multi_block_mode": "the backend's default (on)",
    "cuda_graph_mode": "the backend's default (off)",
    "cuda_graph_cache_size": "the backend's default",
    "speculative_decoding_fast_logits": "the BLS moves draft logits itself (leader mode only upstream)",
}
# Inputs of llmpipe's tensorrt_llm model that TensorRT-LLM 1.1.0's model lacks, and why they stay. The
# template is shared with the torch engine, which reads them; the 1.1.0 C++ backend reads the newer names
# (min_tokens, seed, return_perf_metrics) and ignores these.
LLMPIPE_ONLY_INPUTS: dict[str, str] = {
    "min_length": "tensorrtllm_backend v0.18's name of min_tokens",
    "random_seed": "tensorrtllm_backend v0.18's name of seed",
    "return_kv_cache_reuse_stats": "tensorrtllm_backend v0.18's switch for the kv_cache_* outputs",
}
ENSEMBLE_ONLY_INPUTS: dict[str, str] = {
    **LLMPIPE_ONLY_INPUTS,
    "apply_chat_template": "llmpipe's: format text_input with the tokenizer's chat template",
}
# What the draft-target flow needs from the tensorrt_llm model (fed and read by the BLS).
SPECULATIVE_TENSORS = {
    "input": ("draft_input_ids", "draft_logits", "draft_acceptance_threshold", "return_perf_metrics"),
    "output": ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"),
}


def _model(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _engine_models() -> list[tuple[Path, str]]:
    """(build config, rendered model) of every tensorrt_llm model llmpipe renders, draft models included."""
    models = [(path, "tensorrt_llm") for path in CONFIGS]
    models += [(path, DRAFT_MODEL) for path in CONFIGS if draft_of(load(path)) is not None]
    return models


def _rendered(path: Path, model_name: str) -> tuple[BuildConfig, model_config_pb2.ModelConfig]:
    """The build config that model serves (the draft's own for the draft model) and the parsed model."""
    cfg = load(path)
    model = _model(contract_files(cfg)[f"{model_name}.config.pbtxt"])
    draft = draft_of(cfg)
    return (draft.cfg if model_name == DRAFT_MODEL and draft else cfg), model


ENGINE_MODELS = _engine_models()
ENGINE_MODEL_IDS = [f"{path.stem}:{name}" for path, name in ENGINE_MODELS]


def test_the_four_required_configs_are_pinned() -> None:
    names = {p.stem for p in CONFIGS}
    assert {"fp16-tp1", "int4-awq-tp2", "fp8-kv-reuse-chunked", "draft-target"} <= names


def test_every_upstream_fact_file_cites_its_source() -> None:
    files = upstream_facts.fact_files()
    assert {p.name for p in files} >= {
        "tensorrt_llm_io.tsv", "tensorrt_llm_parameters.txt", "trtllm_build_flags.tsv",
        "engine_config_layout.tsv", "trtllm_build_outputs.tsv", "engine_config_adjustments.tsv",
        "ensemble_io.tsv",
    }  # fmt: skip
    for path in files:
        header = path.read_text(encoding="utf-8").splitlines()[0]
        assert header.startswith("# ") and upstream_facts.CITATION.search(header), (
            f"{path.name}: {header[:80]}"
        )
        assert "read with" in header, f"{path.name} does not say how it was read"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_generated_files_match_expected(path: Path) -> None:
    """Review aid: a generator change shows up as a diff of the files in expected/."""
    cfg = load(path)
    for name, text in contract_files(cfg).items():
        expected = EXPECTED_DIR / cfg.name / name
        assert expected.is_file(), f"no expected file {expected}"
        assert text == expected.read_text(), f"{cfg.name}/{name} differs from the reviewed expected file"


# ---- trtllm-build ---------------------------------------------------------------------------------------
def test_release_table_matches_the_recorded_cli() -> None:
    assert PINNED == upstream_facts.RELEASE
    for version, target in RELEASES.items():
        assert set(target.build_flags) == set(upstream_facts.trtllm_build_flags(version)), version
    recorded = upstream_facts.trtllm_build_flags(PINNED)
    for flag, choices in FLAG_CHOICES.items():
        assert set(choices) == set(recorded[flag].choices or ()), flag


def _config_matrix() -> list[BuildConfig]:
    """Every branch of the generator: quant modes x speculative modes x paged-FMHA x small/large batch."""
    configs = []
    spec_modes = ["none", *SPECULATIVE_DECODING_MODE]
    for mode, spec, paged, batch in itertools.product(
        BACKEND_QUANT_MODES["trtllm"], spec_modes, (True, False), (4, 64)
    ):
        if spec == "draft_model" and not paged:
            continue  # draft-target needs KV block reuse, which needs paged context FMHA
        spec_cfg: dict[str, object] = {"mode": spec, "draft_config": "draft.yaml"}
        if spec == "lookahead":
            spec_cfg["max_draft_len"] = lookahead_max_draft_len(4, 3, 4)
        configs.append(BuildConfig.model_validate({
            "name": "matrix", "backend": "trtllm", "source": {"kind": "local", "path": "m"},
            "dtype": "bfloat16" if batch == 4 else "auto",
            "quantization": {"mode": mode},
            "kv_cache": {"use_paged_context_fmha": paged, "enable_block_reuse": spec == "draft_model"},
            "engine": {"max_batch_size": batch, "visualize_network": paged}, "speculative": spec_cfg,
            "parallel": {"tp_size": 1 + (batch == 64)},
        }))  # fmt: skip
    return configs


def test_every_argv_the_generator_can_emit_parses_with_the_pinned_cli() -> None:
    cli = fake_trtllm_build.parser()
    emitted: set[str] = set()
    for cfg in _config_matrix():
        argv = trtllm_build_argv(cfg, Path("ckpt"), Path("engine"))
        assert argv[0] == "trtllm-build"
        cli.parse_args(argv[1:])  # argparse exits 2 on an unknown flag or a value outside a choice set
        emitted |= {token for token in argv if token.startswith("--")}
    # The generator really exercised the plugin, speculative and visualize branches.
    assert {
        "--gemm_plugin",
        "--speculative_decoding_mode",
        "--max_draft_len",
        "--visualize_network",
    } <= emitted


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_every_flag_the_generator_can_emit_exists_in_each_release(version: str) -> None:
    flags = upstream_facts.trtllm_build_flags(version)
    for cfg in _config_matrix():
        argv = trtllm_build_argv(cfg, Path("ckpt"), Path("engine"), target=RELEASES[version])
        for index, token in enumerate(argv):
            if token.startswith("--"):
                assert token in flags, f"{token} is not a trtllm-build {version} flag"
                if flags[token].choices:
                    assert argv[index + 1] in (flags[token].choices or ())


def test_the_recorded_cli_refuses_like_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    cli = fake_trtllm_build.parser()
    for argv, message in (
        (["--tp_size", "2"], "unrecognized arguments: --tp_size 2"),  # removed in 0.12
        (["--max_output_len", "8"], "unrecognized arguments: --max_output_len 8"),
        (["--gemm_plugin", "fp9"], "argument --gemm_plugin: invalid choice: 'fp9'"),
        (["--max_batch_size", "many"], "argument --max_batch_size: invalid int value: 'many'"),
    ):
        with pytest.raises(SystemExit) as info:
            cli.parse_args(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: trtllm-build") and f"trtllm-build: error: {message}" in err


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


# ---- the tensorrt_llm model ------------------------------------------------------------------------------
def test_omitted_parameters_are_upstream_keys() -> None:
    upstream = set(upstream_facts.tensorrt_llm_parameter_keys())
    assert set(OMITTED_PARAMETERS) <= upstream, set(OMITTED_PARAMETERS) - upstream


@pytest.mark.parametrize(("path", "model_name"), ENGINE_MODELS, ids=ENGINE_MODEL_IDS)
def test_rendered_parameters_are_upstreams_keys(path: Path, model_name: str) -> None:
    _, model = _rendered(path, model_name)
    params = {k: v.string_value for k, v in model.parameters.items()}
    upstream = set(upstream_facts.tensorrt_llm_parameter_keys())
    assert set(params) <= upstream, (
        f"not parameters of TensorRT-LLM {PINNED}'s tensorrt_llm: {set(params) - upstream}"
    )
    missing = upstream - set(params) - set(OMITTED_PARAMETERS)
    assert not missing, f"upstream keys neither written nor listed with a reason: {missing}"
    # The C++ backend reads these with no fallback: a missing one fails the model's load
    # (NVIDIA/TensorRT-LLM:triton_backend/inflight_batcher_llm/src/model_instance_state.cc).
    assert {"tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend"} <= set(params)
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert all("${" not in value for value in params.values())
    for key in ("enable_kv_cache_reuse", "enable_chunked_context", "exclude_input_in_output"):
        assert params[key] in ("true", "false")


def _resolved(data_type: str, cfg: BuildConfig) -> str:
    """An upstream data_type with its template placeholder filled the way llmpipe fills it."""
    if data_type.startswith("${"):
        return tensorrt_llm_header(cfg)[data_type[2:-1]]
    return data_type


def _assert_upstream_tensors(
    model: model_config_pb2.ModelConfig, upstream_model: str, cfg: BuildConfig, own_inputs: dict[str, str]
) -> None:
    """Every tensor of `model` is upstream's (name, data type, dims), apart from `own_inputs`; every input
    upstream requires is there and required."""
    recorded = upstream_facts.model_tensors(upstream_model)
    for direction, tensors in (("input", model.input), ("output", model.output)):
        for tensor in tensors:
            if direction == "input" and tensor.name in own_inputs:
                assert tensor.name not in recorded["input"], (
                    f"{tensor.name} is upstream now: drop the exception"
                )
                continue
            assert tensor.name in recorded[direction], f"{direction} {tensor.name}: not in {upstream_model}"
            upstream = recorded[direction][tensor.name]
            data_type = model_config_pb2.DataType.Name(tensor.data_type)
            wanted = (_resolved(upstream.data_type, cfg), upstream.dims)
            assert (data_type, tuple(tensor.dims)) == wanted, tensor.name
    ours = {t.name: t for t in model.input}
    for required in (t for t in recorded["input"].values() if not t.optional):
        assert required.name in ours and not ours[required.name].optional, (
            f"upstream requires {required.name}"
        )


@pytest.mark.parametrize(("path", "model_name"), ENGINE_MODELS, ids=ENGINE_MODEL_IDS)
def test_rendered_tensors_are_upstreams(path: Path, model_name: str) -> None:
    cfg, model = _rendered(path, model_name)
    _assert_upstream_tensors(model, "tensorrt_llm", cfg, LLMPIPE_ONLY_INPUTS)
    for direction, names in SPECULATIVE_TENSORS.items():
        assert set(names) <= {t.name for t in getattr(model, direction)}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_rendered_ensemble_tensors_are_upstreams(path: Path) -> None:
    cfg = load(path)
    ensemble = _model(render_configs(cfg, templates_dir(), work_paths(cfg)[1], draft_of(cfg))["ensemble"])
    _assert_upstream_tensors(ensemble, "ensemble", cfg, ENSEMBLE_ONLY_INPUTS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_rendered_config_pbtxt_parses_with_tritons_schema(path: Path) -> None:
    cfg = load(path)
    model = _model(contract_files(cfg)["tensorrt_llm.config.pbtxt"])
    header = tensorrt_llm_header(cfg)
    assert (model.name, model.backend) == ("tensorrt_llm", "tensorrtllm")
    assert model.max_batch_size == int(header["triton_max_batch_size"])
    assert model.model_transaction_policy.decoupled is (header["decoupled_mode"] == "true")
    assert {k: v.string_value for k, v in model.parameters.items()} == tensorrt_llm_parameters(
        cfg, work_paths(cfg)[1]
    )


# ---- engine config.json -----------------------------------------------------------------------------------
# Keys of the torch engine's config.json that TensorRT-LLM's layout lacks: llmpipe's own, next to the
# TensorRT-LLM-shaped ones.
TORCH_ONLY_KEYS: dict[str, str] = {
    "backend": "which engine serves the folder (torch)",
    "runtime_defaults": "the serving defaults the torch engine starts with",
    "build_config.speculative_config": "how the torch engine drafts (n-gram bounds, the draft engine folder)",
}


def test_the_torch_engine_config_uses_tensorrt_llms_names() -> None:
    """The torch engine's config.json keeps TensorRT-LLM's top-level layout and build_config names, so the
    fields both engines have are spelled as trtllm-build spells them."""
    model = engine_config.ModelConfig(
        architecture="LlamaForCausalLM", dtype="float16", vocab_size=32, hidden_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=4, intermediate_size=16,
        max_position_embeddings=64, norm_epsilon=1e-5, hidden_act="silu",
    )  # fmt: skip
    build = engine_config.BuildLimits(max_batch_size=1, max_input_len=8, max_seq_len=16, max_num_tokens=16)
    written = engine_config.EngineConfig(
        "0", "torch", model, build, engine_config.RuntimeDefaults()
    ).to_dict()
    ours = {path for path in upstream_facts.key_paths(written) if not path.startswith("pretrained_config.")}
    layout = set(upstream_facts.engine_config_layout())
    assert set(TORCH_ONLY_KEYS) <= ours and not set(TORCH_ONLY_KEYS) & layout
    llmpipe_own = {p for p in ours if any(p == k or p.startswith(f"{k}.") for k in TORCH_ONLY_KEYS)}
    assert ours - llmpipe_own <= layout, ours - llmpipe_own - layout


def test_dockerfile_builds_on_the_pinned_serving_image() -> None:
    dockerfile = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={PINNED_CONTAINER}\n" in dockerfile
    assert "FROM ${BASE_IMAGE}" in dockerfile
    # the image's torch / transformers / tensorrt_llm stay untouched: every installed version is a constraint
    assert "pip list --format=freeze > /tmp/image-versions.txt" in dockerfile
    assert "pip install --no-cache-dir -c /tmp/image-versions.txt -e ." in dockerfile


def _tensors(
    tensors: Iterable[model_config_pb2.ModelInput | model_config_pb2.ModelOutput],
) -> dict[str, tuple[str, list[int], bool]]:
    return {
        t.name: (model_config_pb2.DataType.Name(t.data_type), list(t.dims), getattr(t, "optional", False))
        for t in tensors
    }


def test_draft_target_serves_the_draft_engine_and_names_it_in_the_bls() -> None:
    cfg = load(CONFIG_DIR / "draft-target.yaml")
    draft = draft_of(cfg)
    assert draft is not None and draft.cfg.name == "draft-target.draft"
    files = contract_files(cfg)
    bls = json.loads(files["tensorrt_llm_bls.parameters.json"])
    assert bls["tensorrt_llm_model_name"] == "tensorrt_llm"
    assert bls["tensorrt_llm_draft_model_name"] == DRAFT_MODEL == "tensorrt_llm_draft"
    assert bls["num_draft_tokens"] == str(cfg.speculative.max_draft_len)
    model = _model(files[f"{DRAFT_MODEL}.config.pbtxt"])
    assert (model.name, model.backend) == (DRAFT_MODEL, "tensorrtllm")
    params = {k: v.string_value for k, v in model.parameters.items()}
    assert params == tensorrt_llm_parameters(draft.cfg, work_paths(draft.cfg)[1])
    assert params["gpt_model_path"] == "build/draft-target.draft/engine"
    # Same tensors as the target: the BLS calls both the same way.
    target = _model(files["tensorrt_llm.config.pbtxt"])
    assert _tensors(model.input) == _tensors(target.input)
    assert _tensors(model.output) == _tensors(target.output)
    for other in CONFIGS:
        if other.stem != "draft-target":
            other_bls = json.loads(contract_files(load(other))["tensorrt_llm_bls.parameters.json"])
            assert (other_bls["tensorrt_llm_draft_model_name"], other_bls["num_draft_tokens"]) == ("", "0")
