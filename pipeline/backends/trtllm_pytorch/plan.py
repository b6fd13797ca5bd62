"""`--dry-run` for the trtllm_pytorch backend: what each step would do and write, from the config alone."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.backends.trtllm_pytorch import release
from pipeline.backends.trtllm_pytorch.architectures import require_pytorch_architecture
from pipeline.backends.trtllm_pytorch.checkpoint import HF_QUANT_CONFIG
from pipeline.backends.trtllm_pytorch.llm_args import (
    LLM_API_ARGS_FILE,
    TRTLLM_SERVE_OPTIONS_FILE,
    llm_api_args,
    trtllm_serve_argv,
)
from pipeline.config.build_config import BuildConfig
from pipeline.config.workdir import STAGE_DIRNAMES


def _dirs(cfg: BuildConfig, workdir: Path, stage: str) -> tuple[Path, Path]:
    """(input, output) folders of `stage`; a local source is read where it is."""
    before = {"convert": "fetch", "quantize": "convert", "engine": "quantize"}[stage]
    src = workdir / STAGE_DIRNAMES[before]
    if before == "fetch" and cfg.source.kind == "local" and cfg.source.path:
        src = Path(cfg.source.path)
    return src, workdir / STAGE_DIRNAMES[stage]


def convert_lines(cfg: BuildConfig, workdir: Path) -> list[str]:
    src, out = _dirs(cfg, workdir, "convert")
    return [
        release.ROUTES["trtllm_pytorch"].line(),
        f"link the HF checkpoint {src} -> {out} as it is (no conversion: the PyTorch backend loads HF checkpoints)",
    ]


def quantize_lines(cfg: BuildConfig, workdir: Path) -> list[str]:
    q, (src, out) = cfg.quantization, _dirs(cfg, workdir, "quantize")
    if q.mode == "none" and q.kv_cache_dtype == "auto":
        return [f"nothing to quantize: link {src} -> {out}"]
    calib = q.calibration
    return [
        f"ModelOpt on CPU: calibrate {src} for quant_algo {q.quant_algo}, kv_cache_quant_algo "
        f"{q.kv_cache_quant_algo} (group {q.group_size}) on calibration {calib.dataset} ({calib.num_samples} "
        f"samples of <= {calib.max_seq_length} tokens)",
        f"writes the unified HF checkpoint {out}: *.safetensors, {HF_QUANT_CONFIG}, config.json, tokenizer",
    ]


def engine_lines(cfg: BuildConfig, workdir: Path) -> list[str]:
    src, out = _dirs(cfg, workdir, "engine")
    final = out.resolve()
    args = llm_api_args(cfg, final, require_built=False)
    q = cfg.quantization
    gpus = release.sm_range_label(release.GPU_RANGE_FOR_QUANT[q.mode])
    kv = release.sm_range_label(release.GPU_RANGE_FOR_KV[q.kv_cache_dtype])
    lines = [
        f"no compilation: link {src} -> {out}; writes {LLM_API_ARGS_FILE} (LLM(**args)) and "
        f"{TRTLLM_SERVE_OPTIONS_FILE} (trtllm-serve --extra_llm_api_options)",
        "LLM API arguments: " + ", ".join(f"{key}={value}" for key, value in args.items()),
        f"runs on {cfg.parallel.world_size} GPU(s) of {gpus} (weights {q.mode}; KV cache {q.kv_cache_dtype}: "
        f"{kv}) with TensorRT-LLM {release.PINNED} ({release.PINNED_CONTAINER})",
        "serve outside Triton: " + " ".join(trtllm_serve_argv(cfg, final, final / TRTLLM_SERVE_OPTIONS_FILE)),
    ]
    if cfg.speculative.mode != "none" and cfg.speculative.adaptive:
        lines.append("speculative.adaptive has no LLM API counterpart: drafts stay max_draft_len long")
    return lines


_STAGES = {"convert": convert_lines, "quantize": quantize_lines, "engine": engine_lines}


def check_architecture(cfg: BuildConfig, workdir: Path) -> None:
    """Refuse, at plan time, an architecture the PyTorch backend does not load, once the HF checkpoint's
    config.json is there to tell (a local source, or a fetched one)."""
    config_path = _dirs(cfg, workdir, "convert")[0] / "config.json"
    if config_path.is_file():
        architectures = json.loads(config_path.read_text(encoding="utf-8")).get("architectures") or [""]
        require_pytorch_architecture(str(architectures[0]))


def plan(cfg: BuildConfig, workdir: Path, stage: str | None = None) -> list[str]:
    """Plan lines for one stage (convert, quantize, engine) or, with stage=None, all three."""
    check_architecture(cfg, workdir)
    return [line for name in ([stage] if stage else list(_STAGES)) for line in _STAGES[name](cfg, workdir)]
