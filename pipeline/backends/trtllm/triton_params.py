"""The `parameters { ... }` block of Triton's `tensorrt_llm` model (backend "tensorrtllm"), from a BuildConfig.

Every key is a parameter the C++ tensorrtllm backend reads (the template
`all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt` of triton-inference-server/tensorrtllm_backend
@v0.18.0, checked against its `inflight_batcher_llm/src/model_instance_state.cc`). Values are the strings
that go into `string_value`; the serving helper renders them into the shared config.pbtxt template.

Only parameters the config decides are emitted: a key left out makes the backend use its own default
(it logs "... is not specified, will use default"), which is the behaviour we want for anything llmpipe
does not configure. Placeholders are never returned, so nothing `${...}` can leak into a rendered file.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config.build_config import BuildConfig
from pipeline.serving.repository.engine_parameters import engine_parameters, pbtxt_flag

# Fixed values every template of the pinned releases carries verbatim (not `${...}` placeholders).
FIXED_PARAMETERS: dict[str, str] = {
    "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
    "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
    # Read with no fallback since tensorrtllm_backend v0.19 (a missing key fails the model's load:
    # NVIDIA/TensorRT-LLM:triton_backend/inflight_batcher_llm/src/model_instance_state.cc,
    # getGuidedDecodingConfigFromParams); an empty value means no guided decoding, which llmpipe
    # does not configure.
    "tokenizer_dir": "",
    "xgrammar_tokenizer_info_path": "",
    "guided_decoding_backend": "",
}

# speculative.mode -> the backend's `decoding_mode`. draft_model is absent on purpose: the target engine is
# built with draft_tokens_external and the executor picks the matching mode itself; the backend's
# string parser has no value for it (model_instance_state.cc accepts only the ones below).
_SPEC_DECODING_MODE: dict[str, str] = {"lookahead": "lookahead", "medusa": "medusa", "eagle": "eagle"}


def decoding_mode(cfg: BuildConfig) -> str | None:
    """The backend's decoding_mode for this config, or None to let the executor choose (draft-target)."""
    mode = cfg.speculative.mode
    if mode in _SPEC_DECODING_MODE:
        return _SPEC_DECODING_MODE[mode]
    if mode == "draft_model":
        return None
    return "beam_search" if cfg.engine.max_beam_width > 1 else "top_k_top_p"


def tensorrt_llm_parameters(cfg: BuildConfig, engine_dir: Path | str) -> dict[str, str]:
    """Parameter name -> string value for the `tensorrt_llm` model serving the engine in `engine_dir`.

    `engine_dir` is written as given: pass the path the server will see (inside the container, if any).
    """
    params = dict(FIXED_PARAMETERS)
    params.update(
        {
            "gpt_model_type": "inflight_fused_batching",
            "gpt_model_path": str(engine_dir),
            **engine_parameters(cfg),
        }
    )
    mode = decoding_mode(cfg)
    if mode is not None:
        params["decoding_mode"] = mode
    if cfg.speculative.mode == "lookahead":
        spec = cfg.speculative
        params["lookahead_window_size"] = str(spec.lookahead_window_size)
        params["lookahead_ngram_size"] = str(spec.lookahead_ngram_size)
        params["lookahead_verification_set_size"] = str(spec.lookahead_verification_set_size)
    return dict(sorted(params.items()))


def tensorrt_llm_header(cfg: BuildConfig) -> dict[str, str]:
    """Values for the non-parameter placeholders of the tensorrt_llm template: its header (batch size,
    decoupled mode, queueing, data types), which tensorrtllm_backend fills with `tools/fill_template.py`."""
    serving = cfg.serving
    return {
        "triton_backend": "tensorrtllm",
        "triton_max_batch_size": str(serving.triton_max_batch_size or cfg.engine.max_batch_size),
        "decoupled_mode": pbtxt_flag(serving.decoupled),
        "max_queue_delay_microseconds": str(serving.max_queue_delay_microseconds),
        "max_queue_size": str(serving.max_queue_size),
        "encoder_input_features_data_type": "TYPE_FP16",
        "logits_datatype": "TYPE_FP32",
    }
