"""`llmpipe validate`: accuracy gates of built engines (or a running Triton deployment) against the HF reference."""

from __future__ import annotations

import logging
from typing import Any

import click

from pipeline.artifacts import MANIFEST_NAME
from pipeline.cli.options import CONTEXT, overrides_option
from pipeline.config.build_config import BuildConfig, load_build_config
from pipeline.config.workdir import resolve_workdir, stage_output_dir
from pipeline.stages.chain import STAGES, built_output
from pipeline.stages.runner import run_stage


@click.command("validate", context_settings=CONTEXT)
@click.argument("configs", nargs=-1, required=True, type=click.Path(dir_okay=False), metavar="CONFIG...")
@click.option(
    "--endpoint",
    metavar="URL",
    help="Validate the Triton deployment at URL (http://HOST:8000 or grpc://HOST:8001) through its ensemble "
    "instead of the in-process engine: text metrics only; the report goes to build/<name>/validation-endpoint/.",
)
@click.option(
    "--openai-endpoint",
    metavar="URL",
    help="Run lm-evaluation-harness (validation.lm_eval's tasks) against the OpenAI API at URL "
    "(http://HOST:9000/v1) and against lm-eval's hf model on the build's checkpoint; fail when a score differs "
    "beyond lm-eval's stderr. Needs `make eval-deps`; the report goes to build/<name>/validation-lm-eval/.",
)
@click.option(
    "--plot",
    is_flag=True,
    help="Also write a bar chart of the gated metrics, one bar per CONFIG, to "
    "build/<first config's name>/validation.png (needs matplotlib).",
)
@overrides_option("validation.num_samples=4")
@click.option(
    "--force", is_flag=True, help="Measure again even when this engine and config were already validated."
)
def validate(
    configs: tuple[str, ...],
    endpoint: str | None,
    openai_endpoint: str | None,
    plot: bool,
    overrides: tuple[str, ...],
    force: bool,
) -> None:
    """Compare each build with the float32 Hugging Face reference of its checkpoint; exit 1 on a regression.

    Metrics: teacher-forced greedy agreement, next-token top-1 agreement and mean KL(reference || engine) and
    the perplexity delta on held-out text, ROUGE-1/2/L of summaries and exact match on short questions (the
    eval set ships with llmpipe). Bounds come from `validation.thresholds` in the config; unset ones default
    per quantization mode (exact agreement for an unquantized float32 engine). A trtllm build, whose engine needs a GPU,
    is measured before any GPU time: its ModelOpt-quantized checkpoint runs in ModelOpt's simulated
    quantization (the same weights and scales the export writes) on CPU. The table goes to stdout, the
    full report with every sample's outputs to build/<name>/validation/validation.json. An unchanged engine
    and config are not measured twice: the recorded verdict is shown (and still fails).

    \b
    Examples:
      llmpipe validate build_configs/tiny-llama.yaml
      llmpipe validate build_configs/smollm2-135m.yaml build_configs/smollm2-135m-int8.yaml --plot
      llmpipe validate build_configs/smollm2-135m-int8.yaml --set validation.thresholds.max_ppl_delta_pct=1.5
      llmpipe validate build_configs/smollm2-135m.yaml --endpoint http://127.0.0.1:8000
      llmpipe validate build_configs/smollm2-135m.yaml --openai-endpoint http://127.0.0.1:9000/v1
    """
    if endpoint is not None and openai_endpoint is not None:
        raise click.UsageError("--endpoint and --openai-endpoint gate different APIs: give one of them")
    served = endpoint or openai_endpoint
    if served is not None and len(configs) > 1:
        raise click.UsageError(f"{served} is one deployment: give exactly one CONFIG with it")
    if openai_endpoint is not None:
        _lm_eval_gate(load_build_config(configs[0], overrides), openai_endpoint)
        return
    from pipeline.validate.report import format_table, raise_for_failures

    _log_progress_to_stderr()
    results: list[tuple[dict[str, Any], str]] = []
    loaded: list[BuildConfig] = []
    for config in configs:
        cfg = load_build_config(config, overrides)
        loaded.append(cfg)
        where = f"endpoint {endpoint}" if endpoint else "engine"
        click.echo(
            f"validate {cfg.name}: running the eval set on the {where} and on the reference ...", err=True
        )
        report, path = _endpoint_report(cfg, endpoint) if endpoint else _stage_report(cfg, force)
        click.echo("\n".join(format_table(report) + [f"report: {path}"]))
        results.append((report, path))
    if plot:
        from pipeline.validate.plot import plot_reports

        chart = plot_reports(
            [r for r, _ in results],
            resolve_workdir(loaded[0]) / "validation.png",
        )
        click.echo(f"chart: {chart}", err=True)
    raise_for_failures(results)


class _StderrHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"validate: {record.getMessage()}", err=True)  # looks up the current stderr every time


def _log_progress_to_stderr() -> None:
    # measure.py reports each phase through logging: a run of minutes should say what it is doing.
    logger = logging.getLogger("pipeline.validate")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
        logger.setLevel(logging.INFO)


def _stage_report(cfg: BuildConfig, force: bool) -> tuple[dict[str, Any], str]:
    from pipeline.validate.run import require_simulation
    from pipeline.validate.stage import SPEC, load_report, report_path

    if "quantize" in SPEC.inputs_for(cfg):  # before asking for a quantize output that cannot exist here
        require_simulation(cfg)
    result = run_stage(cfg, SPEC, STAGES, force=force)
    if result.reused:
        click.echo(
            f"validate {cfg.name}: engine and config unchanged since the last run; showing that result "
            "(--force measures again)",
            err=True,
        )
    return load_report(result), str(report_path(result))


def _lm_eval_gate(cfg: BuildConfig, base_url: str) -> None:
    from pipeline.stages.fetch import checkpoint_dir
    from pipeline.validate.lm_eval_gate import REPORT_FILE, format_table, raise_for_failure, run_gate
    from pipeline.validate.lm_eval_run import lm_eval_python

    python = lm_eval_python(cfg.validation.lm_eval.venv)
    checkpoint = checkpoint_dir(built_output(cfg, "fetch"))
    out = resolve_workdir(cfg) / "validation-lm-eval"
    click.echo(f"validate {cfg.name}: lm-eval on {base_url} and on hf ({checkpoint}) ...", err=True)
    report = run_gate(cfg, python, base_url, checkpoint, out)
    click.echo("\n".join(format_table(report) + [f"report: {out / REPORT_FILE}"]))
    raise_for_failure(report, out / REPORT_FILE)


def _endpoint_report(cfg: BuildConfig, endpoint: str) -> tuple[dict[str, Any], str]:
    from pipeline.validate.report import REPORT_FILE
    from pipeline.validate.run import run

    inputs = {"fetch": built_output(cfg, "fetch")}
    # The local engine, when built, only tells which dtype the deployment computes in (default thresholds).
    if (stage_output_dir(cfg, "engine") / MANIFEST_NAME).is_file():
        inputs["engine"] = built_output(cfg, "engine")
    out = resolve_workdir(cfg) / "validation-endpoint"
    return run(cfg, inputs, out, endpoint=endpoint, check=False), str(out / REPORT_FILE)
