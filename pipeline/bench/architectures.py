"""Random-weight checkpoints of every tiny architecture (pipeline.sources.tiny) at one shared, benchmark-sized
shape, and their fp32 torch engines: decode speeds of the families are then comparable with each other.

The test-sized models (hidden 64, 2 layers) are so small that every step is Python overhead; here each
family gets hidden 256, 4 layers, 4 query / 2 KV heads of 64, MLP 512, so per-op costs of the decode path
show. MoE families keep 4 experts, 2 active, each half the dense MLP's width: active parameters match the
dense models'. Each family keeps its features (biases, softcapping, sliding windows, RoPE variants,
QK norms, ...), with per-layer lists laid out over the 4 layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from pipeline.config.build_config import BuildConfig
from pipeline.errors import ConfigError
from pipeline.sources.tiny import (
    ARCHITECTURES,
    corpus_files,
    save_random_checkpoint,
    tiny_config,
    train_tokenizer,
)


@dataclass(frozen=True)
class Shape:
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 512

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


DEFAULT_SHAPE = Shape()
# HF's own init scale: random logits of a realistic spread (the tests' larger std is for parity margins).
INIT_STD = 0.02
EXPERTS, EXPERTS_PER_TOKEN = 4, 2


def _features(arch: str, shape: Shape) -> dict[str, Any]:
    """The family's feature values from pipeline.sources.tiny, resized to `shape`."""
    if arch not in ARCHITECTURES:
        raise ConfigError(f"architecture {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    features = dict(ARCHITECTURES[arch][2])
    layers, head_dim = shape.num_hidden_layers, shape.head_dim
    expert_width = shape.intermediate_size // EXPERTS_PER_TOKEN
    if "head_dim" in features or arch in ("qwen3", "qwen3-moe", "gemma2", "gemma3", "smollm3"):
        features["head_dim"] = head_dim  # several families' configs default to 128 or 256, not hidden/heads
    if "query_pre_attn_scalar" in features:
        features["query_pre_attn_scalar"] = head_dim
    if "layer_types" in features:  # the family's pattern (sliding, then full) repeated over the layers
        pattern = features["layer_types"]
        features["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    if arch == "qwen3-moe":
        features |= {
            "num_hidden_layers": layers,
            "num_experts": EXPERTS,
            "num_experts_per_tok": EXPERTS_PER_TOKEN,
            "moe_intermediate_size": expert_width,
            "mlp_only_layers": [],  # every layer sparse, as in the released Qwen3-MoE models
        }
    if arch == "mixtral":
        features |= {
            "num_local_experts": EXPERTS,
            "num_experts_per_tok": EXPERTS_PER_TOKEN,
            "intermediate_size": expert_width,
        }
    if arch == "smollm3":  # every 4th layer without RoPE, as in SmolLM3-3B
        features["no_rope_layers"] = [0 if (i + 1) % 4 == 0 else 1 for i in range(layers)]
    rope = features.get("rope_parameters")
    if isinstance(rope, dict) and "short_factor" in rope:  # LongRoPE: one factor per rotary frequency
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        features["rope_parameters"] = {
            **rope,
            "short_factor": [1.0 + 0.05 * i for i in range(rotary // 2)],
            "long_factor": [2.0 + 0.2 * i for i in range(rotary // 2)],
        }
    return features


def bench_hf_config(arch: str, tokenizer: PreTrainedTokenizerFast, shape: Shape = DEFAULT_SHAPE) -> Any:
    sizes = {
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "intermediate_size": shape.intermediate_size,
    }
    return tiny_config(arch, tokenizer, INIT_STD, {**sizes, **_features(arch, shape)})


def bench_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny models' tokenizer (trained once per process: it is the slow part of a checkpoint)."""
    return train_tokenizer(corpus_files())


def make_bench_checkpoint(
    out_dir: Path,
    arch: str,
    tokenizer: PreTrainedTokenizerFast,
    shape: Shape = DEFAULT_SHAPE,
    seed: int = 0,
) -> dict[str, Any]:
    """An fp32 HF checkpoint of `arch` at `shape` in `out_dir`; facts about it (parameters, active ones)."""
    config = bench_hf_config(arch, tokenizer, shape)
    model = save_random_checkpoint(out_dir, arch, config, tokenizer, seed, INIT_STD)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    num_experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    active = total - experts + (experts * top_k // num_experts if num_experts else 0)
    return {"architecture": type(model).__name__, "num_params": total, "active_params": active}


def bench_build_config(hf_dir: Path, name: str, max_batch_size: int = 16) -> BuildConfig:
    """fp32 torch engine limits for short prompts, long outputs and `max_batch_size` concurrent requests."""
    return BuildConfig.model_validate(
        {
            "name": name,
            "source": {"kind": "local", "path": str(hf_dir)},
            "backend": "torch",
            "dtype": "float32",
            "engine": {
                "max_batch_size": max_batch_size,
                "max_input_len": 512,
                "max_seq_len": 1024,
                "max_num_tokens": 512,
            },
            "kv_cache": {"tokens_per_block": 32, "max_tokens": 32768, "enable_block_reuse": False},
            "scheduler": {"enable_chunked_context": True},
        }
    )


def build_engine(cfg: BuildConfig, hf_dir: Path, work_dir: Path) -> Path:
    """convert + build of the torch backend into `work_dir/engine` (the checkpoint in `work_dir/checkpoint`)."""
    from pipeline.backends.torch.build import build
    from pipeline.backends.torch.checkpoint import convert

    checkpoint, engine = Path(work_dir) / "checkpoint", Path(work_dir) / "engine"
    convert(cfg, hf_dir, checkpoint)
    build(cfg, checkpoint, engine)
    return engine
