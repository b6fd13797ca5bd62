"""Tiny random-weight checkpoints (llama, qwen2, mistral) with a real byte-level BPE tokenizer, built
offline in seconds for tests: same arguments -> byte-identical files."""

from __future__ import annotations

import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

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

ARCHITECTURES: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


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


def tiny_config(arch: str, tokenizer: PreTrainedTokenizerFast, init_std: float = INIT_STD) -> Any:
    if arch not in ARCHITECTURES:
        raise ConfigError(f"tiny model arch {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    config_class, _ = ARCHITECTURES[arch]
    extra: dict[str, Any] = {}
    if arch == "mistral":
        # No window: a window shorter than the context would make parity tests depend on it.
        extra["sliding_window"] = None
    return config_class(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=1024,
        # Qwen2 checkpoints tie lm_head to the embeddings; Llama/Mistral ones mostly do not: cover both.
        tie_word_embeddings=arch == "qwen2",
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **extra,
    )


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
    _, model_class = ARCHITECTURES[arch]
    model = model_class(config)
    init_weights(model, seed, init_std)

    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out_dir)
    return {
        "architecture": model_class.__name__,
        "num_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": config.vocab_size,
        "tied_embeddings": config.tie_word_embeddings,
        "init_std": init_std,
        "seed": seed,
        "seconds": round(time.perf_counter() - started, 2),
    }
