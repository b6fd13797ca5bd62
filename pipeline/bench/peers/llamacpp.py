"""llama.cpp through llama-cpp-python: the shipped Q4_1 GGUF and f32 / Q8_0 versions made from it.

llama-cpp-python's `Llama` class generates one sequence at a time (its batching is for embeddings
only), and its server serializes requests. llama.cpp's own batched decoding (several sequence ids in one
`llama_batch`, as its `parallel` example does) is reachable through the low-level bindings, so this peer
drives that directly: a continuous-batching loop with up to `batch_size` sequences in flight, a finished
sequence's slot refilled at once, prompts prefilled in the same `llama_decode` as other sequences'
decode tokens. Batch size 1 is the single-stream case. Sampling is greedy with EOS masked, so outputs
have their intended length.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.bench.load import OnRecord, RunResult
from pipeline.bench.metrics import RequestRecord
from pipeline.bench.peers import batch_result
from pipeline.bench.requests import BenchRequest
from pipeline.errors import MissingArtifactError, PipelineError

INSTALL_HINT = "make bench-deps   (or: .venv/bin/pip install llama-cpp-python==0.3.36 torch==2.13.0)"
# llama_ftype values (llama.h) for the versions made from the shipped file
FTYPES = {"f32": 0, "bf16": 32, "q4_1": 3, "q8_0": 7}
_TOKENS_PER_STEP = 512  # llama_decode's logical batch: decode tokens first, prompt chunks fill the rest


def import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise MissingArtifactError("llama-cpp-python is not installed", hint=INSTALL_HINT) from None
    return llama_cpp


def make_gguf_variant(src: Path, dst: Path, precision: str) -> Path:
    """Write `dst` as the `precision` (f32 | q8_0 | q4_1) version of `src` with llama.cpp's own quantizer;
    reused when it already exists. From the shipped Q4_1 file this dequantizes (f32) or requantizes (Q8_0)
    its values: the same weights, in the other formats."""
    if dst.is_file():
        return dst
    lib = import_llama_cpp()
    _silence(lib)
    params = lib.llama_model_quantize_default_params()
    params.ftype = FTYPES[precision]
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    status = lib.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if status != 0:
        tmp.unlink(missing_ok=True)
        raise PipelineError(
            f"llama.cpp could not write a {precision} version of {src.name} (status {status})"
        )
    tmp.replace(dst)
    return dst


@dataclass
class _Slot:
    request: BenchRequest
    seq_id: int
    start: float
    num_fed: int = 0  # prompt tokens already sent to llama_decode
    last_token: int = -1
    times: list[float] = field(default_factory=list)

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.input_ids or ()

    @property
    def prefilling(self) -> bool:
        return self.num_fed < len(self.prompt)


class LlamaCppPeer:
    system = "llamacpp"

    def __init__(
        self,
        gguf_path: Path,
        precision: str,
        max_batch_size: int = 16,
        max_seq_len: int = 1024,
        num_threads: int | None = None,
    ) -> None:
        self.lib = import_llama_cpp()
        self.precision = precision
        self.name = f"llamacpp-{precision}"
        lib = self.lib
        lib.llama_backend_init()
        _silence(lib)
        self.model = lib.llama_model_load_from_file(str(gguf_path).encode(), lib.llama_model_default_params())
        if not self.model:
            raise PipelineError(f"llama.cpp could not load {gguf_path}")
        vocab = lib.llama_model_get_vocab(self.model)
        self.eos_id = lib.llama_vocab_eos(vocab)
        self.vocab_size = lib.llama_vocab_n_tokens(vocab)
        self.max_batch_size = max_batch_size
        params = lib.llama_context_default_params()
        params.n_ctx = max_batch_size * max_seq_len
        params.n_batch = params.n_ubatch = _TOKENS_PER_STEP
        params.n_seq_max = max_batch_size
        params.kv_unified = True  # one KV pool shared by the sequences, like a paged cache
        params.n_threads = params.n_threads_batch = num_threads or os.cpu_count() or 1
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise PipelineError(f"llama.cpp could not create a context for {gguf_path}")
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(_TOKENS_PER_STEP, 0, 1)

    def run(
        self, requests: Sequence[BenchRequest], batch_size: int, on_record: OnRecord | None = None
    ) -> RunResult:
        if batch_size > self.max_batch_size:
            raise ValueError(f"batch size {batch_size} > this context's {self.max_batch_size} sequences")
        self.lib.llama_memory_clear(self.memory, True)
        waiting = deque(requests)
        free_ids = list(range(batch_size))
        running: list[_Slot] = []
        records: list[RequestRecord] = []
        while waiting or running:
            while waiting and free_ids:
                running.append(_Slot(waiting.popleft(), free_ids.pop(0), time.perf_counter()))
            sampled = self._step(running)
            now = time.perf_counter()
            for slot in sampled:
                slot.times.append(now)
            for slot in [s for s in running if len(s.times) >= s.request.output_tokens]:
                running.remove(slot)
                self.lib.llama_memory_seq_rm(self.memory, slot.seq_id, -1, -1)
                free_ids.append(slot.seq_id)
                record = _record(slot)
                records.append(record)
                if on_record is not None:
                    on_record(record)
        return batch_result(self, batch_size, records, mode="closed")

    def _step(self, running: list[_Slot]) -> list[_Slot]:
        """One llama_decode: a decode token for every generating slot, then prompt chunks; returns the slots
        that sampled a token."""
        batch, rows = self.batch, []
        num_tokens = 0

        def add(slot: _Slot, token: int, pos: int, wants_logits: bool) -> None:
            nonlocal num_tokens
            batch.token[num_tokens], batch.pos[num_tokens] = token, pos
            batch.n_seq_id[num_tokens], batch.seq_id[num_tokens][0] = 1, slot.seq_id
            batch.logits[num_tokens] = 1 if wants_logits else 0
            if wants_logits:
                rows.append((num_tokens, slot))
            num_tokens += 1

        for slot in running:
            if not slot.prefilling:
                add(slot, slot.last_token, len(slot.prompt) + len(slot.times) - 1, True)
        for slot in running:
            if slot.prefilling and num_tokens < _TOKENS_PER_STEP:
                take = min(len(slot.prompt) - slot.num_fed, _TOKENS_PER_STEP - num_tokens)
                for offset in range(take):
                    pos = slot.num_fed + offset
                    add(slot, slot.prompt[pos], pos, pos == len(slot.prompt) - 1)
                slot.num_fed += take
        batch.n_tokens = num_tokens
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise PipelineError(f"llama_decode failed with status {status} ({num_tokens} tokens)")
        for row, slot in rows:
            logits = np.ctypeslib.as_array(
                self.lib.llama_get_logits_ith(self.ctx, row), shape=(self.vocab_size,)
            )
            logits[self.eos_id] = -np.inf  # forced output length: never end early
            slot.last_token = int(logits.argmax())
        return [slot for _, slot in rows]

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def _record(slot: _Slot) -> RequestRecord:
    return RequestRecord(
        index=slot.request.index,
        num_input_tokens=len(slot.prompt),
        start=slot.start,
        end=slot.times[-1],
        response_times=slot.times,
        response_tokens=[1] * len(slot.times),
        num_expected_tokens=slot.request.output_tokens,
    )


_LOG_CALLBACK: Any = None


def _silence(lib: Any) -> None:
    """Route llama.cpp's log lines (several per decode at load) to nowhere."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        # kept referenced: llama.cpp holds the pointer for the life of the process
        _LOG_CALLBACK = lib.llama_log_callback(lambda level, text, user_data: None)
    lib.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
