"""The accuracy reference: Hugging Face transformers in float32 on the checkpoint the engine was built from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.errors import MissingArtifactError


def stop_token_ids(checkpoint: Path, tokenizer: Any) -> list[int]:
    """The ids that end a generation: generation_config.json's eos_token_id (int or list), else the tokenizer's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(checkpoint).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return [int(i) for i in ids]


class ReferenceModel:
    """`score` and `generate` on token ids, one sequence at a time (no padding can change the numbers)."""

    name = "reference (HF transformers, float32)"

    def __init__(self, checkpoint: Path, model: torch.nn.Module | None = None) -> None:
        """`model`: another model of this checkpoint's tokenizer to run instead of the float32 one."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars would interleave with the table
        if not (checkpoint / "config.json").is_file():
            raise MissingArtifactError(
                f"no HF checkpoint at {checkpoint}", hint="Run `llmpipe fetch CONFIG` first."
            )
        self.checkpoint = checkpoint
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        self.model: Any = model.eval()  # a transformers causal LM: generate() is its own
        self.stop_ids = stop_token_ids(checkpoint, self.tokenizer)

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position: row i is the distribution of token i+1. [len(token_ids), vocab]."""
        input_ids = torch.tensor([token_ids], dtype=torch.long)  # [1, T]
        return self.model(input_ids=input_ids).logits[0].float()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations (stop id included when reached, as the engine returns it)."""
        from transformers import GenerationConfig

        # A fresh config: sampling settings in the checkpoint's generation_config.json (temperature,
        # repetition_penalty, ...) must not leak into a greedy reference.
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.stop_ids or None,
            pad_token_id=self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else (self.stop_ids[0] if self.stop_ids else 0),
        )
        outputs = []
        for prompt in prompts:
            input_ids = torch.tensor([prompt], dtype=torch.long)  # [1, P]
            generated = self.model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
            outputs.append(generated[0, len(prompt) :].tolist())
        return outputs
