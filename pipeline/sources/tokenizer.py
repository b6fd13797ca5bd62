"""Carrying a checkpoint's tokenizer along: every later stage's output holds it in `tokenizer/`, so the
engine directory alone is enough to serve."""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeline.sources import TOKENIZER_FILES


def copy_tokenizer(hf_dir: Path, dest: Path) -> list[str]:
    """Tokenizer files (and generation_config.json, which holds HF's end ids) from an HF checkpoint folder
    into `dest`; the names copied."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, dest / name)
            copied.append(name)
    return copied
