"""convert (torch backend): a Hugging Face Llama-family checkpoint -> a TensorRT-LLM-style checkpoint
directory: `config.json` (pretrained_config fields at top level), `rank0.safetensors` in the runtime's
layout (fused qkv and gate/up, tied embeddings written out) and `tokenizer/`."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.config.build_config import BuildConfig
from pipeline.errors import ConfigError, IntegrityError, UnsupportedModelError
from pipeline.runtime.engine_config import (
    ROPE_TYPES,
    TOKENIZER_DIR,
    WEIGHTS_FILE,
    hf_rope,
    model_config_from_dict,
    rope_type,
)
from pipeline.runtime.model.loader import expected_dense_shapes
from pipeline.runtime.model.weight_names import GLOBAL_WEIGHTS, LAYER_WEIGHTS, QKV_BIAS_WEIGHTS
from pipeline.sources import SUPPORTED_ARCHITECTURES
from pipeline.sources.local import inspect_local_checkpoint
from pipeline.sources.tokenizer import copy_tokenizer

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# HF buffers some older checkpoints saved; recomputed by the runtime.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def convert(cfg: BuildConfig, hf_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Write the checkpoint for `cfg` from the HF folder `hf_dir` into `out_dir`; return facts about it."""
    started = time.perf_counter()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    local = inspect_local_checkpoint(hf_dir, allow_pickle=cfg.source.allow_pickle)
    pretrained = pretrained_config_from_hf(local.config, resolve_dtype(cfg, local.config))
    check_limits(cfg, pretrained)

    out_dir.mkdir(parents=True, exist_ok=True)
    with open_hf_tensors(hf_dir, local.weight_files) as tensors:
        weights = runtime_weights(tensors, pretrained)
    num_params = sum(t.numel() for name, t in weights.items() if not _is_tied_copy(name, pretrained))
    save_file(weights, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer_files = copy_tokenizer(hf_dir, out_dir / TOKENIZER_DIR)
    (out_dir / "config.json").write_text(json.dumps(pretrained, indent=2) + "\n", encoding="utf-8")
    return {
        "architecture": pretrained["architecture"],
        "dtype": pretrained["dtype"],
        "num_params": num_params,
        "num_layers": pretrained["num_hidden_layers"],
        "tied_embeddings": pretrained["tie_word_embeddings"],
        "rotary_scaling": rope_type(pretrained["rotary_scaling"]),
        "weights_bytes": (out_dir / WEIGHTS_FILE).stat().st_size,
        "tokenizer_files": tokenizer_files,
        "seconds": round(time.perf_counter() - started, 2),
    }


def resolve_dtype(cfg: BuildConfig, hf_config: dict[str, Any]) -> str:
    """`auto` is fp32 on CPU and the model's dtype on CUDA: bf16 is faster than fp32 only on CPUs with bf16
    dot products (AVX512_BF16), so a CPU build asks for it (`dtype: bfloat16`)."""
    if cfg.dtype != "auto":
        return cfg.dtype
    device = cfg.engine.device
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "float32"
    model_dtype = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")
    return model_dtype if model_dtype in TORCH_DTYPES else "float32"


def pretrained_config_from_hf(hf: dict[str, Any], dtype: str) -> dict[str, Any]:
    architecture = str((hf.get("architectures") or ["?"])[0])
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {architecture} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _reject_unsupported_features(hf, architecture)
    heads = int(hf["num_attention_heads"])
    rotary_base, rotary_scaling = _rope(hf)
    return {
        "architecture": architecture,
        "dtype": dtype,
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": int(hf["hidden_size"]),
        "num_hidden_layers": int(hf["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        "intermediate_size": int(hf["intermediate_size"]),
        "max_position_embeddings": int(hf["max_position_embeddings"]),
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "hidden_act": str(hf.get("hidden_act", "silu")),
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": rotary_base,
        "rotary_scaling": rotary_scaling,
        "qkv_bias": architecture == "Qwen2ForCausalLM",
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "sliding_window": _sliding_window(hf, architecture),
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {
            "quant_algo": None,
            "kv_cache_quant_algo": None,
            "group_size": 128,
            "has_zero_point": False,
            "pre_quant_scale": False,
            "exclude_modules": None,
        },
    }


def _reject_unsupported_features(hf: dict[str, Any], architecture: str) -> None:
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only silu/SwiGLU)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true")
    if architecture != "Qwen2ForCausalLM" and hf.get("attention_bias"):
        problems.append("attention_bias=true")
    if architecture == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true (per-layer windows)")
    if problems:
        raise UnsupportedModelError(
            f"{architecture} checkpoint uses {', '.join(problems)}, which the torch runtime lacks"
        )


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """hf_rope, refused when the torch runtime lacks the scaling type."""
    base, scaling = hf_rope(hf)
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling {kind!r} is not implemented by the torch runtime; supported: {', '.join(ROPE_TYPES)}"
        )
    return base, scaling


def _sliding_window(hf: dict[str, Any], architecture: str) -> int | None:
    window = hf.get("sliding_window") if architecture == "MistralForCausalLM" else None
    return int(window) if window else None


def check_limits(cfg: BuildConfig, pretrained: dict[str, Any]) -> None:
    max_positions = pretrained["max_position_embeddings"]
    if cfg.engine.max_seq_len > max_positions:
        raise ConfigError(
            f"engine.max_seq_len={cfg.engine.max_seq_len} exceeds the model's max_position_embeddings={max_positions}",
            hint=f"set engine.max_seq_len <= {max_positions}",
        )


@contextmanager
def open_hf_tensors(hf_dir: Path, weight_files: list[str]) -> Iterator[dict[str, Any]]:
    """name -> lazy handle (safetensors) or tensor (pickle); each safetensors shard opened once."""
    with ExitStack() as stack:
        tensors: dict[str, Any] = {}
        for name in weight_files:
            if name.endswith(".safetensors"):
                handle = stack.enter_context(safe_open(str(hf_dir / name), framework="pt"))
                tensors.update({key: _LazyTensor(handle, key) for key in handle.keys()})  # noqa: SIM118
            elif name.endswith(".bin"):
                tensors.update(torch.load(hf_dir / name, map_location="cpu", weights_only=True, mmap=True))
        yield tensors


class _LazyTensor:
    def __init__(self, handle: Any, key: str) -> None:
        self.handle, self.key = handle, key

    def load(self) -> torch.Tensor:
        return self.handle.get_tensor(self.key)


def runtime_weights(tensors: dict[str, Any], pretrained: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The runtime layout, cast to the checkpoint dtype. Every HF tensor must be used exactly once (the
    embedding twice when tied), so a tensor the table does not know about fails loudly."""
    dtype = TORCH_DTYPES[pretrained["dtype"]]
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    plan = dict(GLOBAL_WEIGHTS)
    if pretrained["tie_word_embeddings"]:
        # HF ties by reusing the embedding even when a stale lm_head.weight was saved too.
        plan["lm_head.weight"] = ("model.embed_tokens.weight",)
        used.add("lm_head.weight")
    for i in range(pretrained["num_hidden_layers"]):
        table = {**LAYER_WEIGHTS, **(QKV_BIAS_WEIGHTS if pretrained["qkv_bias"] else {})}
        for runtime, sources in table.items():
            plan[f"transformer.layers.{i}.{runtime}"] = tuple(f"model.layers.{i}.{s}" for s in sources)
    for runtime, sources in plan.items():
        missing = [s for s in sources if s not in tensors]
        if missing:
            raise IntegrityError(f"checkpoint lacks {', '.join(missing)} (needed for {runtime})")
        parts = [_materialize(tensors[s]).to(dtype) for s in sources]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        # A tied lm_head is written as its own copy: safetensors refuses tensors that share memory.
        out[runtime] = tensor.clone() if used.intersection(sources) else tensor.contiguous()
        used.update(sources)
    unused = sorted(k for k in tensors if k not in used and not k.endswith(IGNORED_SUFFIXES))
    if unused:
        raise UnsupportedModelError(
            f"checkpoint has tensors the {pretrained['architecture']} converter does not map: {', '.join(unused[:8])}"
            + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else "")
        )
    _check_shapes(out, pretrained)
    return out


def _materialize(value: Any) -> torch.Tensor:
    return value.load() if isinstance(value, _LazyTensor) else value


def _check_shapes(weights: dict[str, torch.Tensor], pretrained: dict[str, Any]) -> None:
    for name, shape in expected_dense_shapes(model_config_from_dict(pretrained)).items():
        if tuple(weights[name].shape) != shape:
            raise IntegrityError(
                f"{name} has shape {tuple(weights[name].shape)}, config.json implies {shape}",
                hint="the checkpoint's config.json does not match its weights",
            )


def _is_tied_copy(name: str, pretrained: dict[str, Any]) -> bool:
    return name == "lm_head.weight" and pretrained["tie_word_embeddings"]
