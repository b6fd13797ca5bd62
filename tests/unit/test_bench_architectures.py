"""scripts/bench_architectures.py's arguments and table, and the shared benchmark shape of
pipeline/bench/architectures.py (no timing)."""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path
from typing import Any

import pytest

from pipeline.bench.architectures import DEFAULT_SHAPE, bench_hf_config, bench_tokenizer
from pipeline.errors import ConfigError
from pipeline.sources.tiny import ARCHITECTURES

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_architectures.py"


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the script sets it when absent; keep the test's env
    return runpy.run_path(str(SCRIPT))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return bench_tokenizer()


def test_defaults_measure_every_architecture_llama_first(script: dict[str, Any]) -> None:
    args = script["parse_args"]([])
    assert args.archs == list(ARCHITECTURES) and args.archs[0] == "llama"
    assert (args.new_tokens, args.concurrency, args.real, args.out) == (128, 16, False, None)


def test_llama_is_always_measured_once(script: dict[str, Any]) -> None:
    args = script["parse_args"](["--archs", "gemma3, qwen3-moe,llama", "--out", "results"])
    assert args.archs == ["llama", "gemma3", "qwen3-moe"]
    assert args.out == Path("results")


@pytest.mark.parametrize("argv", [["--archs", "llama,gpt2"], ["--rounds", "0"], ["--new-tokens", "0"]])
def test_bad_arguments_are_refused(script: dict[str, Any], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        script["parse_args"](argv)
    assert exc.value.code == 2


def _result(
    model: str, single: float, concurrent: float, tiny: bool = True, fused: str = "yes"
) -> dict[str, Any]:
    return {
        "model": model,
        "architecture": "X",
        "params": "1M",
        "fused": fused,
        "tiny": tiny,
        "single_tok_s": 2 * single,
        "single_cpu_tok_s": single,
        "concurrent_tok_s": 2 * concurrent,
        "concurrent_cpu_tok_s": concurrent,
        "load": 1.0,
    }


def test_ratios_are_to_the_tiny_llamas_cpu_second_rates(script: dict[str, Any]) -> None:
    rows = script["table_rows"](
        [
            _result("llama", 400.0, 1600.0),
            _result("qwen3-moe", 100.0, 800.0, fused="no"),
            _result("SmolLM2-135M", 40.0, 250.0, tiny=False),
        ]
    )
    assert [(r["single_ratio"], r["concurrent_ratio"]) for r in rows] == [
        ("1.00", "1.00"),
        ("0.25", "0.50"),
        ("-", "-"),
    ]
    assert script["slow_families"](rows) == [
        "- qwen3-moe (off the fused decode path): 1 request 0.25x, 16 concurrent 0.50x of llama's"
    ]


def test_markdown_page_has_the_machine_line_and_one_row_per_model(script: dict[str, Any]) -> None:
    rows = script["table_rows"]([_result("llama", 400.0, 1600.0), _result("gemma2", 380.0, 1500.0)])
    args = argparse.Namespace(prompt_len=64, new_tokens=128, rounds=3, single_repeats=3)
    page = script["markdown_page"]("python scripts/bench_architectures.py", rows, ["a note."], args, "avx2")
    lines = page.splitlines()
    assert lines[0] == "# Decode speed per architecture"
    assert any(line.startswith("Machine: ") and "kernels avx2" in line for line in lines)
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 3 and table[1].startswith(
        "| llama | X | 1M | yes | 800.0 | 400.0 | 1.00 | 3200.0 | 1600.0 | 1.00 |"
    )
    assert "Under 0.8x" not in page and lines[-1] == "a note."


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_family_gets_the_shared_shape(arch: str, tokenizer: Any) -> None:
    config = bench_hf_config(arch, tokenizer)
    shape = DEFAULT_SHAPE
    assert (config.hidden_size, config.num_hidden_layers) == (shape.hidden_size, shape.num_hidden_layers)
    assert getattr(config, "head_dim", None) in (None, shape.head_dim)
    assert (
        len(getattr(config, "layer_types", None) or [None] * shape.num_hidden_layers)
        == shape.num_hidden_layers
    )
    experts_per_token = getattr(config, "num_experts_per_tok", None)
    if experts_per_token:  # MoE: as many active MLP channels as the dense models have
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        assert width * experts_per_token == shape.intermediate_size
    else:
        assert config.intermediate_size == shape.intermediate_size


def test_longrope_factors_follow_the_rotary_width(tokenizer: Any) -> None:
    rope = bench_hf_config("phi3", tokenizer).rope_parameters
    rotary = int(DEFAULT_SHAPE.head_dim * rope["partial_rotary_factor"])
    assert len(rope["short_factor"]) == len(rope["long_factor"]) == rotary // 2


def test_unknown_architecture(tokenizer: Any) -> None:
    with pytest.raises(ConfigError):
        bench_hf_config("gpt2", tokenizer)
