"""SmoothQuant for the torch backend's int8_sq: the smoothing scales, their folds, and the config's rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from pipeline.config.build_config import load_build_config
from pipeline.errors import ConfigError
from pipeline.quantize.awq_search import InputStats
from pipeline.quantize.calibration import HF_INPUT_MODULES
from pipeline.quantize.smoothquant import apply_smoothquant, smoothing_scales
from pipeline.runtime.quant import primitives
from tests.unit.test_awq import assert_rewrite_keeps_logits, stats_of


def outlier_inputs(tokens: int, in_features: int, outliers: list[int], gen: torch.Generator) -> torch.Tensor:
    """Activations with a few channels ~40x the others, as transformer layers' inputs have."""
    x = torch.randn(tokens, in_features, generator=gen)
    x[:, outliers] *= 40.0
    return x


def w8a8_error(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> float:
    """Mean squared output error of a W8A8 layer (int8 weights per row, int8 activations per token) after
    smoothing with `scales` (x / s, W * s), against the float layer."""
    q, s = primitives.quantize_int8_per_channel(weight * scales)
    y = primitives.round_activations_int8(x / scales) @ primitives.dequantize_int8(q, s).T
    return float(((y - x @ weight.T) ** 2).mean())


def test_scales_follow_the_formula_and_alpha() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = outlier_inputs(2500, 32, [3], gen), torch.randn(16, 32, generator=gen)
    stats = stats_of(x)
    assert torch.equal(stats.abs_max, x.abs().amax(0))  # accumulated over 3 chunks like the calibration hooks
    for alpha in (0.0, 0.5, 1.0):
        want = x.abs().amax(0).pow(alpha) / w.abs().amax(0).pow(1 - alpha)
        torch.testing.assert_close(smoothing_scales(w, stats, alpha), want)


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_smoothing_cuts_the_w8a8_error_of_outlier_channels(alpha: float) -> None:
    # One int8 step per token is set by the outlier channels; smoothing moves part of their range into the
    # weight, whose steps are per output row, so the same int8 formats lose much less.
    gen = torch.Generator().manual_seed(1)
    x = outlier_inputs(512, 128, [5, 77], gen)
    w = torch.randn(64, 128, generator=gen) / 128**0.5
    plain = w8a8_error(x, w, torch.ones(128))
    smoothed = w8a8_error(x, w, smoothing_scales(w, stats_of(x), alpha))
    assert smoothed < 0.5 * plain, (smoothed, plain)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # GQA (4 heads, 2 KV); qwen2 adds a qkv bias
def test_smoothing_keeps_the_logits(arch: str, request: pytest.FixtureRequest) -> None:
    """Smoothing alone (before any rounding) computes the same function: every scale is folded into what
    feeds its layer, the dense layer's tied within each KV group."""
    gen = torch.Generator().manual_seed(11)

    def smooth(model: torch.nn.Module, tensors: dict[str, torch.Tensor], pretrained: dict) -> None:
        stats: dict[str, InputStats] = {}
        for name, module in HF_INPUT_MODULES.items():
            in_features = model.model.layers[0].get_submodule(module).in_features
            stats[name] = stats_of(outlier_inputs(64, in_features, [1, in_features // 2], gen))
        block_stats = ((block, stats) for block in range(pretrained["num_hidden_layers"]))
        facts = apply_smoothquant(tensors, pretrained, block_stats, 0.5, progress=False)
        for name in HF_INPUT_MODULES:  # the smoothed inputs' largest channel is closer to the mean one
            assert (
                facts["activation_peak_to_mean_after"][name] < facts["activation_peak_to_mean_before"][name]
            )

    checkpoint: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    assert_rewrite_keeps_logits(checkpoint, smooth, "transformer.layers.0.input_layernorm.weight")


def write_config(tmp_path: Path, backend: str, quantization: dict) -> Path:
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "source": {"kind": "local", "path": str(tmp_path)},
                "backend": backend,
                "quantization": quantization,
            }
        )
    )
    return config


@pytest.mark.parametrize(
    ("backend", "quantization", "message"),
    [
        ("torch", {"mode": "int8_wo", "smoothquant_alpha": 0.7}, "applies to mode=int8_sq on backend=torch"),
        ("trtllm", {"mode": "int8_sq", "smoothquant_alpha": 0.7}, "not mode=int8_sq on backend=trtllm"),
        ("torch", {"mode": "int8_sq", "smoothquant_alpha": 1.5}, "smoothquant_alpha"),
        ("torch", {"mode": "int8_sq", "quantize_lm_head": True}, "quantizes the decoder layers only"),
    ],
    ids=["other-mode", "other-backend", "out-of-range", "lm-head"],
)
def test_config_refuses_what_int8_sq_does_not_do(
    tmp_path: Path, backend: str, quantization: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_build_config(write_config(tmp_path, backend, quantization))


def test_torch_int8_sq_records_per_token_activations(tmp_path: Path) -> None:
    # The torch engine rounds activations per token at run time; ModelOpt's int8_sq export for the engine
    # route is per tensor. Each checkpoint records its own TensorRT-LLM QuantAlgo.
    cfg = load_build_config(write_config(tmp_path, "torch", {"mode": "int8_sq"}))
    assert cfg.quantization.quant_algo_for("torch") == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
    assert cfg.quantization.quant_algo_for("trtllm") == "W8A8_SQ_PER_CHANNEL"
    root = Path(__file__).resolve().parents[2]
    shipped = load_build_config(root / "build_configs" / "smollm2-135m-int8-sq.yaml")
    assert shipped.backend == "torch" and shipped.quantization.mode == "int8_sq"
    assert shipped.quantization.smoothing_alpha == 0.5
