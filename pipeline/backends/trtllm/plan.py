"""`--dry-run` for the trtllm backend: the calls, command lines and files each step would run/produce.

Works on any machine (no TensorRT-LLM import): everything here is derived from the config.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.backends.trtllm.api import (
    convert_needs_trtllm,
    hf_architecture,
    model_class_name,
    stages_need_trtllm,
)
from pipeline.backends.trtllm.build_cmd import BUILD_LOG_NAME, NETWORK_DIRNAME, format_argv, trtllm_build_argv
from pipeline.backends.trtllm.convert import FP8_ROWWISE_CLAMP, convert_quant_algo
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
from pipeline.quantize.modelopt.export import DECODER_TYPES, checkpoint_dtype
from pipeline.quantize.modelopt.formats import MODE_CONFIGS, block_size, check_supported
from pipeline.quantize.modelopt.library import LOG_NAME, NEWEST, modelopt_version
from pipeline.quantize.modelopt.run import check_config
from pipeline.quantize.modelopt.shapes import read_hf_config
from pipeline.quantize.modelopt.state import STATE_FILE
from pipeline.runtime.engine_config import TOKENIZER_DIR

HF_DIRNAME, CHECKPOINT_DIRNAME, QUANTIZED_DIRNAME, ENGINE_DIRNAME = (
    STAGE_DIRNAMES[stage] for stage in ("fetch", "convert", "quantize", "engine")
)


def _hf_dir(cfg: BuildConfig, workdir: Path) -> Path:
    return Path(cfg.source.path) if cfg.source.kind == "local" and cfg.source.path else workdir / HF_DIRNAME


def _model_class(hf_dir: Path) -> str:
    """The model class convert will use; an architecture the engine route lacks is refused here, at plan
    time, as convert refuses it."""
    if (hf_dir / "config.json").is_file():
        return model_class_name(hf_dir)
    return "LLaMAForCausalLM"  # the Llama family; resolved from config.json once fetched


def _rank_files(cfg: BuildConfig, suffix: str) -> str:
    return ", ".join(f"rank{r}.{suffix}" for r in range(cfg.parallel.world_size))


def convert_lines(cfg: BuildConfig, workdir: Path) -> list[str]:
    hf_dir, out = _hf_dir(cfg, workdir), workdir / CHECKPOINT_DIRNAME
    q = cfg.quantization
    check_supported(q.mode, q.kv_cache_dtype)
    if not convert_needs_trtllm(cfg):
        if (hf_dir / "config.json").is_file():
            check_config(cfg, read_hf_config(hf_dir))  # as convert does, before calibration
        return [
            f"no TensorRT-LLM conversion for mode={q.mode}, kv={q.kv_cache_dtype}: quantize calibrates and exports "
            f"the HF checkpoint with ModelOpt; check the model's shapes against the format; copy the tokenizer "
            f"to {out / TOKENIZER_DIR}"
        ]
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    clamp = f", clamp_val={FP8_ROWWISE_CLAMP}" if q.mode == "fp8_pc_pt" else ""
    return [
        f"for rank in 0..{tp * pp - 1}: {_model_class(hf_dir)}.from_hugging_face('{hf_dir}', dtype='{cfg.dtype}', "
        f"mapping=Mapping(world_size={tp * pp}, rank=rank, tp_size={tp}, pp_size={pp}), "
        f"quant_config=QuantConfig(quant_algo={convert_quant_algo(cfg)}{clamp}), load_model_on_cpu=True)"
        f".save_checkpoint('{out}', save_config=rank == 0)",
        f"writes {out}/config.json, {_rank_files(cfg, 'safetensors')}, {TOKENIZER_DIR}/",
    ]


def quantize_lines(cfg: BuildConfig, workdir: Path) -> list[str]:
    q, out = cfg.quantization, workdir / QUANTIZED_DIRNAME
    check_supported(q.mode, q.kv_cache_dtype)
    if not needs_calibration(cfg):
        return [
            f"no calibration for mode={q.mode}, kv={q.kv_cache_dtype}: link {workdir / CHECKPOINT_DIRNAME} -> {out}"
        ]
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    calib = q.calibration
    hf_dir = _hf_dir(cfg, workdir)
    hf_config = read_hf_config(hf_dir) if (hf_dir / "config.json").is_file() else None
    if hf_config is not None:
        check_config(cfg, hf_config)
    base = MODE_CONFIGS.get(q.mode, "no weight quantizers")
    kv = "" if q.kv_cache_dtype == "auto" else f" + {q.kv_cache_dtype} KV cache on *[kv]_bmm_quantizer"
    block = block_size(q.mode, q.group_size)
    blocks = f", weight blocks of {block}" if block else ""
    dataset = "llmpipe's shipped calibration set" if calib.dataset == "builtin" else calib.dataset
    release = modelopt_version() or ".".join(map(str, NEWEST))
    known = hf_config is not None or cfg.dtype != "auto"
    dtype = checkpoint_dtype(cfg.dtype, hf_config or {}) if known else "auto (float32 -> float16)"
    decoder = DECODER_TYPES.get(hf_architecture(hf_dir), "?") if hf_config else "llama"
    return [
        f"ModelOpt {release}: load '{hf_dir}' in float32 on the CPU (transformers); mtq.quantize(model, "
        f"{base}{kv}{blocks}) over {calib.num_samples} samples of {dataset} (max_seq_length "
        f"{calib.max_seq_length}, batch_size {calib.batch_size}, seed {calib.seed})",
        f"export_tensorrt_llm_checkpoint(model, '{decoder}', {dtype}, inference_tensor_parallel={tp}, "
        f"inference_pipeline_parallel={pp}) -> quant_algo {q.quant_algo}, kv_cache_quant_algo "
        f"{q.kv_cache_quant_algo}",
        f"writes {out}/config.json, {_rank_files(cfg, 'safetensors')}, {STATE_FILE} (the calibrated model, for "
        f"validation), {LOG_NAME}; links the tokenizer from {workdir / CHECKPOINT_DIRNAME / TOKENIZER_DIR}",
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
    _model_class(_hf_dir(cfg, workdir))  # refuse an architecture the engine route lacks, whatever the stage
    lines = [line for name in names for line in _STAGES[name](cfg, workdir)]
    reason = trtllm_unavailable_reason()
    if reason and stages_need_trtllm(cfg, names):
        lines.append(f"note: this machine cannot run it: {reason}")
    if "quantize" in names and needs_calibration(cfg) and modelopt_version() is None:
        lines.append("note: quantize needs NVIDIA ModelOpt: pip install 'llmpipe[modelopt]'")
    return lines
