"""quantize (torch backend): weight-only int8 (W8A16, per output channel), SmoothQuant W8A8 (int8_sq: the same
int8 weights after calibrated smoothing, quantize/smoothquant.py, and int8 activations per token at run time),
int4 (W4A16, group-wise with zero points), activation-aware int4 (W4A16_AWQ: calibrated input scales folded into the preceding
weights, then the same int4 format; int8 too with quantization.activation_aware) or GPTQ int4 (W4A16_GPTQ:
the same format, levels chosen by error-feedback rounding on calibration inputs) applied to a converted
checkpoint; any int4 mode can then have its grids tuned end to end (quantization.tune,
backends/torch/grid_tune.py). The packed tensors use the on-disk layout of
`pipeline.runtime.quant.primitives`; the scheme and group size go into `config.json`'s `quantization`
section, which the runtime's loader reads (never a file name)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pipeline.architectures import torch_quantization_problem
from pipeline.config.build_config import BuildConfig, QuantizationSection
from pipeline.errors import ConfigError, MissingArtifactError, UnsupportedModelError
from pipeline.quantize.kv_cache import quantize_kv_only
from pipeline.runtime.engine_config import TOKENIZER_DIR, WEIGHTS_FILE
from pipeline.runtime.model.weight_names import LAYER_LINEARS
from pipeline.runtime.quant.linear import QuantLinear, Scheme

# quantization.mode -> the QuantLinear scheme.
SCHEMES: dict[str, Scheme] = {
    "int8_wo": "int8",
    "int8_sq": "w8a8",
    "int4_wo": "int4",
    "int4_awq": "int4",
    "int4_gptq": "int4",
}
# Modes whose scales are always searched on calibration data first (quantize/awq.py); int8_wo does
# when quantization.activation_aware is set. int4_gptq rounds better after the search (quantize/gptq.py).
ACTIVATION_AWARE = ("int4_awq", "int4_gptq")


def quantize(cfg: BuildConfig, ckpt_dir: Path, out_dir: Path, hf_dir: Path | None = None) -> dict[str, Any]:
    """Write the quantized checkpoint of `ckpt_dir` into `out_dir`. `hf_dir` (the HF checkpoint) is run on
    the calibration set by the activation-aware modes; round-to-nearest needs no data."""
    started = time.perf_counter()
    q = cfg.quantization
    if q.mode != "none" and q.mode not in SCHEMES:
        raise ConfigError(
            f"quantization.mode={q.mode} is not implemented by the torch backend's quantizer; "
            f"choose one of {', '.join(SCHEMES)}"
        )
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    config_path = ckpt_dir / "config.json"
    if not config_path.is_file():
        raise MissingArtifactError(f"{config_path} not found: the convert stage has not run")
    pretrained = json.loads(config_path.read_text(encoding="utf-8"))
    problem = torch_quantization_problem(pretrained, q.mode, is_calibrated(q))
    if problem:
        raise UnsupportedModelError(problem)
    if q.mode == "none":  # only the KV cache is quantized, at run time
        return quantize_kv_only(cfg, pretrained, ckpt_dir, out_dir)
    scheme = SCHEMES[q.mode]
    group_size = q.group_size if scheme == "int4" else None

    tensors = load_file(str(ckpt_dir / WEIGHTS_FILE))
    prefixes = [
        f"transformer.layers.{i}.{name}"
        for i in range(pretrained["num_hidden_layers"])
        for name in LAYER_LINEARS
    ]
    if q.quantize_lm_head:
        prefixes.append("lm_head")
    dense_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    calibrated_facts: dict[str, Any] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}  # layers already rounded by GPTQ
    if q.mode == "int4_gptq":
        assert group_size is not None
        packed, calibrated_facts["gptq"] = _gptq(cfg, tensors, pretrained, hf_dir, group_size)
    elif _is_activation_aware(q):
        calibrated_facts["awq"] = _activation_aware(cfg, tensors, pretrained, hf_dir, group_size)
    elif q.mode == "int8_sq":
        calibrated_facts["smoothquant"] = _smoothquant(cfg, tensors, pretrained, hf_dir)
    for prefix in prefixes:
        weight = tensors.pop(f"{prefix}.weight")
        bias = tensors.pop(f"{prefix}.bias", None)
        if prefix in packed:
            bias_tensors = {} if bias is None else {"bias": bias.to(torch.float32)}
            layer = QuantLinear(scheme, {**packed[prefix], **bias_tensors}, group_size)
        else:
            layer = QuantLinear.from_float(
                weight.to(torch.float32), bias, scheme=scheme, group_size=group_size
            )
        for key, value in layer.state_tensors().items():
            tensors[f"{prefix}.{key}"] = value.contiguous()
    if q.tune.enabled:
        from pipeline.quantize.tune.grid import tune_int4_grids

        assert group_size is not None  # config validation allows tuning for int4 modes only
        calibrated_facts["tune"] = tune_int4_grids(
            tensors, _calibration_model(cfg, hf_dir), q.calibration, q.tune, group_size
        )
    quant_bytes = sum(t.numel() * t.element_size() for t in tensors.values())

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE))
    pretrained["quantization"] = {
        **pretrained.get("quantization", {}),
        "quant_algo": q.quant_algo_for("torch"),
        "kv_cache_quant_algo": q.kv_cache_quant_algo,
        "group_size": q.group_size,
        "has_zero_point": scheme == "int4",
        "pre_quant_scale": False,
        "exclude_modules": None if q.quantize_lm_head else ["lm_head"],
    }
    (out_dir / "config.json").write_text(json.dumps(pretrained, indent=2) + "\n")
    if (ckpt_dir / TOKENIZER_DIR).is_dir():
        shutil.copytree(ckpt_dir / TOKENIZER_DIR, out_dir / TOKENIZER_DIR)
    return {
        "quant_algo": q.quant_algo_for("torch"),
        "group_size": group_size,
        "quantized_layers": len(prefixes),
        "weights_bytes_before": dense_bytes,
        "weights_bytes_after": quant_bytes,
        "seconds": round(time.perf_counter() - started, 2),
        **calibrated_facts,
    }


def data_files(cfg: BuildConfig) -> dict[str, Path]:
    """The text files a calibrated or tuned build reads: their contents key the stage's reuse."""
    from pipeline.quantize.calibration import TUNING_TEXT_FIELD
    from pipeline.quantize.calibration import data_files as dataset_data_files

    q = cfg.quantization
    files: dict[str, Path] = {}
    if is_calibrated(q):
        files |= dataset_data_files("calibration", q.calibration.dataset)
    if q.tune.enabled and q.tune.dataset is not None:
        files |= dataset_data_files("tuning_text", q.tune.dataset, TUNING_TEXT_FIELD)
    return files


