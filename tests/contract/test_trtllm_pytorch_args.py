"""The trtllm_pytorch backend's LLM API arguments, model.yaml and trtllm-serve command line against
TensorRT-LLM 1.1.0's interface as recorded in pipeline/data/llm_api_args_fields.txt (sources in its header).

TensorRT-LLM cannot be installed here, so its argument classes are not imported: the recorded field list is
the contract, and a generated name outside it must fail when it is generated."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from pipeline.backends.trtllm_pytorch import llm_args as llm_args_module
from pipeline.backends.trtllm_pytorch.llm_args import (
    llm_api_args,
    model_yaml,
    trtllm_serve_argv,
    trtllm_serve_options,
)
from pipeline.backends.trtllm_pytorch.upstream import check_argv, check_mapping, interface, parse_interface
from pipeline.config.build_config import BuildConfig
from pipeline.errors import ConfigError


def make_cfg(**sections: Any) -> BuildConfig:
    data = {"name": "p", "backend": "trtllm_pytorch", "source": {"kind": "local", "path": "m"}, **sections}
    return BuildConfig.model_validate(data)


def paths(mapping: dict[str, Any], prefix: str = "") -> set[str]:
    """Every key of a nested mapping as a dotted path."""
    found = set()
    for key, value in mapping.items():
        path = f"{prefix}{key}"
        found.add(path)
        if isinstance(value, dict):
            found |= paths(value, f"{path}.")
    return found


# ---- the record itself -----------------------------------------------------------------------------------
def test_the_record_cites_upstream_and_every_reference_resolves() -> None:
    spec = interface()
    assert re.fullmatch(r"NVIDIA/TensorRT-LLM:\S+@[0-9a-f]{7,40} \(release 1\.1\.0\)", spec.source)
    for cls, fields in spec.classes.items():
        for name, field in fields.items():
            if field.target is not None:
                assert field.target in spec.classes or field.target in spec.choices, f"{cls}.{name}"
    assert all(target in spec.classes for choice in spec.choices.values() for target in choice.values())
    # TorchLlmArgs takes BaseLlmArgs' fields, and each decoding config the base ones.
    torch_args = spec.classes["TorchLlmArgs"]
    assert {"tensor_parallel_size", "kv_cache_config", "cuda_graph_config", "speculative_config"} <= set(
        torch_args
    )
    assert {"decoding_type", "max_draft_len", "speculative_model_dir"} <= set(
        spec.classes["NGramDecodingConfig"]
    )


def test_a_field_before_any_section_is_refused() -> None:
    with pytest.raises(ValueError, match="comes before any section"):
        parse_interface("# source\nmax_batch_size\n")


# ---- what llmpipe generates ------------------------------------------------------------------------------
CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "ngram, fp8 KV, max_utilization, KV capacity": {
        "speculative": {"mode": "ngram", "max_draft_len": 3, "ngram": {"max_match": 4}},
        "quantization": {"mode": "fp8", "kv_cache_dtype": "fp8"},
        "scheduler": {"policy": "max_utilization", "enable_chunked_context": True},
        "kv_cache": {"max_tokens": 8192, "enable_block_reuse": True},
        "parallel": {"tp_size": 2, "pp_size": 2},
        "serving": {"stream_interval": 4},
    },
}


@pytest.mark.parametrize("sections", CONFIGS.values(), ids=CONFIGS.keys())
def test_generated_arguments_use_only_recorded_names(sections: dict[str, Any], tmp_path: Path) -> None:
    cfg = make_cfg(**sections)
    args = llm_api_args(cfg, tmp_path)
    check_mapping(args)  # what llm_api_args already ran: it must not raise on its own output
    torch_fields = interface().classes["TorchLlmArgs"]
    assert set(args) <= set(torch_fields)
    assert set(args["kv_cache_config"]) <= set(interface().classes["KvCacheConfig"])
    assert args["model"] == str(tmp_path)
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"]) == (
        cfg.parallel.tp_size,
        cfg.parallel.pp_size,
    )
    assert args["scheduler_config"]["capacity_scheduler_policy"] == cfg.scheduler.policy.upper()
    assert args["kv_cache_config"]["dtype"] == cfg.quantization.kv_cache_dtype
    assert args["enable_chunked_prefill"] is cfg.scheduler.enable_chunked_context
    assert args["stream_interval"] == cfg.serving.stream_interval


def test_speculative_modes_map_onto_their_decoding_configs(tmp_path: Path) -> None:
    ngram = llm_api_args(make_cfg(speculative={"mode": "ngram", "max_draft_len": 5}), tmp_path)
    assert ngram["speculative_config"] == {
        "decoding_type": "NGram",
        "max_draft_len": 5,
        "max_matching_ngram_size": 3,
    }
    assert "speculative_config" not in llm_api_args(make_cfg(), tmp_path)


def test_draft_model_points_at_the_draft_builds_checkpoint(in_tmp_workdir: Path) -> None:
    draft = in_tmp_workdir / "draft.yaml"
    draft.write_text("name: tinydraft\nbackend: trtllm_pytorch\nsource: {kind: local, path: d}\n")
    cfg = make_cfg(speculative={"mode": "draft_model", "max_draft_len": 2, "draft_config": str(draft)})
    args = llm_api_args(cfg, in_tmp_workdir, require_built=False)
    assert args["speculative_config"] == {
        "decoding_type": "DraftTarget",
        "max_draft_len": 2,
        "speculative_model_dir": str(in_tmp_workdir / "build" / "tinydraft" / "engine"),
    }
    draft.write_text("name: tinydraft\nbackend: torch\nsource: {kind: local, path: d}\n")
    with pytest.raises(ConfigError, match="builds backend=torch; the PyTorch backend's draft model is an HF"):
        llm_api_args(cfg, in_tmp_workdir, require_built=False)


def test_a_name_upstream_lacks_fails_when_generated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def misspelt(cfg: BuildConfig) -> dict[str, Any]:
        return {"tokens_per_block": 32, "free_gpu_mem_fraction": 0.9}  # the tensorrtllm_backend spelling

    monkeypatch.setattr(llm_args_module, "_kv_cache_config", misspelt)
    with pytest.raises(ConfigError) as info:
        llm_api_args(make_cfg(), tmp_path)
    assert "kv_cache_config.free_gpu_mem_fraction: KvCacheConfig has no field 'free_gpu_mem_fraction'" in str(
        info.value
    )
    assert "free_gpu_memory_fraction" in str(info.value) and "llm_args.py@48b7b5d" in (info.value.hint or "")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"max_batch_size": 8, "max_batch": 8}, "max_batch: TorchLlmArgs has no field 'max_batch'"),
        ({"scheduler_config": {"capacity_scheduler_policy": "guaranteed_no_evict"}}, "is not a value"),
        ({"kv_cache_config": {"dtype": "int8"}}, "'int8' is not a value KvCacheConfig.dtype takes"),
        (
            {"speculative_config": {"decoding_type": "Ngram"}},
            "speculative_config.decoding_type: 'Ngram' selects",
        ),
        (
            {"speculative_config": {"decoding_type": "NGram", "max_match": 3}},
            "NGramDecodingConfig has no field",
        ),
        ({"cuda_graph_config": True}, "takes a mapping (CudaGraphConfig)"),
    ],
)
def test_the_check_names_the_first_wrong_key(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_mapping(args)


def test_model_yaml_is_the_arguments_plus_triton_config(tmp_path: Path) -> None:
    cfg = make_cfg(serving={"decoupled": False, "streaming": False})
    document = model_yaml(cfg, tmp_path / "ckpt")
    assert document["triton_config"] == {"max_batch_size": 0, "decoupled": False}
    assert document["backend"] == "pytorch"
    assert {k: v for k, v in document.items() if k not in ("triton_config", "backend")} == llm_api_args(
        cfg, tmp_path / "ckpt"
    )
    assert paths(document) - paths(llm_api_args(cfg, tmp_path)) == {
        "backend", "triton_config", "triton_config.max_batch_size", "triton_config.decoupled"
    }  # fmt: skip
    with pytest.raises(ConfigError, match="triton_config.batching: triton_config has no field"):
        check_mapping({**document, "triton_config": {"batching": True}}, "model.yaml")


def test_trtllm_serve_takes_the_same_arguments_less_the_model(tmp_path: Path) -> None:
    cfg = make_cfg(serving={"host": "127.0.0.1", "http_port": 9100})
    options = trtllm_serve_options(cfg, tmp_path)
    assert options == {k: v for k, v in llm_api_args(cfg, tmp_path).items() if k != "model"}
    argv = trtllm_serve_argv(cfg, tmp_path, tmp_path / "o.yaml")
    assert argv == [
        "trtllm-serve", "serve", str(tmp_path), "--backend", "pytorch", "--host", "127.0.0.1", "--port", "9100",
        "--extra_llm_api_options", str(tmp_path / "o.yaml"),
    ]  # fmt: skip


def test_trtllm_serve_options_are_those_of_release_1_1_0() -> None:
    # 1.1.0's trtllm-serve names the YAML file --extra_llm_api_options; it has no --config alias yet.
    with pytest.raises(ConfigError, match="trtllm-serve serve --config: no such option"):
        check_argv(["trtllm-serve", "serve", "m", "--config", "x.yaml"])
    with pytest.raises(ConfigError, match="'tensorrt_llm' is not one of its values"):
        check_argv(["trtllm-serve", "serve", "m", "--backend", "tensorrt_llm"])
