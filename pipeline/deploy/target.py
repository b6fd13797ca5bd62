"""What a bundle deploys: the packaged model repository of a build config, checked against the deploy values
before anything is rendered. Every refusal names the value that cannot work."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts import Manifest, read_manifest
from pipeline.config.build_config import BuildConfig, build_config_from_dict
from pipeline.config.workdir import stage_output_dir
from pipeline.deploy.values import K8S_NAME, DeployValues
from pipeline.errors import ConfigError, MissingArtifactError

PODS_ROOT = "/models"  # where a relocatable work dir is mounted: /models/<name>
REPO_DIRNAME = "model_repo"


@dataclass(frozen=True)
class Target:
    cfg: BuildConfig
    name: str  # prefix of every object name
    manifest: Manifest  # the package stage's
    mount_path: str  # the build's work dir inside the pods
    has_bls: bool  # the repository serves tensorrt_llm_bls: the OpenAI API can run beside it
    gpus_per_pod: int  # 0: a CPU deployment
    num_nodes: int  # pods per replica: 1 = a Deployment, more = a LeaderWorkerSet group
    engine_version: str | None  # TensorRT-LLM release that built a trtllm engine

    @property
    def repo_in_pod(self) -> str:
        return f"{self.mount_path}/{REPO_DIRNAME}"

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1


def object_name(cfg: BuildConfig, values: DeployValues) -> str:
    name = values.name or re.sub(r"[._]", "-", cfg.name.lower())
    if not re.fullmatch(K8S_NAME, name):
        raise ConfigError(
            f"build name {cfg.name!r} is no Kubernetes object name ({name!r} is not a DNS-1123 label)",
            hint="Set one with --value name=my-model.",
        )
    return name


def _packaged_manifest(cfg: BuildConfig) -> Manifest:
    repo = stage_output_dir(cfg, "package")
    manifest = read_manifest(repo)
    if manifest is None or not any(repo.glob("*/config.pbtxt")):
        raise MissingArtifactError(
            f"model repository {repo} is missing (no manifest.json and config.pbtxt files)",
            hint="Build and package it first: `llmpipe build CONFIG`.",
        )
    return manifest


def _check_parallel(cfg: BuildConfig, manifest: Manifest) -> str | None:
    """tp/pp of the config against the packaged build and (trtllm) the engine's own mapping; returns the
    engine's TensorRT-LLM version."""
    wanted = (cfg.parallel.tp_size, cfg.parallel.pp_size)
    recorded = manifest.facts.get("build_config")
    if recorded:
        packaged = build_config_from_dict(recorded).parallel
        if (packaged.tp_size, packaged.pp_size) != wanted:
            raise ConfigError(
                f"parallel.tp_size={wanted[0]} parallel.pp_size={wanted[1]} does not match the packaged engine "
                f"(tp_size={packaged.tp_size} pp_size={packaged.pp_size})",
                hint="Deploy with the config the engine was built with, or rebuild the engine.",
            )
    if cfg.backend != "trtllm":
        return None
    engine_config = Path(manifest.facts.get("engine", "")) / "config.json"
    if not engine_config.is_file():
        raise MissingArtifactError(f"the packaged engine's {engine_config} is missing")
    built = json.loads(engine_config.read_text(encoding="utf-8"))
    mapping = built.get("pretrained_config", {}).get("mapping", {})
    engine_parallel = (mapping.get("tp_size", 1), mapping.get("pp_size", 1))
    if engine_parallel != wanted:
        raise ConfigError(
            f"parallel.tp_size={wanted[0]} parallel.pp_size={wanted[1]} does not match the engine at "
            f"{engine_config.parent} (tp_size={engine_parallel[0]} pp_size={engine_parallel[1]})",
            hint="Deploy with the config the engine was built with, or rebuild the engine.",
        )
    return str(built.get("version")) if built.get("version") else None


def _gpu_layout(cfg: BuildConfig, values: DeployValues) -> tuple[int, int]:
    """(GPUs per pod, pods per replica)."""
    per_node = values.resources.gpus_per_node
    if cfg.backend == "torch" and cfg.engine.device != "cuda":
        if per_node is not None:
            raise ConfigError(
                f"resources.gpus_per_node={per_node}: this torch build runs on CPU (engine.device="
                f"{cfg.engine.device}); drop the value or build with engine.device=cuda"
            )
        return 0, 1
    world, tp = cfg.parallel.world_size, cfg.parallel.tp_size
    if per_node is None or per_node >= world:
        return world, 1
    if per_node < tp:
        raise ConfigError(
            f"resources.gpus_per_node={per_node} is fewer than parallel.tp_size={tp}: a tensor-parallel group "
            "must sit on one node (NVLink)",
            hint=f"Use nodes with at least {tp} GPUs.",
        )
    if world % per_node:
        raise ConfigError(
            f"resources.gpus_per_node={per_node} does not divide tp_size*pp_size={world}: every node of a "
            "group must run the same number of ranks"
        )
    if cfg.backend != "trtllm":
        raise ConfigError(
            f"resources.gpus_per_node={per_node} < tp_size*pp_size={world} needs several nodes, which only "
            f"backend=trtllm's mpirun launch spans (backend={cfg.backend})"
        )
    if cfg.speculative.mode == "draft_model":
        raise ConfigError(
            f"resources.gpus_per_node={per_node}: a draft-target build runs in orchestrator mode on one node; "
            f"use nodes with {world} GPUs"
        )
    return per_node, world // per_node


def _mount_path(cfg: BuildConfig, values: DeployValues, name: str, manifest: Manifest) -> str:
    asked = values.model_repository.mount_path
    if cfg.backend != "trtllm":
        return asked or f"{PODS_ROOT}/{name}"
    # config.pbtxt's gpt_model_path is the engine stage's absolute folder: the pods see the same path.
    workdir = stage_output_dir(cfg, "package").resolve().parent
    for fact in ("engine", "draft_engine"):
        engine = manifest.facts.get(fact)
        if engine and not Path(engine).resolve().is_relative_to(workdir):
            raise ConfigError(
                f"the packaged {fact.replace('_', ' ')} {engine} lies outside the work dir {workdir}, which is "
                "all the pods mount",
                hint="Package the engine into the work dir: `llmpipe package CONFIG --engine-dir DIR`.",
            )
    if asked is not None and asked != str(workdir):
        raise ConfigError(
            f"model_repository.mount_path={asked}: a trtllm repository names its engine by absolute path, so "
            f"the work dir must be mounted where it was built ({workdir})",
            hint="Drop the value, or build inside the image at the path the pods mount.",
        )
    return str(workdir)


def resolve_target(cfg: BuildConfig, values: DeployValues) -> Target:
    """The deployment of cfg's packaged repository; ConfigError / MissingArtifactError naming the value."""
    name = object_name(cfg, values)
    manifest = _packaged_manifest(cfg)
    engine_version = _check_parallel(cfg, manifest)
    gpus_per_pod, num_nodes = _gpu_layout(cfg, values)
    source = values.model_repository
    if source.source == "image" and not source.image:
        raise ConfigError(
            "model_repository.source=image needs model_repository.image (the image to copy from)"
        )
    return Target(
        cfg=cfg,
        name=name,
        manifest=manifest,
        mount_path=_mount_path(cfg, values, name, manifest),
        has_bls=(stage_output_dir(cfg, "package") / "tensorrt_llm_bls" / "config.pbtxt").is_file(),
        gpus_per_pod=gpus_per_pod,
        num_nodes=num_nodes,
        engine_version=engine_version,
    )
