"""What ModelOpt calibrates: the HF checkpoint in float32 on the CPU, and a forward loop over llmpipe's
calibration data (`quantization.calibration`: the records of `dataset`, `num_samples` of them drawn with
`seed`, each cut to `max_seq_length` tokens, run `batch_size` at a time).

ModelOpt calls the loop once per calibration pass (AWQ and SmoothQuant make more than one); every pass shows
its own progress bar on stderr, as the torch backend's quantizer does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.config.build_config import CalibrationSection
from pipeline.quantize.calibration import calibration_samples


def load_float_model(hf_dir: Path) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer): the checkpoint in float32, in eval mode, on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the calibration bars are the ones that matter
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return model, tokenizer


@dataclass
class ForwardLoop:
    """`loop(model)` runs every calibration batch through `model` once, without gradients."""

    batches: list[tuple[torch.Tensor, torch.Tensor]]
    desc: str
    progress: bool = True
    passes: int = field(default=0, init=False)

    @property
    def samples(self) -> int:
        return sum(len(ids) for ids, _ in self.batches)

    @property
    def tokens(self) -> int:
        return int(sum(mask.sum() for _, mask in self.batches))

    def __call__(self, model: torch.nn.Module) -> None:
        from tqdm import tqdm

        self.passes += 1
        bar = tqdm(
            self.batches, desc=f"{self.desc} (pass {self.passes})", unit="batch", file=sys.stderr,
            disable=not self.progress,
        )  # fmt: skip
        with torch.no_grad():
            for ids, mask in bar:
                model(input_ids=ids, attention_mask=mask, use_cache=False)


def forward_loop(
    tokenizer: Any, calibration: CalibrationSection, desc: str, progress: bool = True
) -> ForwardLoop:
    """The calibration samples as right-padded batches with their attention masks."""
    samples = [ids for ids in calibration_samples(tokenizer, calibration) if ids]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    size = calibration.batch_size
    batches = [_batch(samples[start : start + size], pad) for start in range(0, len(samples), size)]
    return ForwardLoop(batches, desc, progress)


def _batch(samples: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in samples)
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample)] = torch.tensor(sample)
        mask[row, : len(sample)] = 1
    return ids, mask
