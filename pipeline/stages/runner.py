"""Runs one stage: skip when its manifest matches, else produce it atomically and write the manifest."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.artifacts import (
    FileEntry,
    Manifest,
    is_fresh,
    list_files,
    require_manifest,
    tool_versions,
    write_atomically,
)
from pipeline.config.build_config import BuildConfig
from pipeline.config.workdir import STAGE_DIRNAMES, stage_output_dir
from pipeline.util.files import sha256_file


@dataclass(frozen=True)
class StageInput:
    dir: Path
    manifest: Manifest


@dataclass(frozen=True)
class StageSpec:
    name: str  # also the CLI subcommand
    config_sections: tuple[str, ...]  # what the output depends on: its hash keys reuse
    inputs: tuple[str, ...]  # earlier stages whose outputs this one reads
    produce: Callable[[BuildConfig, dict[str, StageInput], Path], dict[str, Any]]
    describe: Callable[[BuildConfig, Path], list[str]]  # the --dry-run plan, one line per action
    summary: str
    # Files outside the work dir that the output depends on (e.g. calibration data): their digests key
    # reuse like an earlier stage's manifest does, so editing one redoes the stage.
    data_files: Callable[[BuildConfig], dict[str, Path]] = lambda cfg: {}
    # Backends whose output this stage reads from other stages than `inputs` (e.g. validation of a trtllm
    # build on a host without a GPU reads the quantized checkpoint, not an engine).
    backend_inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def dirname(self) -> str:
        return STAGE_DIRNAMES[self.name]

    def inputs_for(self, cfg: BuildConfig) -> tuple[str, ...]:
        return self.backend_inputs.get(cfg.backend, self.inputs)


@dataclass(frozen=True)
class StageResult:
    spec: StageSpec
    dir: Path
    manifest: Manifest
    reused: bool


def stage_dir(cfg: BuildConfig, spec: StageSpec) -> Path:
    return stage_output_dir(cfg, spec.name)


def load_inputs(cfg: BuildConfig, spec: StageSpec, specs: dict[str, StageSpec]) -> dict[str, StageInput]:
    inputs = {}
    for name in spec.inputs_for(cfg):
        folder = stage_dir(cfg, specs[name])
        inputs[name] = StageInput(folder, require_manifest(folder, name))
    return inputs


def run_stage(
    cfg: BuildConfig,
    spec: StageSpec,
    specs: dict[str, StageSpec],
    *,
    force: bool = False,
) -> StageResult:
    inputs = load_inputs(cfg, spec, specs)
    out = stage_dir(cfg, spec)
    config_hash = cfg.config_hash(*spec.config_sections)
    input_digests = {name: item.manifest.digest for name, item in inputs.items()}
    input_digests |= {
        f"file:{name}": sha256_file(path) for name, path in spec.data_files(cfg).items() if path.is_file()
    }
    if not force:
        fresh = is_fresh(out, config_hash, input_digests)
        if fresh is not None:
            return StageResult(spec, out, fresh, reused=True)

    def produce(tmp: Path) -> Manifest:
        facts = spec.produce(cfg, inputs, tmp)
        files = list_files(tmp)
        external = facts.get("external_root")
        if external:
            files += [FileEntry(f"@external/{e.path}", e.size, e.sha256) for e in list_files(Path(external))]
        extra_tools = tuple(facts.pop("tool_packages", ()))
        return Manifest(
            stage=spec.name,
            config_hash=config_hash,
            inputs=input_digests,
            files=files,
            tool_versions=tool_versions(*extra_tools),
            facts=facts,
        )

    manifest = write_atomically(out, produce)
    return StageResult(spec, out, manifest, reused=False)
