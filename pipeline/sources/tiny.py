"""Tiny random-weight checkpoints of every supported architecture, features switched on, with a real byte-level BPE tokenizer, built
offline in seconds for tests: same arguments -> byte-identical files."""

from __future__ import annotations

import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from pipeline.errors import ConfigError

# Modules present, under these names, in every CPython stdlib from 3.10 on; a fixed list in a fixed order
# keeps the trained vocabulary independent of what else a Python install happens to ship.
CORPUS_MODULES = (
    "abc.py",
    "argparse.py",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "contextlib.py",
    "csv.py",
    "dataclasses.py",
    "enum.py",
    "functools.py",
    "heapq.py",
    "random.py",
    "shutil.py",
    "string.py",
    "textwrap.py",
    "typing.py",
)
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, TURN_START, TURN_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# NOTE: with HF's std 0.02 the logits of a 64-wide model span ~0.2, so top-2 gaps are often < 1e-3 and a
# 1e-6 numerical difference can flip a greedy token. std 0.2 spreads them out (see make_tiny_checkpoint).
INIT_STD = 0.2

# Tiny model name -> (HF config class, HF model class, the config values that switch its features on).
# Windows are shorter than the test prompts, MoE layers pick several experts, RoPE variants are non-trivial.
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # No window: a window shorter than the context would make parity tests depend on it.
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "llama-bias-yarn": ("LlamaConfig", "LlamaForCausalLM", {
        "attention_bias": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 256},
    }),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
        "norm_topk_prob": False, "mlp_only_layers": [1],
    }),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
    }),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention"], "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0,
    }),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
        },
    }),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "max_position_embeddings": 2048, "original_max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [2.0, 3.0, 4.0, 5.0],
                            "original_max_position_embeddings": 1024},
    }),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "embedding_multiplier": 3.0, "residual_multiplier": 0.5, "logits_scaling": 2.0,
        "attention_multiplier": 0.2,
    }),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}),
}  # fmt: skip


TIED = ("qwen2", "gemma2", "gemma3", "smollm3")


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [stdlib / name for name in CORPUS_MODULES]


def train_tokenizer(files: Sequence[Path], vocab_size: int = 2000) -> PreTrainedTokenizerFast:
    """Byte-level BPE (every byte is a token, so nothing is ever unknown) with chat special tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train([str(f) for f in files], trainer=trainer)
    bos_id = backend.token_to_id(BOS)
    # Llama-style: every encoded text starts with BOS, so tests also cover the special-token path.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[TURN_START, TURN_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )


def tiny_config(
    arch: str,
    tokenizer: PreTrainedTokenizerFast,
    init_std: float = INIT_STD,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """The HF config of tiny `arch`: the shared test shape, the family's features, then `overrides`."""
    if arch not in ARCHITECTURES:
        raise ConfigError(f"tiny model arch {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    config_class, _, features = ARCHITECTURES[arch]
    values: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 1024,
        # Qwen2, Gemma and SmolLM3 checkpoints tie lm_head to the embeddings; the others mostly do not.
        "tie_word_embeddings": arch in TIED,
        "initializer_range": init_std,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "dtype": "float32",
        **features,
        **(overrides or {}),
    }
    return getattr(transformers, config_class)(**values)


def init_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    """Every parameter random, biases and norm scales too, so a converter that drops or swaps any tensor
    changes the output (HF's init sets biases to 0 and norms to 1, which would hide such bugs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(std * torch.randn(param.shape, generator=generator))


def make_tiny_checkpoint(
    out_dir: Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 2000,
    init_std: float = INIT_STD,
    corpus: Sequence[Path] | None = None,
) -> dict[str, Any]:
    """Write config.json, model.safetensors (fp32), tokenizer files and generation_config.json to
    `out_dir`; return facts about it (architecture, num_params, vocab_size, seconds)."""
    started = time.perf_counter()
    tokenizer = train_tokenizer(corpus if corpus is not None else corpus_files(), vocab_size)
    config = tiny_config(arch, tokenizer, init_std)
    model = save_random_checkpoint(out_dir, arch, config, tokenizer, seed, init_std)
    return {
        "architecture": type(model).__name__,
        "num_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": config.vocab_size,
        "tied_embeddings": config.tie_word_embeddings,
        "init_std": init_std,
        "seed": seed,
        "seconds": round(time.perf_counter() - started, 2),
    }


def save_random_checkpoint(
    out_dir: Path, arch: str, config: Any, tokenizer: PreTrainedTokenizerFast, seed: int, init_std: float
) -> torch.nn.Module:
    """Tiny `arch`'s model of HF `config` with init_weights(seed, init_std), saved with `tokenizer` and a
    generation config into `out_dir`; returns the model."""
    model = getattr(transformers, ARCHITECTURES[arch][1])(config)
    init_weights(model, seed, init_std)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out_dir)
    return model
