"""CTranslate2: the HF checkpoint converted with its transformers converter, float32 and int8.

`Generator.generate_batch` runs static batches; its per-step callback gives token timestamps and, by
returning True, ends one example early, so each request stops at its own length while the rest of the
batch goes on. Greedy, with EOS suppressed until the longest output of the batch (min_length).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.bench.load import OnRecord, RunResult
from pipeline.bench.metrics import RequestRecord
from pipeline.bench.peers import run_static_batches
from pipeline.bench.requests import BenchRequest
from pipeline.errors import MissingArtifactError

INSTALL_HINT = "make bench-deps   (or: .venv/bin/pip install ctranslate2 torch==2.13.0)"
PRECISIONS = ("float32", "int8")


def import_ctranslate2() -> Any:
    try:
        import ctranslate2
    except ImportError:
        raise MissingArtifactError("ctranslate2 is not installed", hint=INSTALL_HINT) from None
    return ctranslate2


def convert(hf_dir: Path, out_dir: Path, precision: str) -> Path:
    """The CTranslate2 model of `hf_dir` with weights stored as `precision`; reused when present."""
    if (out_dir / "model.bin").is_file():
        return out_dir
    ct2 = import_ctranslate2()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ct2.converters.TransformersConverter(str(hf_dir)).convert(str(tmp), quantization=precision, force=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)
    return out_dir


class CTranslate2Peer:
    system = "ct2"

    def __init__(
        self, model_dir: Path, precision: str, tokenizer: Any, num_threads: int | None = None
    ) -> None:
        ct2 = import_ctranslate2()
        self.precision = precision
        self.name = f"ct2-{precision}"
        self.tokenizer = tokenizer
        self.generator = ct2.Generator(
            str(model_dir),
            device="cpu",
            compute_type=precision,
            inter_threads=1,
            intra_threads=num_threads or os.cpu_count() or 1,
        )

    def run(
        self, requests: Sequence[BenchRequest], batch_size: int, on_record: OnRecord | None = None
    ) -> RunResult:
        return run_static_batches(self, self._generate, requests, batch_size, on_record)

    def _generate(self, batch: list[BenchRequest]) -> list[RequestRecord]:
        times: list[list[float]] = [[] for _ in batch]

        def on_step(step: Any) -> bool:
            row = times[step.batch_id]
            row.append(time.perf_counter())
            return len(row) >= batch[step.batch_id].output_tokens

        prompts = [self.tokenizer.convert_ids_to_tokens(list(r.input_ids or ())) for r in batch]
        longest = max(r.output_tokens for r in batch)
        start = time.perf_counter()
        self.generator.generate_batch(
            prompts,
            max_batch_size=len(batch),
            max_length=longest,
            min_length=longest,
            sampling_topk=1,
            include_prompt_in_result=False,
            callback=on_step,
        )
        return [
            RequestRecord(
                index=r.index,
                num_input_tokens=r.num_input_tokens,
                start=start,
                end=row[-1] if row else start,
                response_times=row,
                response_tokens=[1] * len(row),
                num_expected_tokens=r.output_tokens,
                error=None if len(row) == r.output_tokens else f"ctranslate2 stopped after {len(row)} tokens",
            )
            for r, row in zip(batch, times, strict=True)
        ]

    def close(self) -> None:
        del self.generator
