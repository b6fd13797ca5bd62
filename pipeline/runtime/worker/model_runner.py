"""ModelRunner: the only part of the engine that touches tensors. It turns a SchedulerOutput into one
flattened batch, runs the model over the paged KV cache, and samples the rows that need a token; `score`
returns the logits of every position of a given sequence (teacher forcing) through the same path."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from pipeline.errors import ConfigError
from pipeline.runtime.core.outputs import LogitsRows, RunnerOutput, SchedulerOutput
from pipeline.runtime.engine.engine_args import AttentionChoice, RunnerArgs
from pipeline.runtime.engine_config import EngineConfig, load_engine_config
from pipeline.runtime.kernels import ops as kernels
from pipeline.runtime.kernels.build import has_wide_vectors
from pipeline.runtime.model.attention import Attention, KernelAttention, LayerAttention, TorchAttention
from pipeline.runtime.model.decoder import DecoderModel
from pipeline.runtime.model.greedy_head import GreedyLMHead
from pipeline.runtime.model.layers import ResidualRMSNorm
from pipeline.runtime.model.loader import load_model_weights
from pipeline.runtime.model.rope import layer_cos_sin
from pipeline.runtime.model.weights import LayerWeights, ModelWeights
from pipeline.runtime.worker.attn_metadata import SequenceChunk, build_attention_metadata
from pipeline.runtime.worker.kv_cache import KVCache, blocks_per_sequence, num_kv_blocks
from pipeline.runtime.worker.kv_quant import check_kv_quant_algo
from pipeline.runtime.worker.sampler import Sampler, SampleRow, accept_drafts

logger = logging.getLogger(__name__)

# Timed passes of each option when choosing how one-row steps run (threads, vector width, prefetch distance):
# the fastest counts.
SINGLE_ROW_PROBE_REPEATS = 5
T = TypeVar("T")


def _fastest(options: Sequence[T], use: Callable[[T], object], run: Callable[[], object]) -> T:
    """The option (applied by `use`) under which `run` takes least time, left applied: SINGLE_ROW_PROBE_REPEATS
    timings of each after a warm-up, the options taking turns so that load from elsewhere lands on all; ties go
    to the first."""
    best = dict.fromkeys(options, math.inf)
    with torch.inference_mode():
        use(options[0])
        run()  # first calls pay for kernel loading and page faults
        for _ in range(SINGLE_ROW_PROBE_REPEATS):
            for option in options:
                use(option)
                start = time.perf_counter()
                run()
                best[option] = min(best[option], time.perf_counter() - start)
    fastest = min(options, key=best.__getitem__)
    use(fastest)
    return fastest


_MODEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but no CUDA device is available", hint="use device=cpu or auto")
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not supported; use cpu, cuda or auto")
    return resolved


class ModelRunner:
    """Loads an engine directory's model onto `device` and executes scheduler steps.

    Compute dtype: the model's dtype on CUDA. On CPU fp32, except that a bfloat16 engine keeps its decoder
    layers' linear weights in bf16 and feeds them bf16-rounded activations (fp32 accumulation; twice the
    fp32 FMA rate where the CPU has AVX512_BF16); norms, attention, the KV cache and the head's arithmetic stay
    fp32 (a bf16 lm_head is read as stored and widened exactly).
    `RunnerArgs.num_threads` sets torch's (process-wide) thread count.
    `attention`: "kernel" = the compiled paged-attention kernel (CPU, fp32), "torch" = the portable torch path,
    "auto" = the kernel when it applies and builds. The KV cache is int8 when the engine's
    kv_cache_quant_algo is INT8 (both attention paths read and write it). The runner keeps no per-request
    state (sampling randomness is keyed by seed and position), so `finished_request_ids` needs no handling.
    """

    def __init__(self, engine_config: EngineConfig, args: RunnerArgs | None = None) -> None:
        args = args or RunnerArgs()
        self.config = engine_config
        self.device = resolve_device(args.device)
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        model_cfg, build, runtime = engine_config.model, engine_config.build, engine_config.runtime
        self.kv_int8 = check_kv_quant_algo(model_cfg.quantization.kv_cache_quant_algo)
        self.dtype = torch.float32 if self.device.type == "cpu" else _MODEL_DTYPES[model_cfg.dtype]
        # fp16 stays fp32 on CPU: no CPU here multiplies fp16 faster than fp32.
        self.layer_weight_dtype = (
            torch.bfloat16 if self.device.type == "cpu" and model_cfg.dtype == "bfloat16" else self.dtype
        )
        # A bf16 engine's KV cache is bf16 too (TensorRT-LLM's default: the model dtype): half the bytes
        # that c=16 decode steps stream through attention, twice the tokens in the same memory.
        kv_dtype = self.layer_weight_dtype
        self.tokens_per_block = build.plugin_config.tokens_per_block
        weights = load_model_weights(
            engine_config,
            self.device,
            self.dtype,
            self.layer_weight_dtype,
            widened_head=self.device.type == "cpu" and kernels.kernels_available(),
        )
        # Sized after the weights are in memory, so "free memory" is what the cache can really use.
        self.num_kv_blocks = num_kv_blocks(
            model_cfg,
            self.tokens_per_block,
            kv_dtype,
            self.device,
            max_tokens=args.kv_max_tokens if args.kv_max_tokens is not None else runtime.kv_max_tokens,
            free_memory_fraction=args.kv_free_memory_fraction
            if args.kv_free_memory_fraction is not None
            else runtime.kv_free_memory_fraction,
            max_useful_blocks=build.max_batch_size
            * blocks_per_sequence(build.max_seq_len + build.max_draft_len, self.tokens_per_block),
            int8=self.kv_int8,
        )
        self.max_positions = min(model_cfg.max_position_embeddings, build.max_seq_len + build.max_draft_len)
        use_kernel = self._use_kernel(args.attention)
        self.kv_cache = KVCache(
            model_cfg,
            self.num_kv_blocks,
            self.tokens_per_block,
            kv_dtype,
            self.device,
            zero=not use_kernel,
            int8=self.kv_int8,
        )
        self.attention_backend = "kernel" if use_kernel else "torch"
        self.model = self._assemble(weights, use_kernel)
        one_row_pass = self._decode_pass(weights.layers[0], 1)  # builds the inputs, runs nothing
        self.single_row_threads = (
            args.single_row_threads
            if args.single_row_threads is not None
            else self._faster_single_row_threads(one_row_pass)
        )
        self.wide_single_row = self._faster_one_row_vectors(one_row_pass)
        self.far_prefetch = self._faster_prefetch(one_row_pass, self._decode_pass(weights.layers[0], 4))
        self.sampler = Sampler(args.seed)
        logger.info(
            "model runner: %s on %s (%s, layer weights %s), %d KV blocks of %d tokens (%s, %.2f GiB), "
            "attention=%s; timed here: one-row steps on %d thread(s)%s, weights prefetched %s",
            model_cfg.architecture,
            self.device,
            self.dtype,
            self.layer_weight_dtype,
            self.num_kv_blocks,
            self.tokens_per_block,
            "int8" if self.kv_int8 else kv_dtype,
            self.kv_cache.num_bytes / 2**30,
            self.attention_backend,
            self.single_row_threads,
            " with 512-bit vectors" if self.wide_single_row else "",
            "far ahead into L2" if self.far_prefetch else "one block ahead into L1",
        )

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, args: RunnerArgs | None = None) -> ModelRunner:
        return cls(load_engine_config(engine_dir), args)

    def _use_kernel(self, attention: AttentionChoice) -> bool:
        if attention not in ("auto", "kernel", "torch"):
            raise ConfigError(f"attention={attention!r} is invalid: choose auto, kernel or torch")
        if attention == "torch":
            return False
        if not (
            self.device.type == "cpu"
            and self.dtype == torch.float32
            and KernelAttention.supports(self.config.model)
        ):
            why = "it needs CPU, fp32 and a head_dim that is a multiple of 8 up to 256"
        elif kernels.kernels_available():
            return True
        else:
            why = kernels.kernels_unavailable_reason()
        if attention == "kernel":
            raise ConfigError(f"attention=kernel is unavailable here: {why}")
        return False

    def _assemble(self, weights: ModelWeights, use_kernel: bool) -> DecoderModel:
        model_cfg = self.config.model
        tables = layer_cos_sin(model_cfg, self.max_positions)
        on_device = {id(t): t.to(self.device) for t in tables}  # layers of one kind share their table
        layers = [
            LayerAttention(on_device[id(cos_sin)], model_cfg.layer_window(i), layer.q_norm, layer.k_norm)
            for i, (cos_sin, layer) in enumerate(zip(tables, weights.layers, strict=True))
        ]
        attention: Attention = (
            KernelAttention(self.kv_cache, model_cfg, layers)
            if use_kernel
            else TorchAttention(self.kv_cache, model_cfg, layers)
        )
        norm = ResidualRMSNorm(use_kernel, model_cfg.hidden_size, model_cfg.norm_epsilon)
        return DecoderModel(model_cfg, weights, attention, norm, GreedyLMHead.for_lm_head(weights.lm_head))

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        with self._threads_for(scheduler_output.num_batched_tokens):
            return self._execute(scheduler_output)

    def _faster_single_row_threads(self, one_row_pass: Callable[[], object]) -> int:
        """1 or torch's thread count, whichever runs `one_row_pass` faster on this machine. Why measured, not
        fixed: a decode step opens ~60 OpenMP regions, and waking the workers for each costs more than the
        share of work they take over when the layers are small (SmolLM2's int8 / int4 layers on 2 vCPUs of an
        AVX2-only EPYC: one thread 1.3x / 1.1x faster) and less when they are large (every SmolLM2 engine on 2
        vCPUs of a Zen 5: two threads 1.3-1.8x faster); where that line falls depends on the CPU's cores,
        caches and memory bandwidth. (Timing a bf16 layer's linears alone, oneDNN's GEMVs rather than the
        kernel a step runs, picked one thread in 4 of 6 loads there, for steps 1.5x slower than two threads'.)"""
        threads = torch.get_num_threads()
        if self.device.type != "cpu" or threads == 1:
            return threads
        try:
            return _fastest((threads, 1), torch.set_num_threads, one_row_pass)
        finally:
            torch.set_num_threads(threads)

    def _faster_one_row_vectors(self, one_row_pass: Callable[[], object]) -> bool:
        """Whether one-row steps run the kernels' 512-bit form, as timed here (AVX-512 builds: faster on some
        CPUs, slower on those that split 512-bit ops; the same results either way). Sets it, process-wide."""
        if not (self.device.type == "cpu" and has_wide_vectors() and kernels.kernels_available()):
            return False
        with self._threads_for(1):
            return _fastest((False, True), kernels.set_wide_single_row, one_row_pass)

    def _faster_prefetch(
        self, one_row_pass: Callable[[], object], four_row_pass: Callable[[], object]
    ) -> bool:
        """Whether the kernels prefetch every weight stream far ahead into L2, as timed here on a one-row and a
        four-row step together: the better distance follows the CPU's memory system (on Zen 4 far ahead ran
        fp32 layers 1.16x and bf16 and int8 ones 1.1-1.5x faster at 1-4 rows; on an AMX Xeon one block ahead
        into L1 was faster for fp32 at one row and for int8 at 4-8). The same results either way. Sets it,
        process-wide."""
        if not (self.device.type == "cpu" and kernels.kernels_available()):
            return False

        def both_passes() -> None:
            with self._threads_for(1):
                one_row_pass()
            four_row_pass()

        return _fastest((False, True), kernels.set_far_prefetch, both_passes)

    def _decode_pass(self, layer: LayerWeights, rows: int) -> Callable[[], object]:
        """What a decode step of `rows` rows runs beside attention: the fused decoder kernel over every layer
        and the greedy lm_head where the model has them, else `layer`'s linears."""
        model = self.config.model
        gen = torch.Generator().manual_seed(0)
        fused, head = self.model.fused, self.model.greedy_head
        if fused is not None:
            hidden = torch.randn(rows, model.hidden_size, generator=gen)
            attention_out = torch.randn(rows, model.num_attention_heads * model.head_dim, generator=gen)
            final_norm = self.model.weights.final_norm

            def decode_step() -> object:
                out = fused.forward_without_attention(hidden.clone(), attention_out)
                return head(self.model.norm(out, None, final_norm)) if head is not None else out

            return decode_step
        inputs = [
            (layer.qkv, model.hidden_size),
            (layer.dense, model.num_attention_heads * model.head_dim),
            (layer.gate_up, model.hidden_size),
            (layer.proj, model.intermediate_size),
        ]
        # A sparse layer has no dense MLP: its attention projections alone decide.
        linears = [
            (linear, torch.randn(rows, width, dtype=self.dtype, generator=gen))
            for linear, width in inputs
            if linear is not None
        ]
        return lambda: [linear(x) for linear, x in linears]

    @contextlib.contextmanager
    def _threads_for(self, num_rows: int) -> Iterator[None]:
        """Steps of one row run on `single_row_threads` (torch's thread count is process-wide: restored
        after the step). A single-threaded step also leaves the other cores to the serving processes."""
        threads = torch.get_num_threads()
        if self.device.type != "cpu" or num_rows > 1 or self.single_row_threads == threads:
            yield
            return
        torch.set_num_threads(self.single_row_threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        chunks: list[SequenceChunk] = []
        input_ids: list[int] = []
        offsets: list[int] = []  # where each request's tokens start in the flattened batch
        sample_positions: list[int] = []  # rows of the flattened batch whose next token is sampled
        sample_rows: list[SampleRow] = []
        for sched in scheduler_output.scheduled:
            request = sched.request
            start, drafts = request.num_computed_tokens, sched.num_draft_tokens
            tokens = request.token_ids[start : start + sched.num_new_tokens]
            if drafts:
                tokens = tokens + request.draft_token_ids[:drafts]
            chunks.append(SequenceChunk(start, len(tokens), request.block_table))
            offsets.append(len(input_ids))
            input_ids.extend(tokens)
            if sched.sample:
                end = len(input_ids)
                sample_positions.extend(range(end - drafts - 1, end))
                sample_rows.extend(SampleRow(request, i) for i in range(drafts + 1))
        if not chunks:
            return RunnerOutput(sampled_token_ids=[])
        hidden = self._forward(chunks, input_ids)
        context = self._context_logits(scheduler_output, offsets, hidden)
        if not sample_rows:
            return RunnerOutput(sampled_token_ids=[[] for _ in chunks], context_logits=context)
        rows = hidden.index_select(0, torch.tensor(sample_positions, dtype=torch.int64, device=self.device))
        if all(row.greedy_with_bans_only for row in sample_rows):
            greedy = self.model.greedy_tokens(rows)
            if greedy is not None:
                output = _split_per_request(
                    scheduler_output, self._respect_bans(greedy, rows, sample_rows), None, None
                )
                output.context_logits = context
                return output
        logits = self.model.compute_logits(rows)  # [num_sample_rows, vocab]
        token_ids, logprobs = self.sampler(logits, sample_rows)
        generation = (
            [_numpy(logits[i]) if row.params.generation_logits else None for i, row in enumerate(sample_rows)]
            if any(row.params.generation_logits for row in sample_rows)
            else None
        )
        output = _split_per_request(scheduler_output, token_ids, logprobs, generation)
        output.context_logits = context
        return output

    def _context_logits(
        self, scheduler_output: SchedulerOutput, offsets: list[int], hidden: torch.Tensor
    ) -> list[LogitsRows | None] | None:
        """The logits of the prompt positions this step computes, for the requests that asked for them
        (SamplingParams.context_logits); None when none did."""
        found: list[LogitsRows | None] = []
        for sched, offset in zip(scheduler_output.scheduled, offsets, strict=True):
            request = sched.request
            start = request.num_computed_tokens
            end = min(start + sched.num_new_tokens, request.num_prompt_tokens)
            if not request.sampling_params.context_logits or end <= start:
                found.append(None)
                continue
            logits = self.model.compute_logits(hidden[offset : offset + end - start])  # [end - start, vocab]
            found.append(LogitsRows(start, _numpy(logits)))
        return found if any(f is not None for f in found) else None

    def _respect_bans(self, tokens: list[int], rows: torch.Tensor, sample_rows: list[SampleRow]) -> list[int]:
        """Unprocessed greedy `tokens` with the rows whose token is banned (e.g. the end id before
        min_tokens, which benchmarks force) redone through full logits and the sampler: banning tokens other
        than the argmax cannot change it, so only those rows need the logits."""
        clashes = [
            i
            for i, (token, row) in enumerate(zip(tokens, sample_rows, strict=True))
            if token in row.banned_tokens()
        ]
        if clashes:
            index = torch.tensor(clashes, dtype=torch.int64, device=self.device)
            redone, _ = self.sampler(
                self.model.compute_logits(rows.index_select(0, index)), [sample_rows[i] for i in clashes]
            )
            for i, token in zip(clashes, redone, strict=True):
                tokens[i] = token
        return tokens

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int], block_table: list[int]) -> torch.Tensor:
        """Teacher-forced logits at every position of `token_ids` (row i predicts token i + 1): [T, vocab]
        fp32 on the runner's device. `block_table` comes from the block manager, with room for all T tokens;
        their K/V overwrite those blocks. The sequence runs as prefill chunks of at most max_num_tokens,
        like an engine step with chunked context, so scoring needs no more memory than serving."""
        num_tokens = len(token_ids)
        if num_tokens == 0:
            raise ValueError("score needs at least one token")
        if len(block_table) * self.tokens_per_block < num_tokens:
            raise ValueError(
                f"block table of {len(block_table)} blocks cannot hold {num_tokens} tokens "
                f"({self.tokens_per_block} per block)"
            )
        step = self.config.build.max_num_tokens
        logits = []
        for start in range(0, num_tokens, step):
            chunk = list(token_ids[start : start + step])
            hidden = self._forward([SequenceChunk(start, len(chunk), block_table)], chunk)
            logits.append(self.model.compute_logits(hidden))
        return torch.cat(logits)

    def _forward(self, chunks: list[SequenceChunk], input_ids: list[int]) -> torch.Tensor:
        """The flattened batch of `chunks` (input_ids in chunk order) through the model, K/V written to the
        cache: final hidden states [T, hidden]."""
        meta = build_attention_metadata(
            chunks,
            self.tokens_per_block,
            self.device,
            padded=self.attention_backend == "torch",
            windows=self.config.model.windows,
            num_blocks=self.num_kv_blocks,
        )
        # The attention kernel indexes the RoPE table and the cache without checking each position.
        if meta.max_context_len > self.max_positions:
            raise ValueError(
                f"position {meta.max_context_len - 1} is beyond the engine's {self.max_positions}"
            )
        return self.model.forward(torch.tensor(input_ids, dtype=torch.int64, device=self.device), meta)


