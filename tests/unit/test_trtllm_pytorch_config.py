"""backend: trtllm_pytorch in the build config: what TensorRT-LLM's PyTorch backend takes, and the settings
it cannot take refused at load time with upstream's reason and the list of what it offers."""

from __future__ import annotations

from typing import Any, get_args

import pytest

from pipeline.config.build_config import BuildConfig, SpeculativeSection, build_config_from_dict
from pipeline.config.vocab import (
    BACKEND_KV_DTYPES,
    BACKEND_QUANT_MODES,
    TRTLLM_PYTORCH_REFUSALS,
    TRTLLM_PYTORCH_SPECULATIVE_MODES,
    QuantMode,
)
from pipeline.errors import ConfigError

OFFERED_MODES = "none, int4_awq, w4a8_awq, fp8, nvfp4"


def load(**sections: Any) -> BuildConfig:
    data = {"name": "p", "backend": "trtllm_pytorch", "source": {"kind": "local", "path": "m"}, **sections}
    return build_config_from_dict(data)


@pytest.mark.parametrize("mode", ["none", "int4_awq", "w4a8_awq", "fp8", "nvfp4"])
def test_modes_the_pytorch_backend_loads_are_accepted(mode: str) -> None:
    assert load(quantization={"mode": mode}).quantization.quant_algo == {
        "none": None, "int4_awq": "W4A16_AWQ", "w4a8_awq": "W4A8_AWQ", "fp8": "FP8", "nvfp4": "NVFP4",
    }[mode]  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        ({"quantization": {"mode": "int8_wo"}}, "no INT8 weight-only format"),
        ({"quantization": {"mode": "int4_wo"}}, "loads int4 weights only as AWQ or GPTQ checkpoints"),
        ({"quantization": {"mode": "int8_sq"}}, "no INT8 SmoothQuant (W8A8) format"),
        ({"quantization": {"mode": "int4_gptq"}}, "ModelOpt, which makes no GPTQ checkpoints"),
        ({"quantization": {"mode": "fp8_pc_pt"}}, "llmpipe's ModelOpt step does not make them yet"),
    ],
)
def test_modes_it_cannot_load_are_refused_with_the_reason_and_the_offer(
    setting: dict[str, Any], reason: str
) -> None:
    mode = setting["quantization"]["mode"]
    with pytest.raises(ConfigError) as info:
        load(**setting)
    message = str(info.value)
    assert f"quantization.mode={mode} is not available on backend=trtllm_pytorch: " in message
    assert reason in message and message.endswith(f"choose one of {OFFERED_MODES}")


def test_an_int8_kv_cache_is_refused_naming_the_upstream_gap() -> None:
    with pytest.raises(ConfigError) as info:
        load(quantization={"kv_cache_dtype": "int8"})
    message = str(info.value)
    assert "quantization.kv_cache_dtype=int8 is not available on backend=trtllm_pytorch" in message
    assert "maps only auto and fp8" in message and "github.com/NVIDIA/TensorRT-LLM/issues/3701" in message
    assert message.endswith("choose one of auto, fp8")
    assert load(quantization={"kv_cache_dtype": "fp8"}).quantization.kv_cache_quant_algo == "FP8"


@pytest.mark.parametrize("mode", ["lookahead", "medusa", "eagle"])
def test_speculative_modes_outside_the_pytorch_backend_are_refused(mode: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(speculative={"mode": mode})
    message = str(info.value)
    assert f"speculative.mode={mode} is not available on backend=trtllm_pytorch" in message
    assert message.endswith("choose one of none, draft_model, ngram")


def test_ngram_takes_only_a_longest_match() -> None:
    assert load(speculative={"mode": "ngram", "ngram": {"max_match": 5}}).speculative.ngram.max_match == 5
    with pytest.raises(ConfigError, match="speculative.ngram.min_match=2: .* leave min_match at 1"):
        load(speculative={"mode": "ngram", "ngram": {"min_match": 2}})


@pytest.mark.parametrize(
    ("sections", "field"),
    [
        ({"engine": {"visualize_network": True}}, "engine.visualize_network=true"),
        (
            {"kv_cache": {"use_paged_context_fmha": False, "enable_block_reuse": False}},
            "kv_cache.use_paged_context_fmha=false",
        ),
    ],
)
def test_trtllm_build_switches_are_refused(sections: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"{field} is a trtllm-build setting"):
        load(**sections)


def test_the_engine_route_keeps_what_the_pytorch_backend_refuses() -> None:
    cfg = build_config_from_dict(
        {"name": "e", "backend": "trtllm", "source": {"kind": "local", "path": "m"},
         "quantization": {"mode": "int8_wo", "kv_cache_dtype": "int8"}, "speculative": {"mode": "lookahead"}}
    )  # fmt: skip
    assert cfg.quantization.quant_algo == "W8A16"


def test_every_setting_is_either_offered_or_refused_with_a_reason() -> None:
    for name, values, offered in (
        ("quantization.mode", get_args(QuantMode), BACKEND_QUANT_MODES["trtllm_pytorch"]),
        ("quantization.kv_cache_dtype", ("auto", "int8", "fp8"), BACKEND_KV_DTYPES["trtllm_pytorch"]),
        (
            "speculative.mode",
            get_args(SpeculativeSection.model_fields["mode"].annotation),
            TRTLLM_PYTORCH_SPECULATIVE_MODES,
        ),
    ):
        for value in values:
            assert (value in offered) != (f"{name}={value}" in TRTLLM_PYTORCH_REFUSALS), f"{name}={value}"
