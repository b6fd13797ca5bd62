"""Activation-aware int4 (AWQ): the scale and clip searches lower the output error, folding the scales
keeps the model's function, and calibration reads the shipped set and the model's real block inputs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.architectures.hf_config import pretrained_config_from_hf
from pipeline.architectures.weight_map import LAYER_WEIGHTS, QKV_BIAS_WEIGHTS
from pipeline.backends.torch.checkpoint import runtime_weights
from pipeline.config.build_config import CalibrationSection, load_build_config
from pipeline.errors import ConfigError
from pipeline.quantize.awq import apply_activation_aware_scales, fold_into_producers
from pipeline.quantize.awq_search import (
    InputStats,
    ScaleSearch,
    WeightFormat,
    output_error,
    search_clip,
    search_scales,
)
from pipeline.quantize.blocks import Shape
from pipeline.quantize.calibration import (
    BUILTIN_DATASETS,
    HF_INPUT_MODULES,
    calibration_samples,
    layer_input_stats,
    load_records,
)
from pipeline.validate.data import BUILTIN_DIR

INT4_G64 = WeightFormat("int4", 64)


def outlier_layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A [96, 256] weight and 4096 inputs whose channels 0..7 are ~30x larger than the rest: the case AWQ
    is built for (a few input channels carry most of the output)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(96, 256, generator=gen) * 0.05
    x = torch.randn(4096, 256, generator=gen)
    x[:, :8] *= 30.0
    return weight, x


def stats_of(x: torch.Tensor) -> InputStats:
    stats = InputStats(x.shape[1])
    for chunk in x.split(1000):  # accumulates across calls like the calibration hooks do
        stats.add(chunk)
    return stats


def true_error(quantized: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x @ quantized.T - x @ weight.T) ** 2).sum(1).mean())


def test_output_error_is_the_mean_squared_output_difference() -> None:
    weight, x = outlier_layer()
    delta = INT4_G64.round_trip(weight) - weight
    stats = stats_of(x)
    assert output_error(delta, stats.second_moment) == pytest.approx(
        true_error(weight + delta, weight, x), rel=1e-4
    )
    assert torch.allclose(stats.mean_abs, x.abs().mean(0), rtol=1e-5)


@pytest.mark.parametrize("fmt", [INT4_G64, WeightFormat("int4", 128), WeightFormat("int8")])
def test_scale_search_protects_outlier_channels(fmt: WeightFormat) -> None:
    weight, x = outlier_layer()
    found = search_scales(weight, stats_of(x), fmt)
    plain = true_error(fmt.round_trip(weight), weight, x)
    scaled = true_error(fmt.round_trip(weight * found.scales) / found.scales, weight, x)
    assert found.alpha > 0
    assert found.plain_error == pytest.approx(plain, rel=1e-3)
    assert found.error == pytest.approx(scaled, rel=1e-3)
    # the outlier channels get the largest scales, and the output error drops well below plain rounding
    assert found.scales[:8].min() > found.scales[8:].max()
    assert scaled < 0.5 * plain


def test_scale_search_falls_back_to_plain_rounding_when_scaling_cannot_help() -> None:
    # Weights already on a 16-level grid per group of 64: plain rounding is exact, any scale only adds error.
    gen = torch.Generator().manual_seed(2)
    levels = torch.randint(0, 16, (32, 128), generator=gen).float()
    levels[:, ::64], levels[:, 1::64] = 0, 15
    weight = -0.3 + 0.04 * levels
    x = torch.randn(512, 128, generator=gen) * torch.linspace(0.1, 10, 128)
    found = search_scales(weight, stats_of(x), INT4_G64)
    assert found.alpha == 0 and torch.allclose(found.scales, torch.ones(128))
    assert found.error == found.plain_error < 1e-8


def test_tied_scales_are_shared_by_the_tied_channels() -> None:
    weight, x = outlier_layer()
    shape = Shape(heads=4, kv_heads=2, head_dim=64, intermediate=0)  # 256 = 4 heads x 64
    found = search_scales(weight, stats_of(x), INT4_G64, tie=shape.tie_heads)
    grouped = shape.per_kv_column(found.scales)
    assert torch.equal(grouped, grouped[:, :1].expand_as(grouped))


def test_clip_search_trades_rare_channels_for_a_finer_grid() -> None:
    # One column per group holds large weights but sees almost no input: clipping it costs little output
    # error and shrinks the group's step for the 63 columns that matter.
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(64, 256, generator=gen) * 0.02
    weight[:, 5::64] *= 10.0
    x = torch.randn(2048, 256, generator=gen)
    x[:, 5::64] *= 0.01
    stats = stats_of(x)
    clipped = search_clip(weight, stats.second_moment, INT4_G64)
    plain = true_error(INT4_G64.round_trip(weight), weight, x)
    assert true_error(INT4_G64.round_trip(clipped), weight, x) < 0.5 * plain
    assert torch.all(clipped.abs() <= weight.abs())  # clipping only ever shrinks values


# --- folding -----------------------------------------------------------------------------------------


def to_runtime(model: torch.nn.Module, checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict]:
    hf_config = json.loads((checkpoint / "config.json").read_text())
    pretrained = pretrained_config_from_hf(hf_config, "float32")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return runtime_weights(state, pretrained), pretrained


def fold_block_scales(
    tensors: dict[str, torch.Tensor], block: int, scales: dict[str, torch.Tensor], shape: Shape
) -> None:
    """Multiply each linear layer's input columns by `scales[name]` (W[:, c] *= s[c]) and divide what feeds
    them by the same, in place: the block computes the same function (up to float rounding)."""
    for name, s in scales.items():
        key = f"transformer.layers.{block}.{name}.weight"
        tensors[key] = (tensors[key].to(torch.float32) * s).to(tensors[key].dtype)
    fold_into_producers(tensors, block, scales, shape)


def load_runtime(model: torch.nn.Module, tensors: dict[str, torch.Tensor], pretrained: dict) -> None:
    """The inverse of convert's layout for the block tensors: split the fused ones back into HF's."""
    state = model.state_dict()
    table = {**LAYER_WEIGHTS, **(QKV_BIAS_WEIGHTS if pretrained["qkv_bias"] else {})}
    for i in range(pretrained["num_hidden_layers"]):
        for runtime, sources in table.items():
            names = [f"model.layers.{i}.{s}" for s in sources]
            parts = tensors[f"transformer.layers.{i}.{runtime}"].split([state[n].shape[0] for n in names])
            for name, part in zip(names, parts, strict=True):
                state[name] = part
    model.load_state_dict(state)


Rewrite = Callable[[torch.nn.Module, dict[str, torch.Tensor], dict], None]


def assert_rewrite_keeps_logits(checkpoint: Path, rewrite: Rewrite, changed: str) -> None:
    """`rewrite(model, tensors, pretrained)` edits the runtime-layout tensors of `checkpoint`'s model in place:
    tensor `changed` must differ afterwards, and the model loaded with the result give the same logits (to float
    rounding)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 17, 400, 33, 1200, 5, 9, 77, 801, 3]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    tensors, pretrained = to_runtime(model, checkpoint)
    rewrite(model, tensors, pretrained)
    reference = to_runtime(model, checkpoint)[0]
    assert not torch.allclose(tensors[changed], reference[changed])
    load_runtime(model, tensors, pretrained)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert (after - before).abs().max() <= 1e-5 * before.abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # GQA (4 heads, 2 KV); qwen2 adds a qkv bias
