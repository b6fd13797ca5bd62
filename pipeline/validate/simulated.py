"""A TensorRT-LLM build, measured before any GPU time: the ModelOpt-quantized Hugging Face model of the
quantize stage with ModelOpt's simulated quantization (the weights, scales and activation quantizers the
exported checkpoint carries, computed in float32 on CPU). It answers `generate` and `score` like the
in-process engine, so the same metrics and gates apply."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.validate.reference import ReferenceModel


class SimulatedTarget:
    def __init__(self, hf_dir: Path, quantized_dir: Path, max_input_len: int) -> None:
        from pipeline.quantize.modelopt.state import load_simulated_model

        self.name = f"ModelOpt simulated quantization {quantized_dir}"
        self.max_input_len = max_input_len
        self._model = ReferenceModel(hf_dir, model=load_simulated_model(hf_dir, quantized_dir))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        # the checkpoint's own stop ids, which are the reference's too: both stop where HF generate stops
        return self._model.generate(prompts, max_new_tokens)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        return self._model.score(token_ids)
