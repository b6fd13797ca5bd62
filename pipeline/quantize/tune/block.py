"""Block-wise tuning of int4 levels and grids (quantization.tune.block_steps), the first phase of
grid_tune.tune_int4_grids: blocks in order, each weight's level may move by one and each group's scale and
zero point are trained so that the quantized block's outputs match the float block's on the same inputs
(the float model's hidden states of the tuning text; mean squared error).

Why a per-block objective for the levels: the end-to-end KL of a batch of four sequences gives single weights
gradients that are mostly noise (on SmolLM2-135M, Adam on level offsets at a step size that could have moved
consistent ones by a level in 70 steps moved none), while a block's own output error gives each level a
direction that holds from batch to batch. The level offsets take sign steps (as AutoRound does), so how far
a level can travel does not depend on the size of its gradient. Why float inputs rather than the quantized
blocks' outputs: the error that reaches a block from the blocks before cannot be undone by the block and
swamps its own error in the loss. A block keeps its new levels only if its output error on the held-out
sequences drops.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.quantize.blocks import progress_bar
from pipeline.quantize.calibration import first_block_inputs
from pipeline.quantize.tune.trainable_grid import TunedGrid, grid_optimizer

# The sign steps' sizes add up to this many levels over a block's steps (decaying linearly): a level whose
# gradient keeps one sign for a third of the steps or more moves by half a level and rounds to the next.
LEVEL_TRAVEL = 1.5
MAX_LEVEL_MOVE = 1.0  # levels stay within one of where the rounding put them
BLOCK_BATCH = 8  # sequences per no-grad block forward


def tune_blocks(
    teacher: Any,
    student: Any,
    grids: dict[str, TunedGrid],
    train: list[list[int]],
    held_out: list[list[int]],
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    progress: bool,
) -> dict[str, Any]:
    """Tune the grids of every block of `student` (an HF model whose linear layers are `grids`, keyed by runtime
    prefix) against the same block of `teacher`. `train` and `held_out` are token sequences of one length."""
    started = time.perf_counter()
    inputs, kwargs = _first_inputs(teacher, train)
    held_inputs, _ = _first_inputs(teacher, held_out)
    rng = random.Random(seed)
    moved = kept_blocks = 0
    error_before = error_after = 0.0
    blocks = list(zip(teacher.model.layers, student.model.layers, strict=True))
    for index, (float_block, quantized_block) in enumerate(
        progress_bar(blocks, teacher.config.to_dict(), "int4 block tuning", progress)
    ):
        block_grids = [g for key, g in grids.items() if key.startswith(f"transformer.layers.{index}.")]
        targets = _forward(float_block, inputs, kwargs)
        held_targets = _forward(float_block, held_inputs, kwargs)
        start = [(g.scale_change.detach().clone(), g.zero_change.detach().clone()) for g in block_grids]
        before = F.mse_loss(_forward(quantized_block, held_inputs, kwargs), held_targets).item()
        offsets = [grid.free_levels() for grid in block_grids]
        optimizer = grid_optimizer(block_grids, learning_rate)
        for step in range(steps):
            picked = rng.sample(range(len(inputs)), min(batch_size, len(inputs)))
            loss = F.mse_loss(_call(quantized_block, inputs[picked], kwargs), targets[picked])
            optimizer.zero_grad()
            for offset in offsets:
                offset.grad = None
            loss.backward()
            optimizer.step()
            sign_step = 2 * LEVEL_TRAVEL / steps * (1 - step / steps)
            with torch.no_grad():
                for offset in offsets:
                    assert offset.grad is not None
                    offset.sub_(sign_step * offset.grad.sign()).clamp_(-MAX_LEVEL_MOVE, MAX_LEVEL_MOVE)
        after = F.mse_loss(_forward(quantized_block, held_inputs, kwargs), held_targets).item()
        keep = after < before
        with torch.no_grad():
            for grid, (scale_change, zero_change) in zip(block_grids, start, strict=True):
                original = grid.levels
                grid.fix_levels(keep)
                moved += int((grid.levels != original).sum())
                if not keep:
                    grid.scale_change.copy_(scale_change)
                    grid.zero_change.copy_(zero_change)
        kept_blocks += keep
        error_before += before
        error_after += min(before, after)
        inputs, held_inputs = targets, held_targets
    return {
        "steps_per_block": steps,
        "blocks_kept": kept_blocks,
        "levels_moved": moved,
        "held_out_block_mse_before": round(error_before / len(blocks), 6),
        "held_out_block_mse_after": round(error_after / len(blocks), 6),
        "seconds": round(time.perf_counter() - started, 1),
    }


def _first_inputs(model: Any, sequences: list[list[int]]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The first block's inputs for `sequences` stacked ([sequences, length, hidden]), and the keyword
    arguments the model passes its blocks (rotary tables, mask), which broadcast over the batch."""
    with torch.no_grad():
        captured = [first_block_inputs(model, model.model.layers[0], ids) for ids in sequences]
    return torch.cat([hidden for hidden, _ in captured]), captured[0][1]


def _call(block: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    out = block(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def _forward(block: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    return torch.cat(
        [_call(block, hidden[i : i + BLOCK_BATCH], kwargs) for i in range(0, len(hidden), BLOCK_BATCH)]
    )
