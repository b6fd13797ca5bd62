"""A folder shaped like `trtllm-build`'s output, for tests on machines without TensorRT-LLM.

Layout as NVIDIA/TensorRT-LLM:tensorrt_llm/builder.py@008b2b8 writes it: `Engine.save` puts `config.json`
(`EngineConfig.to_dict`: `version`, `pretrained_config`, `build_config`, with `kv_cache_type` by enum name
and every PluginConfig field under `build_config.plugin_config`) and one `rank{r}.engine` per rank. The
engine files hold a few placeholder bytes: nothing here deserializes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def engine_config(
    *, tp: int = 1, pp: int = 1, version: str = "1.1.0", quant_algo: str | None = None, **build: Any
) -> dict[str, Any]:
    plugin = {
        "dtype": "float16", "gpt_attention_plugin": "auto", "gemm_plugin": "auto", "remove_input_padding": True,
        "context_fmha": True, "paged_kv_cache": True, "tokens_per_block": 16, "use_paged_context_fmha": True,
        "multiple_profiles": False,
    }  # fmt: skip
    plugin.update(build.pop("plugin_config", {}))
    build_config = {
        "max_input_len": 256, "max_seq_len": 1024, "opt_batch_size": 8, "max_batch_size": 16,
        "max_beam_width": 1, "max_num_tokens": 512, "opt_num_tokens": None, "max_prompt_embedding_table_size": 0,
        "kv_cache_type": "PAGED", "gather_context_logits": False, "gather_generation_logits": False,
        "strongly_typed": True, "max_draft_len": 0, "speculative_decoding_mode": 1, "use_refit": False,
        "lora_config": {}, "auto_parallel_config": {}, "weight_sparsity": False, "weight_streaming": False,
        "plugin_config": plugin, "use_strip_plan": False, "max_encoder_input_len": 1024, "monitor_memory": False,
        "use_mrope": False,
    }  # fmt: skip
    build_config.update(build)
    pretrained = {
        "architecture": "LlamaForCausalLM", "dtype": "float16", "vocab_size": 256, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "mapping": {"world_size": tp * pp, "gpus_per_node": 8, "cp_size": 1, "tp_size": tp, "pp_size": pp,
                    "moe_tp_size": tp, "moe_ep_size": 1},
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None, "group_size": 128},
    }  # fmt: skip
    return {"version": version, "pretrained_config": pretrained, "build_config": build_config}


def write_engine_dir(out: Path, config: dict[str, Any] | None = None) -> Path:
    """config.json plus rank{r}.engine for every rank of its mapping; returns `out`."""
    config = config or engine_config()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=4))
    for rank in range(config["pretrained_config"]["mapping"]["world_size"]):
        (out / f"rank{rank}.engine").write_bytes(b"ftrt" + bytes([rank]) * 60)
    return out


# The limits engine_config() builds with, as a build config states them.
ENGINE_SECTION = {"max_batch_size": 16, "max_input_len": 256, "max_seq_len": 1024, "max_num_tokens": 512}


def write_build_config(path: Path, hf_dir: Path, **sections: Any) -> Path:
    """A trtllm build config (YAML, JSON syntax) describing engine_config()'s engine, with the tokenizer of
    `hf_dir`; `sections` replace or extend its sections."""
    data: dict[str, Any] = {
        "name": path.stem,
        "backend": "trtllm",
        "dtype": "float16",
        "source": {"kind": "local", "path": str(hf_dir)},
        "engine": dict(ENGINE_SECTION),
        "kv_cache": {"tokens_per_block": 16, "max_tokens": 16384},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path.write_text(json.dumps(data))
    return path
