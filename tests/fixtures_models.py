"""Session-scoped model checkpoints for tests (registered from tests/conftest.py via pytest_plugins).

tiny_*_dir: random-weight checkpoints built in well under a second each.
smollm2_hf_dir: the SmolLM2 GGUF dequantized to an fp32 HF checkpoint once (~30 s on 2 cores), cached under
<repo>/.cache/test-models/ keyed by the GGUF's sha256 so later sessions reuse it.
gemma3_hf_dir: the same for Gemma 3 270M (base), its GGUF found the way `fetch` finds it for
build_configs/gemma3-270m.yaml (~1 GB of fp32 safetensors).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from pipeline.errors import MissingArtifactError

REPO_ROOT = Path(__file__).resolve().parents[1]
TEST_MODELS_CACHE = REPO_ROOT / ".cache" / "test-models"
# Written last: its presence means the cached conversion is complete.
FACTS_FILE = "conversion.json"


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.sources.tiny import make_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_checkpoint(out, arch="llama", seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.sources.tiny import make_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny-qwen2")
    make_tiny_checkpoint(out, arch="qwen2", seed=0)
    return out


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from pipeline.sources.gguf import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except MissingArtifactError as err:
        pytest.skip(f"{err} ({err.hint})")


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf: Path) -> Path:
    """fp32 HF checkpoint of SmolLM2-135M-Instruct; its conversion facts are in `conversion.json`."""
    return _cached_conversion(smollm2_gguf, "smollm2-135m-instruct")


GEMMA3_CONFIG = REPO_ROOT / "build_configs" / "gemma3-270m.yaml"


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, resolved by fetch's `gguf_file` from build_configs/gemma3-270m.yaml
    (joined from its chunk packages on first use)."""
    from pipeline.config.build_config import load_build_config
    from pipeline.stages.fetch import gguf_file

    try:
        return gguf_file(load_build_config(GEMMA3_CONFIG))
    except MissingArtifactError as err:
        pytest.skip(f"{err} ({err.hint})")


@pytest.fixture(scope="session")
def gemma3_hf_dir(gemma3_gguf: Path) -> Path:
    """fp32 HF checkpoint of Gemma 3 270M (base); its conversion facts are in `conversion.json`."""
    return _cached_conversion(gemma3_gguf, "gemma3-270m")


def _cached_conversion(gguf: Path, name: str) -> Path:
    """`gguf` dequantized into an fp32 HF checkpoint under TEST_MODELS_CACHE, converted once per GGUF."""
    from pipeline.sources.gguf import gguf_to_hf_checkpoint
    from pipeline.util.files import sha256_file

    digest = sha256_file(gguf)
    out = TEST_MODELS_CACHE / f"{name}-{digest[:16]}-float32"
    if (out / FACTS_FILE).is_file():
        return out
    # Build beside the target and rename: an interrupted or concurrent session never sees half a folder.
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    facts = gguf_to_hf_checkpoint(gguf, partial, dtype="float32", progress=False)
    (partial / FACTS_FILE).write_text(json.dumps(facts, indent=2) + "\n")
    try:
        partial.rename(out)
    except OSError:  # another session finished first; its copy is equivalent
        shutil.rmtree(partial, ignore_errors=True)
    return out
