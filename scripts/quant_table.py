"""The quantization table on SmolLM2-135M, one row per quantization mode: engine size, accuracy against the HF
float32 reference (the `validate` stage's metrics: greedy agreement, top-1 agreement, mean KL, perplexity
delta, ROUGE-L drop) and decode tok/s of one request and of 16 concurrent ones. A benchmark, not a test.

Each mode's engine and validation are build stages: reused when fresh, built when not (a validation runs
the HF reference and takes ~10 minutes on 2 cores; --no-validate skips them and leaves those cells empty).

    python scripts/quant_table.py --out benchmarks/results
    python scripts/quant_table.py --modes fp32,int8_wo --no-validate
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.util.openmp import default_wait_policy  # noqa: E402

default_wait_policy(os.environ)  # before torch loads
from pipeline.bench import report  # noqa: E402
from pipeline.bench.builds import ensure_built  # noqa: E402
from pipeline.bench.decode import decode_speed, random_prompts  # noqa: E402
from pipeline.config.build_config import BuildConfig  # noqa: E402
from pipeline.errors import run_script  # noqa: E402

SMOLLM2 = "build_configs/smollm2-135m.yaml"
# label -> (build config, overrides)
MODES: dict[str, tuple[str, list[str]]] = {
    "fp32": (SMOLLM2, []),
    "bf16": ("build_configs/smollm2-135m-bf16.yaml", []),
    "int8_wo": ("build_configs/smollm2-135m-int8.yaml", []),
    "int8_wo activation-aware": ("build_configs/smollm2-135m-int8-awq.yaml", []),
    "int8_sq (W8A8)": ("build_configs/smollm2-135m-int8-sq.yaml", []),
    "int4_wo g128": ("build_configs/smollm2-135m-int4.yaml", []),
    "int4_awq g128": ("build_configs/smollm2-135m-int4-awq.yaml", []),
    "int4_gptq g128": ("build_configs/smollm2-135m-int4-gptq.yaml", []),
    "fp32 + int8 KV cache": ("build_configs/smollm2-135m-int8kv.yaml", []),
}
METRICS = ("greedy_agreement", "top1_agreement", "mean_kl", "ppl_delta_pct", "rougeL_drop")
COLUMNS = (
    ("mode", "mode"),
    ("engine_mb", "engine MB"),
    ("greedy_agreement", "greedy agreement"),
    ("top1_agreement", "top-1 agreement"),
    ("mean_kl", "mean KL"),
    ("ppl_delta_pct", "ppl delta %"),
    ("rougeL_drop", "ROUGE-L drop"),
    ("passed", "gates"),
    ("decode_c1", "decode tok/s, 1 request"),
    ("decode_c16", "decode tok/s, 16 concurrent"),
    ("load", "load avg"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated labels of the modes above")
    parser.add_argument("--no-validate", action="store_true", help="sizes and speeds only")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="also write <out>/<date>-<machine>-quant.md")
    return parser.parse_args(argv)


def _validation(cfg: BuildConfig) -> dict[str, Any]:
    from pipeline.stages.chain import STAGES
    from pipeline.stages.runner import run_stage
    from pipeline.validate.stage import SPEC, load_report

    result = run_stage(cfg, SPEC, {**STAGES, SPEC.name: SPEC})
    validation = load_report(result)
    row = {name: validation["metrics"].get(name) for name in METRICS}
    row["passed"] = (
        "pass"
        if validation["passed"]
        else "FAIL: " + ", ".join(gate["metric"] for gate in validation["gates"] if gate["status"] == "fail")
    )
    return row


def _speeds(engine_dir: Path, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    from pipeline.runtime.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_dir(engine_dir)
    prompts = random_prompts(18, prompt_len, engine.runner.config.model.vocab_size)  # type: ignore[attr-defined]
    load = report.load_1m()
    decode_speed(engine, prompts[:1], 8)  # warm-up: kernels built, caches primed
    single = decode_speed(engine, prompts[1:2], new_tokens)
    batched = decode_speed(engine, prompts[2:], new_tokens)
    return {"decode_c1": single["decode_tok_s"], "decode_c16": batched["decode_tok_s"], "load": load}


def measure(label: str, args: argparse.Namespace) -> dict[str, Any]:
    config, overrides = MODES[label]
    build = ensure_built(config, overrides, until="engine")
    assert build.engine_dir is not None
    size = sum(f.stat().st_size for f in build.engine_dir.glob("*.safetensors"))
    row: dict[str, Any] = {"mode": label, "engine_mb": round(size / 1e6, 1)}
    if not args.no_validate:
        row |= _validation(build.cfg)
    print(f"{label}: measuring decode speed", file=sys.stderr)
    return row | _speeds(build.engine_dir, args.prompt_len, args.new_tokens)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    labels = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in labels if m not in MODES]
    if unknown:
        print(f"unknown mode(s) {', '.join(unknown)}; choose from: {', '.join(MODES)}", file=sys.stderr)
        return 2
    command = "python scripts/quant_table.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    rows = [measure(label, args) for label in labels]
    print(report.format_table(rows, COLUMNS))
    if args.out is not None:
        page = args.out / f"{time.strftime('%Y-%m-%d')}-{report.machine_tag()}-quant.md"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(
            "# Quantization modes on SmolLM2-135M\n\n"
            f"Command: `{command}`\n\n"
            "Accuracy: the `validate` stage against the HF float32 reference (builtin eval set; see "
            "pipeline/data/eval/README.md). Decode: greedy, random "
            f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, in-process, default threads "
            "(pipeline/bench/decode.py). Engine MB: the engine's safetensors files.\n\n"
            + report.markdown_table(rows, COLUMNS)
            + "\n"
        )
        print(f"wrote {page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_script(main)
