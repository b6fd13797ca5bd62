"""Calibration for activation-aware and GPTQ quantization: the calibration texts (`quantization.calibration`), and
the statistics of every linear layer's inputs, collected by running the float32 Hugging Face model one
transformer block at a time (so only one block's activations are ever held).

`calibration.dataset: builtin` is pipeline/data/calib.jsonl (written for llmpipe, Apache-2.0; see
pipeline/data/calib.README.md), disjoint from the validation eval set. Any other value is a file or a folder:
JSONL records `{"text": "..."}` or `{"messages": [{"role": ..., "content": ...}, ...]}` (rendered with the
tokenizer's chat template), a `.json` file holding a list of such records (or of strings), or plain text
with one sample per blank-line-separated paragraph; a folder contributes its `.jsonl`, `.json` and `.txt`
files in name order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from pipeline.config.build_config import CalibrationSection
from pipeline.errors import ConfigError, MissingArtifactError, UnsupportedModelError
from pipeline.quantize.awq_search import InputStats
from pipeline.util.files import read_jsonl
from pipeline.util.package_data import DATA_DIR

BUILTIN_CALIBRATION = DATA_DIR / "calib.jsonl"
CALIBRATION_FIELD = "quantization.calibration.dataset"
TUNING_TEXT_FIELD = "quantization.tune.dataset"
# What "builtin" names in each config field that takes a text file.
BUILTIN_DATASETS = {CALIBRATION_FIELD: BUILTIN_CALIBRATION, TUNING_TEXT_FIELD: DATA_DIR / "tune.jsonl"}
# Runtime linear layer (checkpoint.LAYER_WEIGHTS) -> the HF module whose input it shares: q, k and v read
# the same normed hidden states, as do gate and up.
HF_INPUT_MODULES: dict[str, str] = {
    "attention.qkv": "self_attn.q_proj",
    "attention.dense": "self_attn.o_proj",
    "mlp.gate_up": "mlp.gate_proj",
    "mlp.proj": "mlp.down_proj",
}

Record = str | list[dict[str, str]]  # plain text, or chat messages


def dataset_path(dataset: str, field: str = CALIBRATION_FIELD) -> Path:
    """The file `dataset`, the value of config `field`, names: "builtin" or a path (relative to the current
    directory)."""
    return BUILTIN_DATASETS[field] if dataset == "builtin" else Path(dataset).expanduser()


# The files a dataset folder contributes, by suffix.
FOLDER_SUFFIXES = (".jsonl", ".json", ".txt")


def dataset_files(dataset: str, field: str = CALIBRATION_FIELD) -> list[Path]:
    """The files `dataset` (the value of config `field`) reads: the file itself, or a folder's files with
    FOLDER_SUFFIXES in name order (hidden ones skipped)."""
    path = dataset_path(dataset, field)
    if path.is_file():
        return [path]
    hint = "use 'builtin', a JSONL/JSON file of records, plain text with blank lines between samples, or a folder of them"
    if not path.is_dir():
        raise ConfigError(f"{field}={dataset!r}: {path} is not a file or folder", hint=hint)
    files = sorted(
        p
        for p in path.iterdir()
        if p.is_file() and p.suffix in FOLDER_SUFFIXES and not p.name.startswith(".")
    )
    if not files:
        raise ConfigError(
            f"{field}={dataset!r}: the folder {path} has no {', '.join(FOLDER_SUFFIXES)} file", hint=hint
        )
    return files


def data_files(name: str, dataset: str, field: str = CALIBRATION_FIELD) -> dict[str, Path]:
    """{key: file} for a stage's `data_files` (their contents key its reuse): `name` for a single file,
    `name/<file name>` for each file of a folder."""
    path = dataset_path(dataset, field)
    if not path.is_dir():
        return {name: path}
    return {f"{name}/{file.name}": file for file in dataset_files(dataset, field)}


def load_records(dataset: str, field: str = CALIBRATION_FIELD) -> list[Record]:
    """The records of `dataset`, the value of config `field` ("builtin", a file or a folder)."""
    records = [record for path in dataset_files(dataset, field) for record in _file_records(path)]
    if not records:
        raise ConfigError(f"{field}={dataset!r}: {dataset_path(dataset, field)} holds no samples")
    return records


def _file_records(path: Path) -> list[Record]:
    if path.suffix == ".jsonl":
        return [_parse_record(record, where) for where, record in read_jsonl(path)]
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return _json_records(path, text)
    return [part.strip() for part in text.split("\n\n") if part.strip()]


def _json_records(path: Path, text: str) -> list[Record]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(items, list):
        raise ConfigError(
            f"{path}: a .json calibration file must hold a list of records, got {type(items).__name__}"
        )
    records: list[Record] = []
    for index, item in enumerate(items):
        where = f"{path}[{index}]"
        if isinstance(item, str):
            records.append(item)
        elif isinstance(item, dict):
            records.append(_parse_record(item, where))
        else:
            raise ConfigError(f"{where}: a record must be a string or an object, got {type(item).__name__}")
    return records


def _parse_record(obj: dict[str, Any], where: str) -> Record:
    if isinstance(obj.get("text"), str):
        return str(obj["text"])
    messages = obj.get("messages")
    if isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    raise ConfigError(
        f"{where}: a record must be {{'text': str}} or {{'messages': [{{'role', 'content'}}, ...]}}"
    )


def calibration_samples(tokenizer: Any, calibration: CalibrationSection) -> list[list[int]]:
    """Token ids of `num_samples` records drawn with `seed` (all of them when there are fewer), each cut to
    `max_seq_length` tokens. Chat records go through the tokenizer's chat template when it has one."""
    records = load_records(calibration.dataset)
    chosen = random.Random(calibration.seed).sample(records, min(calibration.num_samples, len(records)))
    return [record_ids(tokenizer, record)[: calibration.max_seq_length] for record in chosen]


