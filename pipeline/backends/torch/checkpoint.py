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

from pipeline.architectures.hf_config import pretrained_config_from_hf
from pipeline.architectures.weight_map import checkpoint_plan
from pipeline.config.build_config import BuildConfig
from pipeline.errors import ConfigError, IntegrityError, UnsupportedModelError
from pipeline.runtime.engine_config import TOKENIZER_DIR, WEIGHTS_FILE, model_config_from_dict
from pipeline.runtime.model.loader import expected_dense_shapes
from pipeline.runtime.model_config import rope_type
from pipeline.sources.local import inspect_local_checkpoint
from pipeline.sources.tokenizer import copy_tokenizer

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# HF buffers some older checkpoints saved; recomputed by the runtime.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def convert(cfg: BuildConfig, hf_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Write the checkpoint for `cfg` from the HF folder `hf_dir` into `out_dir`; return facts about it."""
    started = time.perf_counter()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    local = inspect_local_checkpoint(hf_dir, cfg.source.allow_pickle, cfg.source.trust_remote_code)
    pretrained = pretrained_config_from_hf(local.config, resolve_dtype(cfg, local.config))
    check_rope_limits(cfg, pretrained)
    check_limits(cfg, pretrained)

    out_dir.mkdir(parents=True, exist_ok=True)
    with open_hf_tensors(hf_dir, local.weight_files) as tensors:
        weights = runtime_weights(tensors, pretrained, local.config)
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


def check_rope_limits(cfg: BuildConfig, pretrained: dict[str, Any]) -> None:
    """LongRoPE switches to its long factors past original_max_position_embeddings, recomputing every
    position's rotation; the runtime keeps the short ones, exact up to there."""
    scaling = pretrained["rotary_scaling"] or {}
    original = scaling.get("original_max_position_embeddings")
    if rope_type(scaling) == "longrope" and original and cfg.engine.max_seq_len > original:
        raise UnsupportedModelError(
            f"engine.max_seq_len={cfg.engine.max_seq_len} is beyond this LongRoPE model's "
            f"original_max_position_embeddings={original}; the torch runtime implements its short factors only",
            hint=f"set engine.max_seq_len <= {original}",
        )


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


def runtime_weights(
    tensors: dict[str, Any], pretrained: dict[str, Any], hf: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """The runtime layout (architectures.weight_map) of HF `tensors`, cast to the checkpoint dtype. Every HF
    tensor must be used exactly once (the embedding twice when tied), so a tensor the map does not know about
    fails loudly."""
    dtype = TORCH_DTYPES[pretrained["dtype"]]
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    if pretrained["tie_word_embeddings"]:
        used.add("lm_head.weight")
    for runtime, part in checkpoint_plan(pretrained, hf or {}).items():
        sources = [s for group in part.groups for s in group]
        missing = [s for s in sources if s not in tensors]
        if missing:
            raise IntegrityError(f"checkpoint lacks {', '.join(missing[:4])} (needed for {runtime})")
        groups = [torch.cat([_materialize(tensors[s]) for s in group], dim=0) for group in part.groups]
        tensor = groups[0] if len(groups) == 1 else torch.stack(groups)
        if part.fold is not None:
            tensor = part.fold(tensor.float())
        # A folded norm scale stays fp32 (HF computes Gemma's 1 + w in fp32; bf16 would round it) and is
        # read into the compute dtype at load, like every norm.
        if part.fold is None or tensor.dim() != 1:
            tensor = tensor.to(dtype)
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
