"""`--dry-run` for the trtllm backend: the calls, command lines and files each step would run/produce.

Works on any machine (no TensorRT-LLM import): everything here is derived from the config.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.backends.trtllm.api import MODEL_CLASS_FOR_ARCHITECTURE, hf_architecture
from pipeline.backends.trtllm.build_cmd import BUILD_LOG_NAME, NETWORK_DIRNAME, format_argv, trtllm_build_argv
from pipeline.backends.trtllm.convert import convert_quant_algo
from pipeline.backends.trtllm.env import trtllm_unavailable_reason
from pipeline.backends.trtllm.guards import check_build_features, kv_tokens_for_one_sequence
from pipeline.backends.trtllm.quantize import needs_calibration
from pipeline.backends.trtllm.triton_params import tensorrt_llm_parameters
from pipeline.backends.trtllm.versions import (
    MIN_SM_FOR_KV,
    MIN_SM_FOR_QUANT,
    PINNED,
    PINNED_CONTAINER,
    sm_label,
)
from pipeline.config.build_config import BuildConfig
from pipeline.config.workdir import STAGE_DIRNAMES

HF_DIRNAME, CHECKPOINT_DIRNAME, QUANTIZED_DIRNAME, ENGINE_DIRNAME = (
    STAGE_DIRNAMES[stage] for stage in ("fetch", "convert", "quantize", "engine")
)


def _hf_dir(cfg: BuildConfig, workdir: Path) -> Path:
    return Path(cfg.source.path) if cfg.source.kind == "local" and cfg.source.path else workdir / HF_DIRNAME


def _model_class(hf_dir: Path) -> str:
    if (hf_dir / "config.json").is_file():
        return MODEL_CLASS_FOR_ARCHITECTURE.get(hf_architecture(hf_dir), "<unsupported architecture>")
    return "LLaMAForCausalLM"  # the Llama family; resolved from config.json once fetched


def _rank_files(cfg: BuildConfig, suffix: str) -> str:
    return ", ".join(f"rank{r}.{suffix}" for r in range(cfg.parallel.world_size))


def convert_lines(cfg: BuildConfig, workdir: Path) -> list[str]:
    hf_dir, out = _hf_dir(cfg, workdir), workdir / CHECKPOINT_DIRNAME
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    return [
        f"for rank in 0..{tp * pp - 1}: {_model_class(hf_dir)}.from_hugging_face('{hf_dir}', dtype='{cfg.dtype}', "
        f"mapping=Mapping(world_size={tp * pp}, rank=rank, tp_size={tp}, pp_size={pp}), "
        f"quant_config=QuantConfig(quant_algo={convert_quant_algo(cfg)}), load_model_on_cpu=True)"
        f".save_checkpoint('{out}', save_config=rank == 0)",
        f"writes {out}/config.json, {_rank_files(cfg, 'safetensors')}",
    ]


def quantize_lines(cfg: BuildConfig, workdir: Path) -> list[str]:
    q, out = cfg.quantization, workdir / QUANTIZED_DIRNAME
    if not needs_calibration(cfg):
        return [
            f"no calibration for mode={q.mode}, kv={q.kv_cache_dtype}: link {workdir / CHECKPOINT_DIRNAME} -> {out}"
        ]
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    calib = q.calibration
    dataset = "<folder of llmpipe's shipped calib.jsonl>" if calib.dataset == "builtin" else calib.dataset
    hf_dir = _hf_dir(cfg, workdir)
    return [
        f"{_model_class(hf_dir)}.quantize('{hf_dir}', '{out}', dtype='{cfg.dtype}', "
        f"mapping=Mapping(world_size={tp * pp}, tp_size={tp}, pp_size={pp}), "
        f"quant_config=QuantConfig(quant_algo={q.quant_algo}, kv_cache_quant_algo={q.kv_cache_quant_algo}, "
        f"group_size={q.group_size}), calib_dataset='{dataset}', calib_batches={calib.num_samples}, "
        f"calib_max_seq_length={calib.max_seq_length})",
        f"writes {out}/config.json, {_rank_files(cfg, 'safetensors')}",
    ]


def engine_lines(cfg: BuildConfig, workdir: Path) -> list[str]:
    check_build_features(cfg)
    ckpt, out = workdir / QUANTIZED_DIRNAME, workdir / ENGINE_DIRNAME
    need = max(MIN_SM_FOR_QUANT[cfg.quantization.mode], MIN_SM_FOR_KV[cfg.quantization.kv_cache_dtype])
    params = tensorrt_llm_parameters(cfg, out)
    return [
        f"guards: {cfg.parallel.world_size} GPU(s) of {sm_label(need)}+; KV cache must hold "
        f"{kv_tokens_for_one_sequence(cfg)} tokens for one sequence; TensorRT-LLM {PINNED} "
        f"({PINNED_CONTAINER})",
        *format_argv(trtllm_build_argv(cfg, ckpt, out)).splitlines(),
        f"writes {out}/config.json, {_rank_files(cfg, 'engine')}, {BUILD_LOG_NAME}, "
        f"{NETWORK_DIRNAME}/*.onnx (checked with onnx.checker)",
        "serves with tensorrt_llm parameters: " + ", ".join(f"{k}={v}" for k, v in params.items()),
    ]


_STAGES = {"convert": convert_lines, "quantize": quantize_lines, "engine": engine_lines}


def plan(cfg: BuildConfig, workdir: Path, stage: str | None = None) -> list[str]:
    """Plan lines for one stage (convert, quantize, engine) or, with stage=None, all three."""
    names = [stage] if stage else list(_STAGES)
    lines = [line for name in names for line in _STAGES[name](cfg, workdir)]
    reason = trtllm_unavailable_reason()
    if reason and stage in (None, "convert"):
        lines.append(f"note: this machine cannot run it: {reason}")
    return lines
