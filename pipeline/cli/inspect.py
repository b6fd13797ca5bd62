"""`llmpipe inspect ENGINE [--onnx FILE]`: what an engine directory holds, and its network as ONNX."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import click

from pipeline.artifacts import read_manifest
from pipeline.backends.trtllm.build_cmd import NETWORK_DIRNAME
from pipeline.cli.options import CONTEXT
from pipeline.errors import MissingArtifactError


def _is_trtllm_engine(engine_dir: Path) -> bool:
    return (engine_dir / "rank0.engine").is_file()


def engine_summary(engine_dir: Path) -> dict[str, Any]:
    config_path = engine_dir / "config.json"
    if not config_path.is_file():
        raise MissingArtifactError(
            f"{engine_dir} holds no config.json: not an engine directory",
            hint="Point at build/<name>/engine (written by `llmpipe build`).",
        )
    config = json.loads(config_path.read_text())
    pretrained, build = config.get("pretrained_config", {}), config.get("build_config", {})
    manifest = read_manifest(engine_dir)
    facts = manifest.facts if manifest else {}
    return {
        "backend": "trtllm" if _is_trtllm_engine(engine_dir) else config.get("backend", "torch"),
        "version": config.get("version"),
        "architecture": pretrained.get("architecture"),
        "dtype": pretrained.get("dtype"),
        "quantization": pretrained.get("quantization"),
        "mapping": pretrained.get("mapping"),
        "limits": {
            k: build.get(k)
            for k in (
                "max_batch_size",
                "max_input_len",
                "max_seq_len",
                "max_num_tokens",
                "max_beam_width",
                "max_draft_len",
            )
        },  # fmt: skip
        "built_with": {
            k: facts.get(k)
            for k in ("tensorrt_llm_version", "tensorrt_version", "gpu_compute_capability")
            if facts.get(k)
        },  # fmt: skip
    }


def onnx_for_engine(engine_dir: Path, onnx_file: Path) -> list[dict[str, Any]]:
    """torch engines: export one decoder step (checked with onnx.checker); trtllm engines: copy the network
    trtllm-build exported (engine.visualize_network), listed but not checked (TensorRT layer types)."""
    if not _is_trtllm_engine(engine_dir):
        from pipeline.backends.trtllm.inspect.onnx_export import export_decoder_step

        return [export_decoder_step(engine_dir, onnx_file)]
    from pipeline.backends.trtllm.inspect.onnx_check import network_files

    network = engine_dir / NETWORK_DIRNAME
    found = network_files(network)
    if not found:
        raise MissingArtifactError(
            f"{network} holds no .onnx files",
            hint="Rebuild the engine with engine.visualize_network: true (trtllm-build --visualize_network).",
        )
    onnx_file.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(network / found[0]["file"], onnx_file)
    return found


@click.command("inspect", context_settings=CONTEXT)
@click.argument("engine", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--onnx",
    "onnx_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the engine's network as ONNX here (a torch engine's is checked with onnx.checker).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def inspect(engine: Path, onnx_file: Path | None, as_json: bool) -> None:
    """Summarise an engine directory; with --onnx, write its network as ONNX for Netron or graph diffs.

    \b
    torch engines: one decoder step (token + KV cache in, logits + KV cache out) exported with
    torch.onnx.export. trtllm engines: the TensorRT network trtllm-build exported (--visualize_network).

    \b
    Examples:
      llmpipe inspect build/smollm2-135m/engine
      llmpipe inspect build/smollm2-135m/engine --onnx step.onnx
    """
    report: dict[str, Any] = {"engine": str(engine), **engine_summary(engine)}
    if onnx_file is not None:
        report["onnx"] = {"file": str(onnx_file), "files": onnx_for_engine(engine, onnx_file)}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        if key != "onnx":
            click.echo(f"{key:13} {value}")
    if onnx_file is not None:
        for item in report["onnx"]["files"]:
            if "nodes" in item:
                click.echo(
                    f"onnx          {item['file']}: onnx.checker: ok ({item['nodes']} nodes, "
                    f"opsets {item['opsets']}, inputs {', '.join(item['inputs'])})"
                )
            else:
                click.echo(f"network       {item['file']}: {item['bytes']} bytes (TensorRT layer types)")
        click.echo(f"wrote         {onnx_file}")
