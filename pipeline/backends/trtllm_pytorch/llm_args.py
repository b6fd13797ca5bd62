"""The build config as TensorRT-LLM LLM API arguments (TorchLlmArgs, release 1.1.0), and the two files that
carry them: the Triton llmapi model's model.yaml and trtllm-serve's --extra_llm_api_options YAML.

One function maps the config sections to upstream's field names; every output is checked against the
recorded interface (upstream.py) before it is returned, so a name upstream does not have fails here.

    parallel     -> tensor_parallel_size, pipeline_parallel_size
    engine       -> max_batch_size, max_input_len, max_seq_len, max_num_tokens, max_beam_width,
                    cuda_graph_config.max_batch_size
    kv_cache     -> kv_cache_config.{tokens_per_block, max_tokens, free_gpu_memory_fraction, enable_block_reuse}
    quantization -> kv_cache_config.dtype (the weights' format travels in the checkpoint's hf_quant_config.json)
    scheduler    -> scheduler_config.capacity_scheduler_policy, enable_chunked_prefill
    speculative  -> speculative_config (DraftTarget or NGram)
    serving      -> stream_interval
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.backends.trtllm_pytorch.upstream import check_argv, check_mapping
from pipeline.config.build_config import BuildConfig
from pipeline.config.workdir import draft_engine_dir
from pipeline.errors import ConfigError

LLM_API_ARGS_FILE = "llm_api_args.yaml"
TRTLLM_SERVE_OPTIONS_FILE = "trtllm_serve.yaml"
# SchedulerConfig.capacity_scheduler_policy spells llmpipe's scheduler.policy in capitals.
CAPACITY_SCHEDULER_POLICY = {
    "guaranteed_no_evict": "GUARANTEED_NO_EVICT",
    "max_utilization": "MAX_UTILIZATION",
}
# The upstream model.yaml names the backend; older llmapi model.py versions pick the LLM class by it.
MODEL_YAML_BACKEND = "pytorch"


def _kv_cache_config(cfg: BuildConfig) -> dict[str, Any]:
    kv = cfg.kv_cache
    config: dict[str, Any] = {
        "tokens_per_block": kv.tokens_per_block,
        "free_gpu_memory_fraction": kv.free_memory_fraction,
        # Written even when it matches llmpipe's default: upstream's default is the opposite (reuse on).
        "enable_block_reuse": kv.enable_block_reuse,
        "dtype": cfg.quantization.kv_cache_dtype,
    }
    if kv.max_tokens is not None:
        config["max_tokens"] = kv.max_tokens
    return config


def draft_model_dir(cfg: BuildConfig, *, require_built: bool = True) -> Path:
    """The draft build's engine folder, which holds its HF checkpoint: what DraftTarget loads as
    speculative_model_dir. The draft must be a trtllm_pytorch build (a torch or trtllm engine is not an HF
    checkpoint)."""
    draft, folder = draft_engine_dir(cfg, require_built=require_built)
    if draft.backend != "trtllm_pytorch":
        raise ConfigError(
            f"speculative.draft_config={cfg.speculative.draft_config} builds backend={draft.backend}; the PyTorch "
            "backend's draft model is an HF checkpoint, which only a backend=trtllm_pytorch build leaves",
            hint="Set backend: trtllm_pytorch in the draft's build config and build it.",
        )
    return folder


def _speculative_config(cfg: BuildConfig, require_built: bool) -> dict[str, Any] | None:
    spec = cfg.speculative
    if spec.mode == "ngram":
        return {
            "decoding_type": "NGram",
            "max_draft_len": spec.max_draft_len,
            "max_matching_ngram_size": spec.ngram.max_match,
        }
    if spec.mode == "draft_model":
        return {
            "decoding_type": "DraftTarget",
            "max_draft_len": spec.max_draft_len,
            "speculative_model_dir": str(draft_model_dir(cfg, require_built=require_built)),
        }
    return None  # the config check refuses the other modes for this backend


def llm_api_args(cfg: BuildConfig, model_dir: Path | str, *, require_built: bool = True) -> dict[str, Any]:
    """`LLM(**args)` for this build, loading the checkpoint in `model_dir`. With `require_built=False` (the
    dry-run plan) a draft model need not be built yet."""
    e, s = cfg.engine, cfg.scheduler
    args: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": cfg.dtype,
        "trust_remote_code": cfg.source.trust_remote_code,
        "tensor_parallel_size": cfg.parallel.tp_size,
        "pipeline_parallel_size": cfg.parallel.pp_size,
        "max_batch_size": e.max_batch_size,
        "max_input_len": e.max_input_len,
        "max_seq_len": e.max_seq_len,
        "max_num_tokens": e.max_num_tokens,
        "max_beam_width": e.max_beam_width,
        "enable_chunked_prefill": s.enable_chunked_context,
        "stream_interval": cfg.serving.stream_interval,
        "scheduler_config": {"capacity_scheduler_policy": CAPACITY_SCHEDULER_POLICY[s.policy]},
        "kv_cache_config": _kv_cache_config(cfg),
        # CUDA graphs for every batch size up to the engine's, none past it (upstream captures up to 128).
        "cuda_graph_config": {"max_batch_size": e.max_batch_size, "enable_padding": True},
    }
    speculative = _speculative_config(cfg, require_built)
    if speculative is not None:
        args["speculative_config"] = speculative
    check_mapping(args)
    return args


def model_yaml(cfg: BuildConfig, checkpoint_dir: Path | str) -> dict[str, Any]:
    """The llmapi Triton model's 1/model.yaml: the LLM API arguments plus triton_config. The model takes one
    prompt per request (max_batch_size 0, as upstream's file sets it); the LLM API batches in flight."""
    document = {
        **llm_api_args(cfg, checkpoint_dir),
        "backend": MODEL_YAML_BACKEND,
        "triton_config": {"max_batch_size": 0, "decoupled": cfg.serving.decoupled},
    }
    check_mapping(document, "model.yaml")
    return document


def trtllm_serve_options(cfg: BuildConfig, model_dir: Path | str) -> dict[str, Any]:
    """trtllm-serve's --extra_llm_api_options file: the same arguments; the model is its command-line
    argument."""
    options = llm_api_args(cfg, model_dir)
    del options["model"]
    return options


def trtllm_serve_argv(cfg: BuildConfig, model_dir: Path | str, options_file: Path | str) -> list[str]:
    s = cfg.serving
    argv = [
        "trtllm-serve", "serve", str(model_dir), "--backend", "pytorch", "--host", s.host,
        "--port", str(s.http_port), "--extra_llm_api_options", str(options_file),
    ]  # fmt: skip
    check_argv(argv)
    return argv
