"""Hugging Face transformers `generate`: the naive baseline, one request at a time or in padded static batches."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.bench.load import OnRecord, RunResult
from pipeline.bench.metrics import RequestRecord
from pipeline.bench.peers import records_from_steps, run_static_batches
from pipeline.bench.requests import BenchRequest


class _StepClock:
    """A generate() streamer that only notes when each decoding step's tokens came out."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        if not self._seen_prompt:  # generate() first pushes the prompt itself
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFPeer:
    system = "hf"

    def __init__(self, model_dir: str | Path, device: str = "cpu", name: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = device
        # fp32 on CPU (bf16 matmul is unusable there); the checkpoint's dtype on CUDA
        dtype = torch.float32 if device == "cpu" else "auto"
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        # NOTE: transformers types .to() through a decorator mypy misreads
        self.model = (model if device == "cpu" else model.to(device)).eval()  # type: ignore[arg-type]
        self.precision = "fp32" if device == "cpu" else str(self.model.dtype).removeprefix("torch.")
        self.name = name or f"hf-{self.precision}" + ("" if device == "cpu" else f"-{device}")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(
        self, requests: Sequence[BenchRequest], batch_size: int, on_record: OnRecord | None = None
    ) -> RunResult:
        return run_static_batches(self, self._generate, requests, batch_size, on_record)

    def _generate(self, batch: list[BenchRequest]) -> list[RequestRecord]:
        torch = self.torch
        prompts = [list(r.input_ids or ()) for r in batch]
        width = max(len(p) for p in prompts)
        # left padding: every row's next token lands in the same column
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        num_new = max(r.output_tokens for r in batch)
        clock = _StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=num_new,
                min_new_tokens=num_new,  # outputs of the intended length, like min_tokens = max_tokens
                do_sample=False,
                pad_token_id=self.pad_id,
                streamer=clock,
            )
        return records_from_steps(batch, start, clock.times)

    def close(self) -> None:
        del self.model
