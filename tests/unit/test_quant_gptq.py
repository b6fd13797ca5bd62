"""GPTQ int4 (int4_gptq): error-feedback rounding lowers every layer's output error on calibration inputs
below round-to-nearest's while keeping the int4 format, the calibration walk can feed later blocks the
quantized earlier ones, the engine loads and generates through the normal runtime, and the config keeps
the mode on the torch backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.backends.torch.build import build
from pipeline.backends.torch.checkpoint import convert
from pipeline.cli.main import cli
from pipeline.config.build_config import CalibrationSection, load_build_config
from pipeline.errors import ConfigError
from pipeline.quantize.awq_search import InputStats, WeightFormat, output_error, search_clip
from pipeline.quantize.calibration import (
    BUILTIN_CALIBRATION,
    BUILTIN_DATASETS,
    HF_INPUT_MODULES,
    TUNING_TEXT_FIELD,
    calibration_samples,
    layer_input_stats,
)
from pipeline.quantize.gptq_solver import (
    damped_hessian,
    gptq_int4,
    gptq_levels,
    inverse_hessian_factor,
    refit_grid,
)
from pipeline.quantize.run import LAYER_LINEARS, data_files, quantize
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.engine_args import RunnerArgs
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.quant import primitives
from pipeline.runtime.quant.linear import QuantLinear
from pipeline.runtime.worker.model_runner import ModelRunner
from tests.serving_helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = CalibrationSection(num_samples=8, max_seq_length=128, seed=0)
GROUP = 32  # the tiny model's layers are 64 or 128 columns wide


def correlated_inputs(n: int, in_f: int, seed: int = 0) -> torch.Tensor:
    """Inputs with a few dominant directions and outlier channels, like a transformer's activations."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen) @ torch.randn(8, in_f, generator=gen)
    x += 0.3 * torch.randn(n, in_f, generator=gen)
    x[:, :4] *= 10.0
    return x


@pytest.mark.parametrize(("group_size", "in_f"), [(32, 96), (64, 130), (128, 576)])
def test_gptq_writes_the_int4_format(group_size: int, in_f: int) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(24, in_f, generator=gen) * 0.05
    x = correlated_inputs(2048, in_f)
    packed, scales, zeros = gptq_int4(weight, x.T @ x / len(x), group_size)
    # the runtime's own layer reads the tensors as they are (shapes, dtypes, short last group)
    layer = QuantLinear("int4", {"qweight": packed, "scales": scales, "zeros": zeros}, group_size)
    restored = layer.dequantize()
    assert torch.equal(restored, primitives.dequantize_int4(packed, scales, zeros, group_size))
    rtn = WeightFormat("int4", group_size).round_trip(weight)
    assert not torch.equal(restored, rtn)  # the levels moved
    moment = x.T @ x / len(x)
    assert output_error(restored - weight, moment) < 0.5 * output_error(rtn - weight, moment)


def test_gptq_is_round_to_nearest_on_its_grid_when_inputs_are_uncorrelated() -> None:
    # H = I: no column's rounding error can be cancelled by another's, so nothing moves and every weight
    # takes the level nearest to it on the grid it is given.
    weight = torch.randn(16, 192, generator=torch.Generator().manual_seed(2))
    identity = torch.eye(192)
    clipped = search_clip(weight, identity, WeightFormat("int4", 64))
    want_packed, scales, zeros = primitives.quantize_int4_groupwise(clipped, 64)
    order = torch.randperm(192, generator=torch.Generator().manual_seed(2))
    levels = gptq_levels(weight, inverse_hessian_factor(damped_hessian(identity)), order, 64, scales, zeros)
    assert torch.equal(primitives.pack_int4(levels), want_packed)
    # ... and the refitted grids GPTQ ends on decode closer to the weight than that first grid
    fitted = primitives.dequantize_int4(*gptq_int4(weight, identity, 64), 64)
    on_grid = primitives.dequantize_int4(want_packed, scales, zeros, 64)
    assert output_error(fitted - weight, identity) < output_error(on_grid - weight, identity)


