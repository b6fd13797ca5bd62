"""`run(cfg, inputs, out_dir)`: measure a build against its float32 HF reference, write validation.json
(and validation.png when asked), and raise AccuracyRegression naming every metric outside its bound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.config.build_config import BuildConfig
from pipeline.errors import BackendUnavailableError, ConfigError, MissingArtifactError
from pipeline.stages.fetch import checkpoint_dir
from pipeline.stages.runner import StageInput
from pipeline.validate.data import load_eval_set
from pipeline.validate.measure import Settings, measure
from pipeline.validate.reference import ReferenceModel
from pipeline.validate.report import PLOT_FILE, REPORT_FILE, build_report, raise_for_failures
from pipeline.validate.thresholds import profile_name, resolve_gates


def run(
    cfg: BuildConfig,
    inputs: dict[str, StageInput],
    out_dir: Path,
    *,
    endpoint: str | None = None,
    plot: bool = False,
    check: bool = True,
) -> dict[str, Any]:
    """inputs: "fetch" (the reference checkpoint) and, unless `endpoint` is given, "engine" — or for a
    TensorRT-LLM build "quantize", whose ModelOpt-quantized model is measured in simulation.

    With `endpoint` (a Triton URL), the deployment behind it is validated through its ensemble instead of
    the in-process engine; only the text metrics can be measured there (the report says why).
    `check=False` writes the report without raising (the stage records failing results too).
    """
    if "fetch" not in inputs:
        raise MissingArtifactError(
            "validate needs the fetched checkpoint", hint="Run `llmpipe fetch CONFIG` first."
        )
    simulated = endpoint is None and "quantize" in inputs
    if simulated:  # before the models load: a format that cannot be simulated fails at once
        require_simulation(cfg)
    evalset = load_eval_set(cfg.validation.dataset)
    reference = ReferenceModel(checkpoint_dir(inputs["fetch"]))
    engine_input = inputs.get("engine")
    compute_dtype = _compute_dtype(cfg, engine_input)
    target: Any
    if endpoint is not None:
        from pipeline.validate.endpoint import EndpointTarget

        target = EndpointTarget(endpoint)
    elif simulated:
        from pipeline.validate.simulated import SimulatedTarget

        target = SimulatedTarget(
            checkpoint_dir(inputs["fetch"]), inputs["quantize"].dir, cfg.engine.max_input_len
        )
        compute_dtype = "float32"
    else:
        if engine_input is None:
            raise MissingArtifactError(
                "validate needs a built engine", hint="Run `llmpipe build CONFIG` first."
            )
        from pipeline.validate.engine_side import EngineTarget

        target = EngineTarget.from_engine_dir(engine_input.dir)
    settings = Settings(cfg.validation.num_samples, cfg.validation.max_new_tokens)
    measurement = measure(evalset, reference, target, settings)
    q = cfg.quantization
    gates = resolve_gates(cfg.validation.thresholds, q.mode, q.kv_cache_dtype, compute_dtype, simulated)
    header = {
        "build": cfg.name,
        "target": target.name,
        "quantization": {"mode": q.mode, "kv_cache_dtype": q.kv_cache_dtype, "group_size": q.group_size},
        "compute_dtype": compute_dtype,
        "profile": profile_name(q.mode, q.kv_cache_dtype, compute_dtype, simulated),
        "dataset": evalset.origin,
        "num_samples": settings.num_samples,
        "max_new_tokens": settings.max_new_tokens,
    }
    report = build_report(header, gates, measurement)
    out_dir.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / REPORT_FILE
    report_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if plot:
        from pipeline.validate.plot import plot_reports

        plot_reports([report], out_dir / PLOT_FILE)
    if check:
        raise_for_failures([(report, str(report_path))])
    return report


def require_simulation(cfg: BuildConfig) -> None:
    """Only formats ModelOpt quantizes can be simulated on a host without TensorRT-LLM."""
    from pipeline.quantize.modelopt.formats import uses_modelopt

    q = cfg.quantization
    if not uses_modelopt(q.mode, q.kv_cache_dtype):
        raise ConfigError(
            f"quantization.mode={q.mode} kv_cache_dtype={q.kv_cache_dtype} on backend={cfg.backend}: llmpipe "
            "simulates only the formats ModelOpt quantizes, and this one is produced by TensorRT-LLM itself",
            hint="Validate the served deployment instead: llmpipe validate CONFIG --endpoint http://HOST:8000",
        )
    if q.mode == "nvfp4":
        # Its activations quantize dynamically per block of 16, which ModelOpt runs only on CUDA tensors
        # (its calibration runs on the CPU; the quantized forward asserts "amax must be a CUDA tensor").
        raise BackendUnavailableError(
            "quantization.mode=nvfp4: ModelOpt simulates NVFP4's dynamic activation quantization only on CUDA "
            "tensors, and llmpipe's simulation runs on the CPU (the NVFP4 checkpoint itself is written)",
            hint="Validate the served deployment: llmpipe validate CONFIG --endpoint http://HOST:8000",
        )


def _compute_dtype(cfg: BuildConfig, engine_input: StageInput | None) -> str | None:
    """The engine's compute dtype: what its config.json records, else the build config's explicit dtype.

    Read raw rather than with runtime.engine_config.load_engine_config: with `endpoint` the local engine
    may be a TensorRT-LLM one (head_size rather than head_dim, possibly several ranks), which that loader
    refuses; only the dtype is needed here."""
    if engine_input is not None and (engine_input.dir / "config.json").is_file():
        config = json.loads((engine_input.dir / "config.json").read_text(encoding="utf-8"))
        dtype = config.get("pretrained_config", {}).get("dtype")
        if dtype:
            return str(dtype)
    return None if cfg.dtype == "auto" else cfg.dtype