def _numpy(logits: torch.Tensor) -> np.ndarray:
    return logits.float().cpu().numpy()


def _split_per_request(
    scheduler_output: SchedulerOutput,
    token_ids: list[int],
    logprobs: list[float] | None,
    generation: list[np.ndarray | None] | None,
) -> RunnerOutput:
    """Per-row results -> per-request ones: the accepted tokens and their log-probs and logits rows."""
    sampled: list[list[int]] = []
    sampled_logprobs: list[list[float]] = []
    sampled_logits: list[np.ndarray | None] = []
    row = 0
    for sched in scheduler_output.scheduled:
        if not sched.sample:
            sampled.append([])
            sampled_logprobs.append([])
            sampled_logits.append(None)
            continue
        count = sched.num_draft_tokens + 1
        accepted = accept_drafts(
            token_ids[row : row + count], sched.request.draft_token_ids[: sched.num_draft_tokens]
        )
        sampled.append(accepted)
        if logprobs is not None:
            sampled_logprobs.append(logprobs[row : row + len(accepted)])
        rows = [r for r in generation[row : row + len(accepted)] if r is not None] if generation else []
        sampled_logits.append(np.stack(rows) if rows else None)  # [accepted, vocab]
        row += count
    return RunnerOutput(
        sampled_token_ids=sampled,
        logprobs=sampled_logprobs if logprobs is not None else None,
        generation_logits=sampled_logits if generation is not None else None,
    )