def record_ids(tokenizer: Any, record: Record) -> list[int]:
    """The token ids of one record; chat records go through the tokenizer's chat template when it has one."""
    if isinstance(record, list):
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(record, tokenize=False)
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(tokenizer("\n\n".join(m["content"] for m in record))["input_ids"])
    return list(tokenizer(record)["input_ids"])


class _Captured(Exception):
    """Stops the model at its first block once that block's inputs are recorded."""


def layer_input_stats(
    hf_dir: Path,
    calibration: CalibrationSection,
    quantized_block: Callable[[int], dict[str, torch.Tensor]] | None = None,
) -> tuple[int, Iterator[tuple[int, dict[str, InputStats]]]]:
    """(number of calibration tokens, an iterator over the blocks in order yielding (index, {runtime linear
    name: InputStats})). Each block runs on the float32 outputs of the block before it.

    With `quantized_block`, once the consumer asks for the next block, `quantized_block(index)` gives the
    block's tensors as the engine will compute with them (runtime names without the layer prefix, e.g.
    "attention.qkv.weight") and the block's outputs are recomputed with those: later blocks are calibrated
    on what the quantized earlier blocks produce."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not (Path(hf_dir) / "config.json").is_file():
        raise MissingArtifactError(
            f"no HF checkpoint at {hf_dir} to calibrate with", hint="Run `llmpipe fetch CONFIG` first."
        )
    hf_logging.disable_progress_bar()  # the calibration bar is the one that matters
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    samples = [s for s in calibration_samples(tokenizer, calibration) if s]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    blocks = model.model.layers
    with torch.no_grad():
        inputs = [first_block_inputs(model, blocks[0], ids) for ids in samples]
    return sum(len(s) for s in samples), _walk_blocks(blocks, inputs, quantized_block)


def first_block_inputs(
    model: torch.nn.Module, first: torch.nn.Module, ids: list[int]
) -> tuple[torch.Tensor, dict[str, Any]]:
    # The model's own forward prepares what its blocks take (rotary cos/sin, causal mask, positions), so
    # record that instead of rebuilding it for each architecture.
    captured: dict[str, Any] = {}

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured["kwargs"] = dict(kwargs)
        captured["hidden"] = args[0] if args else captured["kwargs"].pop("hidden_states")
        raise _Captured

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(input_ids=torch.tensor([ids]), use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    return captured["hidden"], captured["kwargs"]


def _walk_blocks(
    blocks: torch.nn.ModuleList,
    inputs: list[tuple[torch.Tensor, dict[str, Any]]],
    quantized_block: Callable[[int], dict[str, torch.Tensor]] | None,
) -> Iterator[tuple[int, dict[str, InputStats]]]:
    hidden = [h for h, _ in inputs]
    for index, block in enumerate(blocks):
        stats: dict[str, InputStats] = {}
        handles = []
        for name, module_name in HF_INPUT_MODULES.items():
            module = block.get_submodule(module_name)
            if not isinstance(module, torch.nn.Linear):
                raise UnsupportedModelError(
                    f"layer {index}: {module_name} is a {type(module).__name__}, not a linear layer to calibrate"
                )
            stats[name] = InputStats(module.in_features)
            handles.append(module.register_forward_pre_hook(_recorder(stats[name])))
        try:
            outputs = _forward(block, hidden, inputs)
        finally:
            for handle in handles:
                handle.remove()
        yield index, stats
        if quantized_block is not None and index + 1 < len(blocks):
            load_block(block, quantized_block(index))
            outputs = _forward(block, hidden, inputs)
        hidden = outputs


def _forward(
    block: torch.nn.Module, hidden: list[torch.Tensor], inputs: list[tuple[torch.Tensor, dict[str, Any]]]
) -> list[torch.Tensor]:
    outputs = []
    with torch.no_grad():
        for h, (_, kwargs) in zip(hidden, inputs, strict=True):
            out = block(h, **kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
    return outputs


def load_block(block: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy one block's runtime-layout tensors into its HF modules (splitting the fused ones)."""
    from pipeline.architectures.weight_map import LAYER_WEIGHTS, QKV_BIAS_WEIGHTS

    for runtime, sources in {**LAYER_WEIGHTS, **QKV_BIAS_WEIGHTS}.items():
        if runtime in tensors:
            params = [block.get_parameter(source) for source in sources]
            parts = tensors[runtime].split([param.shape[0] for param in params])
            with torch.no_grad():
                for param, part in zip(params, parts, strict=True):
                    param.copy_(part)


def _recorder(stats: InputStats) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        stats.add(args[0])

    return hook
