"""The `validate` stage: build/<name>/validation/validation.json from the fetched checkpoint and the engine.

A failing build is still a result worth keeping: `produce` records the verdict (facts `passed`, `failures`)
instead of raising, so the report survives the stage's atomic rename and an unchanged engine is not
re-measured. Callers gate on the recorded report: `raise_for_failures([(load_report(result), path)])`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.config.build_config import BuildConfig
from pipeline.stages.runner import StageInput, StageResult, StageSpec
from pipeline.validate.report import REPORT_FILE, failures
from pipeline.validate.run import run


def produce(cfg: BuildConfig, inputs: dict[str, StageInput], out: Path) -> dict[str, Any]:
    report = run(cfg, inputs, out, check=False)
    gated = {row["metric"]: row["value"] for row in report["gates"] if row["value"] is not None}
    return {
        "passed": report["passed"],
        "failures": failures(report),
        "profile": report["profile"],
        "metrics": gated,
    }


def report_path(result: StageResult) -> Path:
    return result.dir / REPORT_FILE


def load_report(result: StageResult) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(report_path(result).read_text(encoding="utf-8"))
    return report


def describe(cfg: BuildConfig, out: Path) -> list[str]:
    v = cfg.validation
    measured = "the engine"
    if "quantize" in SPEC.inputs_for(cfg):
        measured = "the ModelOpt-quantized model (simulated quantization, float32 on CPU)"
    return [
        f"run {measured} and the float32 HF reference on the {v.dataset} eval set ({v.num_samples} samples "
        f"per metric, {v.max_new_tokens} new tokens); gate on validation.thresholds -> {out}/{REPORT_FILE}"
    ]


SPEC = StageSpec(
    name="validate",
    # quantization and dtype pick the default thresholds; the engine's digest covers everything it ran.
    config_sections=("validation", "quantization", "dtype"),
    inputs=("fetch", "engine"),
    # trtllm engines run only on a GPU: their quantized checkpoint is validated in simulation on any host
    backend_inputs={"trtllm": ("fetch", "quantize"), "trtllm_pytorch": ("fetch", "quantize")},
    produce=produce,
    describe=describe,
    summary="Check the engine's accuracy against the HF reference (greedy agreement, KL, perplexity, ROUGE).",
)
