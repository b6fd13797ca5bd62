"""Tuning of int4 grids after rounding (quantization.tune), on the calibration text, the tuning text
(tune.dataset: by default ~66k tokens of English prose written for llmpipe) and sequences sampled from the float
model, in two optional phases:
1. block_steps (block_tune.py): per block, each weight's level may move by one and the grids are trained on the
   block's own output error;
2. steps (here): each group's scale and zero point are trained with Adam, levels fixed, so that the quantized
   model's next-token distributions match the float32 model's (mean KL divergence).

Why end to end: GPTQ and the activation-aware search minimize each layer's own output error; the model's output
error also depends on how those errors add up over 30 blocks, which only an end-to-end objective sees.
Training only the grids (EfficientQAT's "E2E-QP" step, with the float model as the teacher) keeps the
packed format and kernels unchanged and has few parameters (two per group), so a few thousand tokens of
text do not overfit them the way they would the weights. Sampled sequences (LLM-QAT's data-free recipe:
random first token, then the float model's own samples) widen the text the grids see beyond the
calibration set, but they are not the English a deployment reads; the tuning text is. On SmolLM2-135M
(int4_gptq, group 128) validate's perplexity delta vs float32 went from +13.4 % untuned to +10.1 % (120 steps end
to end), +8.5 % (80 block steps first) and +4.3 % (both on the tuning prose too; benchmarks/NOTES.md on the int4 tuning).
With the prose, the sampled sequences no longer helped (+4.5 % without them), so the shipped build skips them.

A share of the sequences is held out: the tuned grids are kept only when they lower the held-out KL (both phases
together).
"""

from __future__ import annotations

import copy
import math
import random
import sys
from pathlib import Path
from typing import Any

import torch

from pipeline.architectures.weight_map import LAYER_WEIGHTS
from pipeline.config.build_config import CalibrationSection, TuneSection
from pipeline.quantize.calibration import (
    TUNING_TEXT_FIELD,
    calibration_samples,
    load_block,
    load_records,
    record_ids,
)
from pipeline.quantize.tune.block import tune_blocks
from pipeline.quantize.tune.trainable_grid import GridRows, TunedGrid, grid_optimizer
from pipeline.runtime.model.weight_names import LAYER_LINEARS
from pipeline.runtime.quant.linear import QuantLinear

# Tuning sequences are cut to this many tokens: long enough for the attention patterns of real text, short
# enough that a batch's activations stay a few hundred MB.
SEQUENCE_LENGTH = 256
# Every HELD_OUT_EVERY-th sequence decides whether the tuned grids are kept instead of training them.
HELD_OUT_EVERY = 8


def tune_int4_grids(
    tensors: dict[str, torch.Tensor],
    hf_dir: Path,
    calibration: CalibrationSection,
    tune: TuneSection,
    group_size: int,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Tune the levels (block phase), scales and zeros of every block's int4 linear layer in `tensors` (quantized
    runtime layout, replaced in place when the held-out KL improves). Returns the stage facts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    teacher = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    sequences = [s for s in calibration_samples(tokenizer, calibration) if len(s) >= 2]
    text = tuning_text(tokenizer, tune.dataset) if tune.dataset is not None else []
    sequences += [text] if text else []
    sequences += sample_sequences(teacher, tokenizer, tune.generated_samples, calibration.seed, progress)
    chunks = [s[i : i + SEQUENCE_LENGTH] for s in sequences for i in range(0, len(s), SEQUENCE_LENGTH)]
    chunks = [c for c in chunks if len(c) >= 2]
    held_out, train = chunks[::HELD_OUT_EVERY], [c for i, c in enumerate(chunks) if i % HELD_OUT_EVERY]
    if not train or not held_out:
        return {"skipped": f"only {len(chunks)} sequences of text to tune on"}

    student, grids = _student(teacher, tensors, group_size)
    kl_before = _mean_kl(teacher, student, held_out, tune.batch_size)
    facts: dict[str, Any] = {}
    if tune.block_steps:
        full = (
            [c for c in train if len(c) == SEQUENCE_LENGTH],
            [c for c in held_out if len(c) == SEQUENCE_LENGTH],
        )
        if all(full):
            facts["blocks"] = tune_blocks(
                teacher,
                student,
                grids,
                *full,
                steps=tune.block_steps,
                batch_size=tune.batch_size,
                learning_rate=tune.learning_rate,
                seed=calibration.seed,
                progress=progress,
            )
        else:
            facts["blocks"] = {"skipped": f"no {SEQUENCE_LENGTH}-token sequences to tune blocks on"}
    if tune.steps:
        _tune_end_to_end(teacher, student, list(grids.values()), train, tune, calibration.seed, progress)
    kl_after = _mean_kl(teacher, student, held_out, tune.batch_size)
    kept = kl_after < kl_before and all(
        bool(torch.isfinite(g.scales()).all() and (g.scales() > 0).all()) for g in grids.values()
    )
    if kept:
        with torch.no_grad():
            for prefix, grid in grids.items():
                tensors[f"{prefix}.qweight"] = grid.qweight().contiguous()
                tensors[f"{prefix}.scales"] = grid.scales().contiguous()
                tensors[f"{prefix}.zeros"] = grid.zeros().contiguous()
    return {
        "steps": tune.steps,
        **facts,
        "tuning_text_tokens": len(text),
        "tokens": sum(map(len, train)),
        "held_out_tokens": sum(map(len, held_out)),
        "held_out_kl_before": round(kl_before, 5),
        "held_out_kl_after": round(kl_after, 5),
        "kept": kept,
    }


