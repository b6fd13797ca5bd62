"""quantize (trtllm): calibrated formats through TensorRT-LLM's `<ModelCls>.quantize` (ModelOpt for fp8,
int8_sq, int4_awq, w4a8_awq, fp8_pc_pt, nvfp4; TensorRT-LLM's own calibration for an int8 KV cache on top of
fp16 or weight-only), the same route examples/quantization/quantize.py takes.

ModelOpt calibrates the HF model, so this step reads the HF checkpoint (`hf_dir`), not the converted one.
Modes that need no calibration (none, int8_wo, int4_wo without a quantized KV cache) were applied by convert
and pass through unchanged.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from pipeline.artifacts import link_tree
from pipeline.backends.trtllm.api import check_unified_checkpoint, load_api, model_class_name
from pipeline.backends.trtllm.versions import CALIBRATED_MODES
from pipeline.config.build_config import BuildConfig
from pipeline.errors import ConfigError, MissingArtifactError
from pipeline.quantize.calibration import load_records
from pipeline.runtime.engine_config import TOKENIZER_DIR

# What `calibration.dataset: builtin` means on this path: TensorRT-LLM's own default calibration set,
# fetched from the Hugging Face Hub by ModelOpt on the GPU host.
# ModelOpt's tokenizer truncation default; raised when calibration samples are longer.
_TOKENIZER_MAX_SEQ_LENGTH = 2048


def needs_calibration(cfg: BuildConfig) -> bool:
    q = cfg.quantization
    return q.mode in CALIBRATED_MODES or q.kv_cache_dtype != "auto"


def _texts(dataset: str) -> list[str]:
    """The calibration file's samples in the forms both backends read (quantize.calibration); a chat
    record becomes its messages' contents, since ModelOpt calibrates on plain text."""
    records = load_records(dataset)
    return [r if isinstance(r, str) else "\n".join(m["content"] for m in r) for r in records]


def calibration_dataset(cfg: BuildConfig, scratch: Path) -> str:
    """A calib_dataset value ModelOpt accepts: a local folder whose train split has a `text` column (one
    JSON object per line in train.jsonl). `builtin` is llmpipe's shipped calibration set, as on the torch
    backend: no dataset is fetched from a hub."""
    source = cfg.quantization.calibration.dataset
    path = Path(source).expanduser()
    if source != "builtin" and path.is_dir():
        return str(path)
    if source != "builtin" and not path.is_file():
        raise MissingArtifactError(f"quantization.calibration.dataset={source}: no such file or folder")
    texts = _texts(source)
    folder = scratch / "calibration"
    folder.mkdir(parents=True)
    with (folder / "train.jsonl").open("w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}) + "\n")
    return str(folder)


def quantize(cfg: BuildConfig, ckpt_dir: Path, out_dir: Path, hf_dir: Path | None = None) -> dict[str, Any]:
    q = cfg.quantization
    api = load_api()
    if not needs_calibration(cfg):
        link_tree(ckpt_dir, out_dir)
        return {"quant_algo": q.quant_algo, "kv_cache_quant_algo": None, "pass_through": True,
                "tensorrt_llm_version": api.version}  # fmt: skip
    if hf_dir is None:
        raise MissingArtifactError("quantization needs the HF checkpoint (ModelOpt calibrates the HF model)")
    if q.quantize_lm_head:
        raise ConfigError(
            "quantization.quantize_lm_head=true is not reachable through <ModelCls>.quantize on this path",
            hint="Set quantization.quantize_lm_head: false, or run TensorRT-LLM's quantize.py --quantize_lm_head.",
        )
    class_name = model_class_name(hf_dir)
    tp, pp = cfg.parallel.tp_size, cfg.parallel.pp_size
    mapping = api.mapping(world_size=tp * pp, tp_size=tp, pp_size=pp)
    quant_config = api.make_quant_config(q.quant_algo, q.kv_cache_quant_algo, q.group_size)
    calib = q.calibration
    with tempfile.TemporaryDirectory(prefix="llmpipe-calib-") as scratch:
        dataset = calibration_dataset(cfg, Path(scratch))
        api.model_class(class_name).quantize(
            str(hf_dir),
            str(out_dir),
            dtype=cfg.dtype,
            mapping=mapping,
            quant_config=quant_config,
            calib_dataset=dataset,
            calib_batches=calib.num_samples,
            calib_batch_size=calib.batch_size,
            calib_max_seq_length=calib.max_seq_length,
            tokenizer_max_seq_length=max(_TOKENIZER_MAX_SEQ_LENGTH, calib.max_seq_length),
            random_seed=calib.seed,
        )
    files = check_unified_checkpoint(out_dir, tp * pp)
    if (ckpt_dir / TOKENIZER_DIR).is_dir():
        link_tree(ckpt_dir / TOKENIZER_DIR, out_dir / TOKENIZER_DIR)
    return {
        "quant_algo": q.quant_algo,
        "kv_cache_quant_algo": q.kv_cache_quant_algo,
        "group_size": q.group_size,
        "calib_dataset": calib.dataset,
        "calib_samples": calib.num_samples,
        "calib_max_seq_length": calib.max_seq_length,
        "checkpoint_files": files,
        "tensorrt_llm_version": api.version,
        "tool_packages": ["tensorrt_llm"],
    }
