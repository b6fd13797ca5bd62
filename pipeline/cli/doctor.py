"""`llmpipe doctor`: what this machine can build and serve, and why not when it cannot."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import click

from pipeline.backends.trtllm import env
from pipeline.backends.trtllm.versions import (
    MIN_SM_FOR_KV,
    PINNED,
    PINNED_CONTAINER,
    kv_dtype_builds_on,
    quant_mode_builds_on,
    release_for_runtime,
)
from pipeline.backends.trtllm_pytorch import release as pytorch_route
from pipeline.cli.options import CONTEXT
from pipeline.config.vocab import BACKEND_KV_DTYPES, BACKEND_QUANT_MODES
from pipeline.errors import PipelineError


def _torch_backend(torch: dict[str, Any]) -> dict[str, Any]:
    if torch.get("version") is None:
        return {
            "available": False,
            "reason": torch.get("reason"),
            "device": None,
            "quant_modes": [],
            "fast_dtypes": [],
        }
    device = "cuda" if torch.get("cuda_available") else "cpu"
    return {
        "available": True,
        "reason": None,
        "device": device,
        "quant_modes": list(BACKEND_QUANT_MODES["torch"]),
        "fast_dtypes": _fast_dtypes(device),
    }


def _fast_dtypes(device: str) -> list[str]:
    """The `dtype` values that speed an engine up here: on a CPU, bfloat16 only with bf16 dot products."""
    if device == "cuda":
        return ["float16", "bfloat16", "float32"]
    from pipeline.runtime.kernels.ops import cpu_has_bf16_dot

    return ["float32", "bfloat16"] if cpu_has_bf16_dot() else ["float32"]


def _cpu_kernels(torch: dict[str, Any]) -> dict[str, Any]:
    """The torch backend's CPU kernel library: the ISA and compiler it is built with, its cache path and
    whether it is built there (it is not built here: the engine stage or the first model load does that)."""
    report: dict[str, Any] = {"isa": None, "compiler": None, "library": None, "built": False, "reason": None}
    if torch.get("version") is None:
        return {**report, "reason": torch.get("reason")}
    from pipeline.runtime.kernels import build

    try:
        library = build.plan_library()
    except build.KernelsUnavailable as exc:
        return {**report, "reason": str(exc)}
    return {
        **report,
        "isa": library.isa,
        "compiler": library.compiler,
        "library": str(library.path),
        "built": library.path.is_file(),
    }


def _trtllm_backend(trtllm: env.Probe, gpus: env.Probe) -> dict[str, Any]:
    reasons = [r for r in (trtllm.reason, gpus.reason) if r]
    if trtllm.value is not None:
        try:
            release_for_runtime(str(trtllm.value))
        except PipelineError as err:
            reasons.append(err.message)
    if reasons:
        return {"available": False, "reason": "; ".join(reasons), "quant_modes": [], "kv_cache_dtypes": []}
    sms = [g.sm for g in gpus.value]
    return {
        "available": True,
        "reason": None,
        "quant_modes": [
            m for m in BACKEND_QUANT_MODES["trtllm"] if all(quant_mode_builds_on(m, sm) for sm in sms)
        ],
        "kv_cache_dtypes": [k for k in MIN_SM_FOR_KV if all(kv_dtype_builds_on(k, sm) for sm in sms)],
    }


def _trtllm_pytorch_backend(trtllm: env.Probe, gpus: env.Probe) -> dict[str, Any]:
    """Serving needs TensorRT-LLM's release line and a GPU; building does not (nothing is compiled and
    ModelOpt quantizes on the CPU), so a build can be made here and served elsewhere."""
    reasons = [r for r in (trtllm.reason, gpus.reason) if r]
    if trtllm.value is not None and not pytorch_route.is_pinned_release(str(trtllm.value)):
        reasons.append(
            f"TensorRT-LLM {trtllm.value} is installed; this route is written for {pytorch_route.PINNED} "
            f"({pytorch_route.PINNED_CONTAINER})"
        )
    report: dict[str, Any] = {"builds_here": True, "quant_modes": [], "kv_cache_dtypes": []}
    if reasons:
        return {**report, "available": False, "reason": "; ".join(reasons)}
    sms = [g.sm for g in gpus.value]

    def everywhere(gpu_range: tuple[int, int | None]) -> bool:
        return all(pytorch_route.runs_on(gpu_range, sm) for sm in sms)

    return {
        **report,
        "available": True,
        "reason": None,
        "quant_modes": [
            m
            for m in BACKEND_QUANT_MODES["trtllm_pytorch"]
            if everywhere(pytorch_route.GPU_RANGE_FOR_QUANT[m])
        ],
        "kv_cache_dtypes": [
            k for k in BACKEND_KV_DTYPES["trtllm_pytorch"] if everywhere(pytorch_route.GPU_RANGE_FOR_KV[k])
        ],
    }


def collect_report() -> dict[str, Any]:
    gpus, trtllm = env.gpus(), env.tensorrt_llm_version()
    torch = env.torch_info()
    return {
        "python": env.python_version(),
        "gpus": gpus.as_dict(),
        "cuda_driver": env.cuda_driver_version().as_dict(),
        "torch": torch,
        "tensorrt_llm": trtllm.as_dict(),
        "tensorrt": env.tensorrt_version().as_dict(),
        "tritonserver": env.tritonserver_version().as_dict(),
        "pinned_release": {"tensorrt_llm": PINNED, "container": PINNED_CONTAINER},
        "backends": {
            "torch": _torch_backend(torch),
            "trtllm": _trtllm_backend(trtllm, gpus),
            "trtllm_pytorch": _trtllm_pytorch_backend(trtllm, gpus),
        },
        "routes": {name: asdict(route) for name, route in pytorch_route.ROUTES.items()},
        "cpu_kernels": _cpu_kernels(torch),
    }


def _shown(probe: dict[str, Any]) -> str:
    return str(probe["value"]) if probe["value"] is not None else f"- ({probe['reason']})"


def format_table(report: dict[str, Any]) -> str:
    gpu_list = report["gpus"]["value"]
    gpu_text = (
        "; ".join(
            f"{g['index']}: {g['name']} (compute {g['compute_capability']}, {g['memory_total_mib']} MiB)"
            for g in gpu_list
        )  # fmt: skip
        if gpu_list
        else f"- ({report['gpus']['reason']})"
    )
    torch = report["torch"]
    torch_text = (
        f"{torch['version']} (CUDA build {torch['cuda']})"
        if torch.get("version")
        else f"- ({torch['reason']})"
    )
    rows = [
        ("python", report["python"]),
        ("GPUs", gpu_text),
        ("CUDA (driver)", _shown(report["cuda_driver"])),
        ("torch", torch_text),
        ("TensorRT-LLM", _shown(report["tensorrt_llm"])),
        ("TensorRT", _shown(report["tensorrt"])),
        ("tritonserver", _shown(report["tritonserver"])),
        ("pinned release", f"TensorRT-LLM {report['pinned_release']['tensorrt_llm']} "
                           f"({report['pinned_release']['container']})"),
    ]  # fmt: skip
    for name, backend in report["backends"].items():
        if backend["available"]:
            extra = f" on {backend['device']}" if backend.get("device") else ""
            text = f"yes{extra}; quantization: {', '.join(backend['quant_modes'])}"
            if backend.get("fast_dtypes"):
                text += f"; fast dtypes: {', '.join(backend['fast_dtypes'])}"
            if backend.get("kv_cache_dtypes"):
                text += f"; KV: {', '.join(backend['kv_cache_dtypes'])}"
        else:
            text = f"no: {backend['reason']}"
            if backend.get("builds_here"):
                text += " (builds here all the same: nothing is compiled)"
        rows.append((f"backend {name}", text))
    for name, route in report["routes"].items():
        rows.append((f"route {name}", pytorch_route.Route(**route).describe()))
    kernels = report["cpu_kernels"]
    if kernels["reason"]:
        kernels_text = f"off: {kernels['reason']}"
    else:
        state = "built" if kernels["built"] else "not built yet (by `llmpipe build` or the first model load)"
        kernels_text = f"{kernels['isa']}, {kernels['compiler']}; {state}: {kernels['library']}"
    rows.append(("CPU kernels", kernels_text))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


@click.command("doctor", context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json: bool) -> None:
    """Show what this machine can do: GPUs, CUDA, TensorRT-LLM, Triton, which backends and quantization
    modes are possible here (and why not), which TensorRT-LLM route, release and container each TensorRT-LLM
    backend takes (and why), and the torch backend's CPU kernels (ISA, compiler, library).

    \b
    Examples:
      llmpipe doctor
      llmpipe doctor --json | jq .backends
    """
    report = collect_report()
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))