def _tune_end_to_end(
    teacher: Any,
    student: Any,
    grids: list[TunedGrid],
    train: list[list[int]],
    tune: TuneSection,
    seed: int,
    progress: bool,
) -> None:
    optimizer = grid_optimizer(grids, tune.learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / tune.steps))
    )
    rng = random.Random(seed)
    bar = _bar(range(tune.steps), f"int4 grid tuning ({tune.steps} steps)", progress)
    for _ in bar:
        loss = _batch_kl(teacher, student, rng.sample(train, min(tune.batch_size, len(train))))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        bar.set_postfix(kl=f"{loss.item():.4f}")
    bar.close()


def tuning_text(tokenizer: Any, dataset: str) -> list[int]:
    """The records of `dataset` (quantization.tune.dataset) as one token stream, separated by blank lines, so that
    it cuts into whole SEQUENCE_LENGTH-token sequences."""
    separator = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    stream: list[int] = []
    for record in load_records(dataset, TUNING_TEXT_FIELD):
        stream += (separator if stream else []) + record_ids(tokenizer, record)
    return stream


@torch.no_grad()
def sample_sequences(model: Any, tokenizer: Any, count: int, seed: int, progress: bool) -> list[list[int]]:
    """`count` sequences of SEQUENCE_LENGTH tokens sampled (temperature 1, no truncation, end-of-text
    suppressed) from `model`, each started from a uniformly drawn non-special token."""
    from transformers import GenerationConfig

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # generate() samples from the global generator
    special = set(tokenizer.all_special_ids)
    vocabulary = torch.tensor([t for t in range(model.config.vocab_size) if t not in special])
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=SEQUENCE_LENGTH - 1,
        min_new_tokens=SEQUENCE_LENGTH - 1,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
    )
    batch = 32
    out: list[list[int]] = []
    for start in _bar(range(0, count, batch), "sampling tuning text", progress, unit="batch"):
        first = vocabulary[
            torch.randint(len(vocabulary), (min(batch, count - start), 1), generator=generator)
        ]
        out += model.generate(
            input_ids=first, attention_mask=torch.ones_like(first), generation_config=config
        ).tolist()
    return out


def _student(
    teacher: Any, tensors: dict[str, torch.Tensor], group_size: int
) -> tuple[Any, dict[str, TunedGrid]]:
    """A copy of `teacher` computing what the engine will: the folded norms of `tensors` and every block's
    linear layers from their int4 grids."""
    student = copy.deepcopy(teacher)
    for param in student.parameters():
        param.requires_grad_(False)
    grids: dict[str, TunedGrid] = {}
    for index, block in enumerate(student.model.layers):
        prefix = f"transformer.layers.{index}."
        # the norms, into which the activation-aware scales were folded
        load_block(block, {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)})
        for name in LAYER_LINEARS:
            key = prefix + name
            grid = TunedGrid(
                tensors[f"{key}.qweight"], tensors[f"{key}.scales"], tensors[f"{key}.zeros"], group_size
            )
            grids[key] = grid
            bias, row = tensors.get(f"{key}.bias"), 0
            for source in LAYER_WEIGHTS[f"{name}.weight"]:
                parent_name, _, child = source.removesuffix(".weight").rpartition(".")
                parent = block.get_submodule(parent_name)
                rows = slice(row, row + getattr(parent, child).out_features)
                setattr(parent, child, GridRows(grid, rows, None if bias is None else bias[rows]))
                row = rows.stop
    if "lm_head.qweight" in tensors:  # quantize_lm_head: its grids stay as they are
        packed = {k.removeprefix("lm_head."): v for k, v in tensors.items() if k.startswith("lm_head.")}
        weight = QuantLinear.from_packed(packed, "int4", group_size).dequantize()
        student.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        student.lm_head.weight = torch.nn.Parameter(weight, requires_grad=False)
    return student, grids


def _batch_kl(teacher: torch.nn.Module, student: torch.nn.Module, batch: list[list[int]]) -> torch.Tensor:
    """Mean over the batch's real tokens of KL(teacher || student) of the next-token distributions."""
    width = max(map(len, batch))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in batch])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch])
    with torch.no_grad():
        target = torch.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits.float(), -1)
    predicted = torch.log_softmax(student(input_ids=ids, attention_mask=mask).logits.float(), -1)
    kl = (target.exp() * (target - predicted)).sum(-1)
    return (kl * mask).sum() / mask.sum()


@torch.no_grad()
def _mean_kl(
    teacher: torch.nn.Module, student: torch.nn.Module, chunks: list[list[int]], batch: int
) -> float:
    total = weight = 0.0
    for start in range(0, len(chunks), batch):
        part = chunks[start : start + batch]
        tokens = sum(map(len, part))
        total += _batch_kl(teacher, student, part).item() * tokens
        weight += tokens
    return total / weight


def _bar(items: Any, desc: str, progress: bool, unit: str = "step") -> Any:
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit=unit, file=sys.stderr, disable=not progress)