def hessian_error(weight: torch.Tensor, decoded: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """[out]: each row's (w - w')^T H (w - w')."""
    delta = (decoded - weight).to(torch.float64)
    return ((delta @ hessian.to(torch.float64)) * delta).sum(1)


@pytest.mark.parametrize(("group_size", "in_f"), [(32, 96), (128, 576)])
def test_refit_never_raises_a_rows_error_over_the_grid_it_starts_from(group_size: int, in_f: int) -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(40, in_f, generator=gen) * 0.05
    x = correlated_inputs(4096, in_f, seed=4)
    hessian = damped_hessian(x.T @ x / len(x))
    packed, scales, zeros = primitives.quantize_int4_groupwise(weight, group_size)
    levels = primitives.unpack_int4(packed)
    fitted_scales, fitted_zeros = refit_grid(weight, hessian, levels, group_size, scales, zeros)
    before = hessian_error(weight, primitives.dequantize_int4(packed, scales, zeros, group_size), hessian)
    after = hessian_error(
        weight, primitives.dequantize_int4(packed, fitted_scales, fitted_zeros, group_size), hessian
    )
    assert (after <= before).all()
    assert after.sum() < 0.9 * before.sum()


def test_refit_recovers_the_affine_map_that_generated_the_weight() -> None:
    # weights exactly a_g * q + b_g on the levels: the least-squares fit is exact, whatever H weighs it by
    gen = torch.Generator().manual_seed(5)
    levels = torch.randint(0, 16, (6, 96), generator=gen, dtype=torch.uint8)
    scales = torch.rand(6, 3, generator=gen) + 0.1
    zeros = torch.rand(6, 3, generator=gen) * 15
    weight = primitives.dequantize_int4(primitives.pack_int4(levels), scales, zeros, 32)
    x = correlated_inputs(1024, 96, seed=5)
    start_scales, start_zeros = scales * 1.3, zeros - 2.0
    got_scales, got_zeros = refit_grid(
        weight, damped_hessian(x.T @ x / len(x)), levels, 32, start_scales, start_zeros
    )
    torch.testing.assert_close(got_scales, scales, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got_zeros, zeros, rtol=1e-4, atol=1e-4)


def test_refit_stays_finite_when_a_group_has_a_single_level() -> None:
    # a group whose levels are all equal leaves its (a, b) pair without a unique fit (a singular system):
    # the row must still come out with usable scales and zero points
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(4, 64, generator=gen)
    packed, scales, zeros = primitives.quantize_int4_groupwise(weight, 32)
    levels = primitives.unpack_int4(packed)
    levels[0, :32] = 7
    got_scales, got_zeros = refit_grid(weight, damped_hessian(torch.eye(64)), levels, 32, scales, zeros)
    assert torch.isfinite(got_scales).all() and torch.isfinite(got_zeros).all()
    assert (got_scales > 0).all()


def test_channels_that_never_fire_neither_take_nor_give_error() -> None:
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    x = correlated_inputs(512, 64)
    x[:, 10] = 0.0  # H[10, :] = H[:, 10] = 0: without a fix-up its Cholesky would fail
    moment = x.T @ x / len(x)
    _, scales, zeros = gptq_int4(weight, moment, 32)
    assert torch.isfinite(scales).all() and torch.isfinite(zeros).all()
    clipped = search_clip(weight, moment, WeightFormat("int4", 32))
    packed, scales, zeros = primitives.quantize_int4_groupwise(clipped, 32)
    nearest = primitives.unpack_int4(packed)
    order = torch.argsort(moment.diagonal(), descending=True, stable=True)
    u = inverse_hessian_factor(damped_hessian(moment)[order][:, order])
    levels = gptq_levels(weight, u, order, 32, scales, zeros)
    assert torch.equal(levels[:, 10], nearest[:, 10])
    assert not torch.equal(levels, nearest)


def runtime_block_weights(hf_dir: Path) -> dict[tuple[int, str], torch.Tensor]:
    """(block, runtime linear name) -> the float weight, fused the way the runtime stores it."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    parts = {
        "attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "attention.dense": ("self_attn.o_proj",),
        "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.proj": ("mlp.down_proj",),
    }
    return {
        (i, name): torch.cat([block.get_submodule(m).weight.detach() for m in modules])
        for i, block in enumerate(model.model.layers)
        for name, modules in parts.items()
    }


def test_gptq_lowers_every_layers_output_error_on_calibration_inputs(tiny_llama_dir: Path) -> None:
    weights = runtime_block_weights(tiny_llama_dir)
    fmt = WeightFormat("int4", GROUP)
    ratios = {}
    for block, stats in layer_input_stats(tiny_llama_dir, CALIBRATION)[1]:
        for name in LAYER_LINEARS:
            weight, moment = weights[block, name], stats[name].second_moment
            gptq = primitives.dequantize_int4(*gptq_int4(weight, moment, GROUP), GROUP)
            ratios[block, name] = output_error(gptq - weight, moment) / output_error(
                fmt.round_trip(weight) - weight, moment
            )
    assert len(ratios) == 2 * len(LAYER_LINEARS)
    # measured: 0.48 to 0.86, mean 0.70
    assert max(ratios.values()) < 0.95, ratios
    assert sum(ratios.values()) / len(ratios) < 0.8, ratios


def test_walk_with_quantized_blocks_sees_what_the_model_with_those_weights_feeds(
    tiny_llama_dir: Path,
) -> None:
    # Block 0 "quantized" to a visibly different function: its output projections halved.
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    block0 = model.model.layers[0]
    halved = {
        "attention.dense.weight": block0.self_attn.o_proj.weight.detach() * 0.5,
        "mlp.proj.weight": block0.mlp.down_proj.weight.detach() * 0.5,
    }
    config = CalibrationSection(num_samples=3, max_seq_length=64, seed=0)
    calls = []

    def quantized_block(index: int) -> dict[str, torch.Tensor]:
        calls.append(index)
        return halved if index == 0 else {}

    walked = dict(layer_input_stats(tiny_llama_dir, config, quantized_block=quantized_block)[1])
    assert calls == [0]  # the last block's outputs feed nothing
    plain = dict(layer_input_stats(tiny_llama_dir, config)[1])
    with torch.no_grad():
        block0.self_attn.o_proj.weight.mul_(0.5)
        block0.mlp.down_proj.weight.mul_(0.5)
    direct = {name: InputStats(block0.get_submodule(m).in_features) for name, m in HF_INPUT_MODULES.items()}
    for name, stats in direct.items():
        model.model.layers[1].get_submodule(HF_INPUT_MODULES[name]).register_forward_pre_hook(
            lambda m, args, s=stats: s.add(args[0])
        )
    with torch.no_grad():
        for ids in calibration_samples(AutoTokenizer.from_pretrained(tiny_llama_dir), config):
            model(input_ids=torch.tensor([ids]))
    for name, stats in direct.items():
        assert torch.allclose(walked[0][name].gram, plain[0][name].gram)  # block 0 itself is unchanged
        assert torch.allclose(walked[1][name].gram, stats.gram, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(plain[1][name].gram, stats.gram, rtol=1e-2)


def quantized_engine(hf_dir: Path, root: Path, mode: str) -> tuple[Path, dict]:
    """convert -> quantize -> build of the torch backend; (engine dir, quantize facts)."""
    cfg = tiny_config(
        hf_dir, quantization={"mode": mode, "group_size": GROUP, "calibration": CALIBRATION.model_dump()}
    )
    convert(cfg, hf_dir, root / "checkpoint")
    facts = quantize(cfg, root / "checkpoint", root / "quantized", hf_dir=hf_dir)
    build(cfg, root / "quantized", root / "engine")
    return root / "engine", facts


def test_int4_gptq_engine_runs_and_tracks_the_reference_closer_than_rtn(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    engine_dir, facts = quantized_engine(tiny_llama_dir, tmp_path / "gptq", "int4_gptq")
    pretrained = json.loads((engine_dir / "config.json").read_text())["pretrained_config"]
    assert pretrained["quantization"]["quant_algo"] == "W4A16_GPTQ"
    assert pretrained["quantization"]["group_size"] == GROUP
    assert facts["gptq"]["calibration"]["tokens"] > 500
    assert all(ratio < 1.0 for ratio in facts["gptq"]["error_vs_round_to_nearest"].values())
    stored = load_file(str(engine_dir / "rank0.safetensors"))
    assert stored["transformer.layers.0.mlp.proj.qweight"].dtype == torch.uint8

    engine = LLMEngine.from_engine_dir(engine_dir)
    (request,) = engine.generate([[1, 5, 9, 22, 40]], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(request.output_token_ids) == 8

    # Teacher-forced logits on text outside the calibration draw: closer to fp32 than round-to-nearest's.
    rtn_dir, _ = quantized_engine(tiny_llama_dir, tmp_path / "rtn", "int4_wo")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = calibration_samples(tokenizer, CALIBRATION.model_copy(update={"seed": 99}))[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0]

    def logit_error(folder: Path) -> float:
        runner = ModelRunner.from_engine_dir(folder, RunnerArgs(device="cpu"))
        logits = runner.score(ids, list(range(-(-len(ids) // runner.tokens_per_block))))
        return float(((logits - reference) ** 2).mean())

    assert logit_error(engine_dir) < logit_error(rtn_dir)


def write_config(folder: Path, backend: str, **quantization: object) -> Path:
    path = folder / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "source": {"kind": "local", "path": str(folder)},
                "backend": backend,
                "quantization": {"mode": "int4_gptq", **quantization},
            }
        )
    )
    return path


def test_int4_gptq_is_a_torch_mode(tmp_path: Path) -> None:
    cfg = load_build_config(ROOT / "build_configs" / "smollm2-135m-int4-gptq.yaml")
    assert cfg.backend == "torch" and cfg.quantization.mode == "int4_gptq"
    assert cfg.quantization.quant_algo == "W4A16_GPTQ" and cfg.quantization.group_size == 128
    # editing either text redoes quantize
    assert data_files(cfg) == {
        "calibration": BUILTIN_CALIBRATION,
        "tuning_text": BUILTIN_DATASETS[TUNING_TEXT_FIELD],
    }
    with pytest.raises(ConfigError, match="quantization.mode=int4_gptq is not available on backend=trtllm"):
        load_build_config(write_config(tmp_path, "trtllm"))
    with pytest.raises(ConfigError, match="quantization.group_size=96 for mode=int4_gptq"):
        load_build_config(write_config(tmp_path, "torch", group_size=96))
    with pytest.raises(ConfigError, match="use mode=int4_awq or int4_gptq"):  # it always is activation-aware
        load_build_config(write_config(tmp_path, "torch", activation_aware=True))


@pytest.mark.slow
def test_smollm2_int4_gptq_passes_its_gates(smollm2_hf_dir: Path, tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "build_configs" / "smollm2-135m-int4-gptq.yaml").read_text())
    data["source"] = {"kind": "local", "path": str(smollm2_hf_dir)}
    data["workdir"] = str(tmp_path / "build")
    config = tmp_path / "gptq.yaml"
    config.write_text(yaml.safe_dump(data))
    runner = CliRunner()
    built = runner.invoke(cli, ["build", str(config), "--until", "engine"])
    assert built.exit_code == 0, built.output
    validated = runner.invoke(cli, ["validate", str(config)])
    report = json.loads((tmp_path / "build" / "validation" / "validation.json").read_text())
    assert report["profile"] == "int4_gptq"
    assert validated.exit_code == 0, validated.output
    # the int4 group-128 target, set in the config over the mode's looser regression gate
    assert {row["metric"]: row for row in report["gates"]}["ppl_delta_pct"]["threshold"] == 8.0
