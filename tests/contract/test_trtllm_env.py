"""`llmpipe doctor` and the probes behind it, on this GPU-less machine and on parsed GPU output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from pipeline.backends.trtllm import env
from pipeline.backends.trtllm.inspect.onnx_check import check_onnx_file, network_files
from pipeline.cli.doctor import collect_report, doctor, format_table
from pipeline.errors import IntegrityError
from pipeline.runtime.kernels import build


def test_nvidia_smi_rows_parse_into_gpus() -> None:
    rows = "0, NVIDIA H100 80GB HBM3, 9.0, 81559, 80871\n1, NVIDIA L40S, 8.9, 46068, 45000\n"
    h100, l40s = env.parse_nvidia_smi_gpus(rows)
    assert (h100.index, h100.name, h100.sm, h100.memory_free_mib) == (0, "NVIDIA H100 80GB HBM3", 90, 80871)
    assert l40s.sm == 89


def test_tritonserver_version_is_read_from_its_option_table() -> None:
    log = "| server_id                        | triton |\n| server_version                   | 2.51.0 |\n"
    assert env.parse_server_version(log) == "2.51.0"
    assert env.parse_server_version("error: creating server") is None


def test_doctor_here_reports_torch_available_and_trtllm_not_with_the_reason() -> None:
    result = CliRunner().invoke(doctor, ["--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["backends"]["torch"]["available"] is True
    assert "int4_wo" in report["backends"]["torch"]["quant_modes"]
    bf16_dot = {"avx512_bf16", "amx_bf16"} & build.cpu_flags()
    expected = ["float32", "bfloat16"] if bf16_dot else ["float32"]
    assert report["backends"]["torch"]["fast_dtypes"] == expected
    trtllm = report["backends"]["trtllm"]
    assert trtllm["available"] is False
    assert "pip install llmpipe[trtllm]" in trtllm["reason"] and "nvidia-smi not found" in trtllm["reason"]
    assert report["pinned_release"]["tensorrt_llm"] == "1.1.0"
    table = CliRunner().invoke(doctor, []).output
    assert re.search(r"\nbackend torch +yes on cpu", table)
    assert re.search(r"\nbackend trtllm +no: TensorRT-LLM is not installed", table)
    assert f"fast dtypes: {', '.join(expected)}" in table


def test_doctor_reports_the_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(build.DISABLE_ENV, raising=False)
    kernels = collect_report()["cpu_kernels"]
    try:
        library = build.plan_library()
    except build.KernelsUnavailable as exc:
        assert kernels["reason"] == str(exc)
    else:
        assert kernels == {
            "isa": build.kernel_isa(),
            "compiler": build.compiler_identity(build.compiler_command()),
            "library": str(library.path),
            "built": library.path.is_file(),
            "reason": None,
        }
        row = f"{kernels['isa']}, {kernels['compiler']}; "
        assert re.search(r"\nCPU kernels +" + re.escape(row), format_table(collect_report()))
    monkeypatch.setenv("CXX", "no-such-c++")
    report = json.loads(CliRunner().invoke(doctor, ["--json"]).output)
    if "compiler" in (report["cpu_kernels"]["reason"] or ""):
        assert report["cpu_kernels"]["isa"] is None and report["cpu_kernels"]["built"] is False
        table = CliRunner().invoke(doctor, []).output
        assert re.search(r"\nCPU kernels +off: no C\+\+ compiler 'no-such-c\+\+' on PATH", table)


def test_tritonserver_version_of_the_bundled_server() -> None:
    # The nvidia-pytriton wheel (installed by `make install`) carries Triton 2.51.0.
    assert env.tritonserver_version().value == "2.51.0"


def test_doctor_on_a_gpu_host_lists_the_formats_the_oldest_gpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [env.Gpu(0, "NVIDIA H100", "9.0", 81559, 80000), env.Gpu(1, "NVIDIA A100", "8.0", 81920, 80000)]
    monkeypatch.setattr(env, "gpus", lambda: env.Probe(gpus))
    monkeypatch.setattr(env, "tensorrt_llm_version", lambda: env.Probe("1.2.0"))
    report = collect_report()
    trtllm = report["backends"]["trtllm"]
    assert trtllm["available"] is True
    assert "fp8" not in trtllm["quant_modes"] and "int4_awq" in trtllm["quant_modes"]
    assert trtllm["kv_cache_dtypes"] == ["auto", "int8"]
    assert "1: NVIDIA A100 (compute 8.0" in format_table(report)


def _tiny_onnx(path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    onnx.save(
        helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])),
        str(path),
    )


def test_onnx_checker_and_the_network_folder_listing(tmp_path: Path) -> None:
    assert network_files(tmp_path / "absent") == []
    _tiny_onnx(tmp_path / "rank0.onnx")
    assert network_files(tmp_path) == [
        {"file": "rank0.onnx", "bytes": (tmp_path / "rank0.onnx").stat().st_size}
    ]
    summary = check_onnx_file(tmp_path / "rank0.onnx")
    assert (summary["file"], summary["nodes"], summary["inputs"], summary["outputs"]) == (
        "rank0.onnx",
        1,
        ["x"],
        ["y"],
    )
    broken = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [], []))
    broken.ir_version = 0
    onnx.save(broken, str(tmp_path / "rank1.onnx"))
    with pytest.raises(IntegrityError, match="rank1.onnx fails onnx.checker"):
        check_onnx_file(tmp_path / "rank1.onnx")
