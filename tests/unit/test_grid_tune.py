"""int4 grid tuning (quantization.tune): the trainable grid reproduces the packed format exactly before
training and moves levels only by whole steps; end-to-end tuning lowers the quantized model's distance to
float32 on text it never saw while keeping the levels and format; block-wise tuning moves levels and lowers it
too; a run that would make things worse leaves the grids as they were; and the config allows tuning only where
there are int4 grids to tune."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.backends.torch.build import build
from pipeline.backends.torch.checkpoint import convert
from pipeline.config.build_config import CalibrationSection, load_build_config
from pipeline.errors import ConfigError
from pipeline.quantize.calibration import calibration_samples
from pipeline.quantize.run import quantize
from pipeline.quantize.tune.grid import SEQUENCE_LENGTH, tuning_text
from pipeline.quantize.tune.trainable_grid import TunedGrid
from pipeline.runtime.engine.engine_args import RunnerArgs
from pipeline.runtime.quant import primitives
from pipeline.runtime.worker.model_runner import ModelRunner
from tests.serving_helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CALIBRATION = CalibrationSection(num_samples=8, max_seq_length=128, seed=0)
GROUP = 32


def test_untrained_grid_is_the_packed_weight() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 80, generator=gen)  # 80 columns: a short last group of 16
    qweight, scales, zeros = primitives.quantize_int4_groupwise(weight, GROUP)
    grid = TunedGrid(qweight, scales, zeros, GROUP)
    expected = primitives.dequantize_int4(qweight, scales, zeros, GROUP)
    torch.testing.assert_close(grid.weight(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(grid.weight(slice(2, 5)), expected[2:5], rtol=0, atol=1e-6)
    grid.scale_change.data.fill_(0.5)
    grid.zero_change.data.fill_(1.0)
    torch.testing.assert_close(
        grid.weight(),
        primitives.dequantize_int4(qweight, scales * 1.5, zeros + 1.0, GROUP),
        rtol=0,
        atol=1e-6,
    )


def test_free_levels_move_by_whole_steps_and_pack() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(4, 64, generator=gen)
    qweight, scales, zeros = primitives.quantize_int4_groupwise(weight, GROUP)
    levels = primitives.unpack_int4(qweight)
    grid = TunedGrid(qweight, scales, zeros, GROUP)
    grid.free_levels()
    assert grid.level_change is not None
    with torch.no_grad():
        grid.level_change[0, 0, :3] = torch.tensor([0.4, 0.6, -0.7])
    moved = levels.clone().to(torch.int16)
    moved[0, 1] += 1
    moved[0, 2] -= 1
    moved = moved.clamp(0, 15).to(torch.uint8)
    expected = primitives.dequantize_int4(primitives.pack_int4(moved), scales, zeros, GROUP)
    torch.testing.assert_close(grid.weight(), expected, rtol=0, atol=1e-6)
    grid.weight().sum().backward()  # straight-through: the offsets get the weights' gradient
    assert grid.level_change.grad is not None and grid.level_change.grad.abs().sum() > 0
    grid.fix_levels(keep=True)
    assert grid.level_change is None
    assert torch.equal(grid.qweight(), primitives.pack_int4(moved))
    grid.free_levels()
    with torch.no_grad():
        grid.level_change.fill_(0.9)
    grid.fix_levels(keep=False)
    assert torch.equal(grid.qweight(), primitives.pack_int4(moved))


def quantized(hf_dir: Path, root: Path, **tune: object) -> tuple[Path, dict]:
    cfg = tiny_config(
        hf_dir,
        quantization={
            "mode": "int4_wo",
            "group_size": GROUP,
            "calibration": CALIBRATION.model_dump(),
            "tune": {"generated_samples": 16, **tune},
        },
    )
    convert(cfg, hf_dir, root / "checkpoint")
    facts = quantize(cfg, root / "checkpoint", root / "quantized", hf_dir=hf_dir)
    build(cfg, root / "quantized", root / "engine")
    return root / "engine", facts


def kl_to_float32(hf_dir: Path, engine_dir: Path) -> float:
    """Mean KL of the engine's next-token distributions from HF float32's on a calibration draw no tuning saw."""
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ids = calibration_samples(tokenizer, CALIBRATION.model_copy(update={"seed": 99}))[0]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    runner = ModelRunner.from_engine_dir(engine_dir, RunnerArgs(device="cpu"))
    logits = runner.score(ids, list(range(-(-len(ids) // runner.tokens_per_block))))
    engine = torch.log_softmax(logits.float(), -1)
    return float((reference.exp() * (reference - engine)).sum(-1).mean())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases ride along with the fused rows
def test_tuning_brings_the_engine_closer_to_float32_on_unseen_text(
    arch: str, tiny_llama_dir: Path, tiny_qwen2_dir: Path, tmp_path: Path
) -> None:
    hf_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    plain_dir, _ = quantized(hf_dir, tmp_path / "plain")
    tuned_dir, facts = quantized(hf_dir, tmp_path / "tuned", steps=40, learning_rate=3e-3)
    tune = facts["tune"]
    assert tune["kept"] and tune["held_out_kl_after"] < tune["held_out_kl_before"]
    assert tune["tuning_text_tokens"] >= 100 * SEQUENCE_LENGTH  # the shipped prose by default

    plain, tuned = (load_file(str(d / "rank0.safetensors")) for d in (plain_dir, tuned_dir))
    key = "transformer.layers.0.attention.qkv"
    assert torch.equal(plain[f"{key}.qweight"], tuned[f"{key}.qweight"])  # levels fixed
    assert not torch.equal(plain[f"{key}.scales"], tuned[f"{key}.scales"])
    assert (tuned[f"{key}.scales"] > 0).all()

    assert kl_to_float32(hf_dir, tuned_dir) < kl_to_float32(hf_dir, plain_dir)


def test_block_tuning_moves_levels_by_one_and_lowers_the_held_out_error(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    plain_dir, _ = quantized(tiny_llama_dir, tmp_path / "plain", generated_samples=64)
    # 64 sampled sequences: with the default 16, the tiny model's levels fit the tuning text, not the model
    tuned_dir, facts = quantized(tiny_llama_dir, tmp_path / "tuned", block_steps=100, generated_samples=64)
    tune, blocks = facts["tune"], facts["tune"]["blocks"]
    assert tune["kept"] and tune["held_out_kl_after"] < tune["held_out_kl_before"]
    assert blocks["blocks_kept"] >= 1 and blocks["levels_moved"] > 0
    assert blocks["held_out_block_mse_after"] < blocks["held_out_block_mse_before"]
    plain, tuned = (load_file(str(d / "rank0.safetensors")) for d in (plain_dir, tuned_dir))
    changed = [k for k in plain if k.endswith(".qweight") and not torch.equal(plain[k], tuned[k])]
    assert changed
    for key in changed:  # no level moved by more than one
        before, after = (primitives.unpack_int4(t[key]).to(torch.int16) for t in (plain, tuned))
        assert int((after - before).abs().max()) == 1


def test_a_run_that_does_not_help_leaves_the_grids_alone(tiny_llama_dir: Path, tmp_path: Path) -> None:
    plain_dir, _ = quantized(tiny_llama_dir, tmp_path / "plain")
    # relative scale steps of 50x: the grids leave any useful range within a step
    tuned_dir, facts = quantized(tiny_llama_dir, tmp_path / "tuned", steps=3, learning_rate=50.0)
    assert facts["tune"]["kept"] is False
    plain, tuned = (load_file(str(d / "rank0.safetensors")) for d in (plain_dir, tuned_dir))
    assert all(torch.equal(plain[k], tuned[k]) for k in plain)


def test_tuning_text_is_one_stream_of_its_records(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)

    def ids(text: str) -> list[int]:
        return list(tokenizer(text)["input_ids"])

    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "The first record."}\n{"text": "The second one."}\n')
    separator = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    assert tuning_text(tokenizer, str(path)) == ids("The first record.") + separator + ids("The second one.")
    with pytest.raises(ConfigError, match=r"quantization.tune.dataset='missing.txt': .* is not a file"):
        tuning_text(tokenizer, "missing.txt")
    # the shipped prose outweighs the default calibration draw (32 records cut to 512 tokens) several times over
    assert len(tuning_text(tokenizer, "builtin")) >= 100 * SEQUENCE_LENGTH


def test_tuning_is_for_torch_int4_modes(tmp_path: Path) -> None:
    def config(backend: str, mode: str, **tune: object) -> Path:
        path = tmp_path / "c.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "source": {"kind": "local", "path": str(tmp_path)},
                    "backend": backend,
                    "quantization": {"mode": mode, "tune": {"steps": 10, **tune}},
                }
            )
        )
        return path

    assert load_build_config(config("torch", "int4_awq")).quantization.tune.steps == 10
    assert load_build_config(config("torch", "int4_awq", dataset=None)).quantization.tune.dataset is None
    with pytest.raises(ConfigError, match=r"quantization.tune.steps=10 .* not mode=int8_wo on backend=torch"):
        load_build_config(config("torch", "int8_wo"))
    with pytest.raises(ConfigError, match=r"not mode=int4_awq on backend=trtllm"):
        load_build_config(config("trtllm", "int4_awq"))