def is_calibrated(q: QuantizationSection) -> bool:
    """Whether `q` runs the model on calibration data (activation-aware or smoothing scales, GPTQ or grid
    tuning)."""
    return _is_activation_aware(q) or q.mode == "int8_sq" or q.tune.enabled


def _is_activation_aware(q: QuantizationSection) -> bool:
    """Whether `q` searches its scales on calibration data first (its mode always does, or int8_wo asks)."""
    return q.mode in ACTIVATION_AWARE or q.activation_aware


def _activation_aware(
    cfg: BuildConfig,
    tensors: dict[str, torch.Tensor],
    pretrained: dict[str, Any],
    hf_dir: Path | None,
    group_size: int | None,
) -> dict[str, Any]:
    """Search and fold the input scales of every block's linear layers into `tensors` (in place)."""
    from pipeline.quantize.awq import apply_activation_aware_scales
    from pipeline.quantize.awq_search import WeightFormat
    from pipeline.quantize.calibration import layer_input_stats

    calibration = cfg.quantization.calibration
    tokens, block_stats = layer_input_stats(_calibration_model(cfg, hf_dir), calibration)
    fmt = WeightFormat(SCHEMES[cfg.quantization.mode], group_size)
    facts = apply_activation_aware_scales(tensors, pretrained, block_stats, fmt)
    return {"calibration": {**calibration.model_dump(), "tokens": tokens}, **facts}


def _smoothquant(
    cfg: BuildConfig, tensors: dict[str, torch.Tensor], pretrained: dict[str, Any], hf_dir: Path | None
) -> dict[str, Any]:
    """Measure and fold SmoothQuant's scales of every block's linear layers into `tensors` (in place)."""
    from pipeline.quantize.calibration import layer_input_stats
    from pipeline.quantize.smoothquant import apply_smoothquant

    calibration = cfg.quantization.calibration
    tokens, block_stats = layer_input_stats(_calibration_model(cfg, hf_dir), calibration)
    facts = apply_smoothquant(tensors, pretrained, block_stats, cfg.quantization.smoothing_alpha)
    return {"calibration": {**calibration.model_dump(), "tokens": tokens}, **facts}


def _gptq(
    cfg: BuildConfig,
    tensors: dict[str, torch.Tensor],
    pretrained: dict[str, Any],
    hf_dir: Path | None,
    group_size: int,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Fold activation-aware scales into `tensors`, then GPTQ-round every block's linear layers."""
    from pipeline.quantize.gptq import apply_gptq

    calibration = cfg.quantization.calibration
    return apply_gptq(tensors, pretrained, _calibration_model(cfg, hf_dir), calibration, group_size)


def _calibration_model(cfg: BuildConfig, hf_dir: Path | None) -> Path:
    if hf_dir is None:
        raise MissingArtifactError(
            f"quantization.mode={cfg.quantization.mode} calibrates on the HF checkpoint, which was not given"
        )
    return Path(hf_dir)