def test_folded_scales_keep_the_logits(arch: str, request: pytest.FixtureRequest) -> None:
    gen = torch.Generator().manual_seed(7)

    def scales(n: int) -> torch.Tensor:
        return torch.exp(torch.randn(n, generator=gen))  # 0.1x .. 10x: a fold error would show

    def fold(model: torch.nn.Module, tensors: dict[str, torch.Tensor], pretrained: dict) -> None:
        shape = Shape.of(pretrained)
        for block in range(pretrained["num_hidden_layers"]):
            fold_block_scales(
                tensors,
                block,
                {
                    "attention.qkv": scales(pretrained["hidden_size"]),
                    "attention.dense": shape.tie_heads(scales(shape.heads * shape.head_dim)),
                    "mlp.gate_up": scales(pretrained["hidden_size"]),
                    "mlp.proj": scales(shape.intermediate),
                },
                shape,
            )

    checkpoint: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    assert_rewrite_keeps_logits(checkpoint, fold, "transformer.layers.0.attention.qkv.weight")


def test_activation_aware_scaling_without_clipping_keeps_the_logits(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """apply_activation_aware_scales' own scale-and-fold path, with the searches replaced: random scales
    (tied the way the search is told to tie them) and no clipping, the one step that changes the function."""
    gen = torch.Generator().manual_seed(11)

    def random_scales(
        weight: torch.Tensor,
        stats: InputStats,
        fmt: WeightFormat,
        *,
        tie: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> ScaleSearch:
        scales = torch.exp(torch.randn(weight.shape[1], generator=gen))
        return ScaleSearch(scales if tie is None else tie(scales), 0.5, 1.0, 1.0)

    monkeypatch.setattr("pipeline.quantize.awq.search_scales", random_scales)
    monkeypatch.setattr("pipeline.quantize.awq.search_clip", lambda weight, moment, fmt: weight)

    def scale(model: torch.nn.Module, tensors: dict[str, torch.Tensor], pretrained: dict) -> None:
        stats: dict[str, InputStats] = {}
        for name, module in HF_INPUT_MODULES.items():
            in_features = model.model.layers[0].get_submodule(module).in_features
            stats[name] = stats_of(torch.randn(64, in_features, generator=gen))
        block_stats = ((block, stats) for block in range(pretrained["num_hidden_layers"]))
        facts = apply_activation_aware_scales(tensors, pretrained, block_stats, INT4_G64, progress=False)
        assert facts["alpha"]["attention.qkv"] == [0.5] * pretrained["num_hidden_layers"]

    assert_rewrite_keeps_logits(tiny_llama_dir, scale, "transformer.layers.0.mlp.proj.weight")


def test_fold_refuses_dense_scales_that_differ_within_a_kv_group(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tensors, pretrained = to_runtime(model, tiny_llama_dir)
    shape = Shape.of(pretrained)
    ones = {
        name: torch.ones(n) for name, n in (("attention.qkv", 64), ("mlp.gate_up", 64), ("mlp.proj", 128))
    }
    untied = torch.linspace(0.5, 2.0, shape.heads * shape.head_dim)
    with pytest.raises(ValueError, match="differ within a KV head group"):
        fold_block_scales(tensors, 0, {**ones, "attention.dense": untied}, shape)


# --- calibration -------------------------------------------------------------------------------------


def test_builtin_calibration_and_tuning_texts_are_disjoint_from_the_eval_set() -> None:
    records = load_records("builtin")
    assert len(records) >= 32  # the default calibration.num_samples draws without repeats
    assert any(isinstance(r, list) for r in records) and any(isinstance(r, str) for r in records)
    eval_lines = [
        line
        for name in ("heldout.txt", "summarize.jsonl", "qa.jsonl")
        for line in (BUILTIN_DIR / name).read_text(encoding="utf-8").replace(". ", ".\n").splitlines()
    ]
    for path in BUILTIN_DATASETS.values():  # the calibration set and the tuning text
        text = path.read_text(encoding="utf-8")
        shared = [line for line in eval_lines if len(line) > 40 and line in text]
        assert not shared, (path.name, shared[:3])


def test_calibration_samples_follow_the_config(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    config = CalibrationSection(num_samples=6, max_seq_length=40, seed=3)
    first = calibration_samples(tokenizer, config)
    assert len(first) == 6 and all(0 < len(s) <= 40 for s in first)
    assert calibration_samples(tokenizer, config) == first  # the seed decides
    assert calibration_samples(tokenizer, config.model_copy(update={"seed": 4})) != first
    everything = calibration_samples(tokenizer, CalibrationSection(num_samples=1000, max_seq_length=4096))
    assert len(everything) == len(load_records("builtin"))
    # chat records go through the chat template
    chat_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert any(chat_start in s for s in everything)


def test_user_calibration_files(tmp_path: Path) -> None:
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "one"}\n\n{"messages": [{"role": "user", "content": "two"}]}\n')
    assert load_records(str(jsonl)) == ["one", [{"role": "user", "content": "two"}]]
    text = tmp_path / "c.txt"
    text.write_text("first paragraph\nstill first\n\nsecond\n")
    assert load_records(str(text)) == ["first paragraph\nstill first", "second"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        load_records(str(bad))
    with pytest.raises(ConfigError, match="is not a file"):
        load_records(str(tmp_path / "missing.jsonl"))


def test_user_calibration_json_files_and_folders(tmp_path: Path) -> None:
    listed = tmp_path / "c.json"
    listed.write_text(
        json.dumps(["plain", {"text": "one"}, {"messages": [{"role": "user", "content": "two"}]}])
    )
    assert load_records(str(listed)) == ["plain", "one", [{"role": "user", "content": "two"}]]
    (tmp_path / "obj.json").write_text('{"text": "not a list"}')
    with pytest.raises(ConfigError, match="obj.json: a .json calibration file must hold a list"):
        load_records(str(tmp_path / "obj.json"))
    (tmp_path / "num.json").write_text("[1]")
    with pytest.raises(ConfigError, match=r"num.json\[0\]: a record must be a string or an object"):
        load_records(str(tmp_path / "num.json"))
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(ConfigError, match="has no .jsonl, .json, .txt file"):
        load_records(str(folder))
    (folder / "b.txt").write_text("second\n\nthird\n")
    (folder / "a.jsonl").write_text('{"text": "first"}\n')
    (folder / ".hidden.txt").write_text("skipped")
    (folder / "README.md").write_text("skipped")
    assert load_records(str(folder)) == ["first", "second", "third"]  # files in name order


def test_block_walk_sees_what_the_full_model_feeds_each_linear(tiny_llama_dir: Path) -> None:
    config = CalibrationSection(num_samples=3, max_seq_length=64, seed=0)
    tokens, walk = layer_input_stats(tiny_llama_dir, config)
    walked = dict(walk)
    # The same samples through the whole model, with every linear layer's input recorded.
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    samples = calibration_samples(AutoTokenizer.from_pretrained(tiny_llama_dir), config)
    assert tokens == sum(len(s) for s in samples)
    direct = {
        (i, name): InputStats(block.get_submodule(module).in_features)
        for i, block in enumerate(model.model.layers)
        for name, module in HF_INPUT_MODULES.items()
    }
    for (i, name), stats in direct.items():
        model.model.layers[i].get_submodule(HF_INPUT_MODULES[name]).register_forward_pre_hook(
            lambda m, args, s=stats: s.add(args[0])
        )
    with torch.no_grad():
        for ids in samples:
            model(input_ids=torch.tensor([ids]))
    assert sorted(walked) == list(range(len(model.model.layers)))
    for (i, name), stats in direct.items():
        assert walked[i][name].tokens == stats.tokens == tokens
        assert torch.allclose(walked[i][name].mean_abs, stats.mean_abs, rtol=1e-5, atol=1e-6)
        assert torch.allclose(walked[i][name].gram, stats.gram, rtol=1e-4, atol=1e-4)


def test_torch_backend_accepts_int4_awq() -> None:
    root = Path(__file__).resolve().parents[2]
    cfg = load_build_config(root / "build_configs" / "smollm2-135m-int4-awq.yaml")
    assert cfg.backend == "torch" and cfg.quantization.mode == "int4_awq"
    assert cfg.quantization.quant_algo == "W4A16_AWQ" and cfg.quantization.group_size == 128


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mode": "int4_wo"}, "not mode=int4_wo on backend=torch"),
        ({"mode": "int8_wo", "backend": "trtllm"}, "not mode=int8_wo on backend=trtllm"),
    ],
)
def test_activation_aware_is_an_int8_torch_option(tmp_path: Path, overrides: dict, message: str) -> None:
    overrides = dict(overrides)  # the parametrize dict is shared: pop from a copy
    backend = overrides.pop("backend", "torch")
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "source": {"kind": "local", "path": str(tmp_path)},
                "backend": backend,
                "quantization": {**overrides, "activation_aware": True},
            }
        )
    )
    with pytest.raises(ConfigError, match=message):
        load_build_config(config)
    root = Path(__file__).resolve().parents[2]
    cfg = load_build_config(root / "build_configs" / "smollm2-135m-int8-awq.yaml")
    assert cfg.quantization.activation_aware and cfg.quantization.quant_algo == "W8A16"
