"""convert / quantize / build of the trtllm backend.

convert and quantize run against tests/stand_in_tensorrt_llm, a package with TensorRT-LLM 1.2's signatures
that records calls (the real one cannot be installed here): the tests assert the exact calls. build runs a
fake `trtllm-build` on PATH that writes what the real one writes, to check the orchestration around it: the
guards, the streamed and kept log, the ONNX check, the manifest facts. Without TensorRT-LLM every step
stops at once with what to install, while the plan still prints.
"""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.backends.trtllm import build as build_step
from pipeline.backends.trtllm import env
from pipeline.backends.trtllm.convert import convert
from pipeline.backends.trtllm.plan import plan
from pipeline.backends.trtllm.quantize import quantize
from pipeline.config.build_config import BuildConfig
from pipeline.errors import BackendUnavailableError, ConfigError
from pipeline.quantize.calibration import load_records

STAND_IN = Path(__file__).resolve().parents[1] / "stand_in_tensorrt_llm"


def make_cfg(**sections: Any) -> BuildConfig:
    data = {"name": "s", "backend": "trtllm", "source": {"kind": "local", "path": "m"}, **sections}
    return BuildConfig.model_validate(data)


def _drop_trtllm_modules() -> None:
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture
def trtllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The stand-in `tensorrt_llm` on sys.path; yields its module (CALLS holds the recorded calls)."""
    _drop_trtllm_modules()
    monkeypatch.syspath_prepend(str(STAND_IN))
    importlib.invalidate_caches()
    module = importlib.import_module("tensorrt_llm")
    module.CALLS.clear()
    yield module
    _drop_trtllm_modules()


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def calls(module: Any, name: str) -> list[dict[str, Any]]:
    return [args for called, args in module.CALLS if called == name]


# ---- without TensorRT-LLM -------------------------------------------------------------------------------
def test_steps_stop_at_once_with_what_to_install(tmp_path: Path, hf_dir: Path) -> None:
    _drop_trtllm_modules()
    cfg = make_cfg()
    for step in (lambda: convert(cfg, hf_dir, tmp_path), lambda: quantize(cfg, tmp_path, tmp_path, hf_dir=hf_dir),
                 lambda: build_step.build(cfg, tmp_path, tmp_path)):  # fmt: skip
        with pytest.raises(BackendUnavailableError) as info:
            step()
        message = str(info.value)
        assert "\n" not in message
        assert "pip install llmpipe[trtllm]" in message and "tritonserver:25.12-trtllm-python-py3" in message


def test_plan_works_without_tensorrt_llm(tmp_path: Path) -> None:
    lines = plan(
        make_cfg(quantization={"mode": "int4_awq"}, parallel={"tp_size": 2}), tmp_path / "build" / "s"
    )
    text = "\n".join(lines)
    assert "from_hugging_face" in text and "LLaMAForCausalLM.quantize" in text
    assert "trtllm-build \\" in text and "--workers 2" in text
    assert "rank0.engine, rank1.engine" in text
    assert "gpt_model_type=inflight_fused_batching" in text
    assert "cannot run it: TensorRT-LLM is not installed" in text


# ---- convert ------------------------------------------------------------------------------------------------
def test_convert_tp2_calls_from_hugging_face_per_rank(trtllm: Any, hf_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    facts = convert(make_cfg(dtype="float16", parallel={"tp_size": 2}), hf_dir, out)
    loads = calls(trtllm, "LLaMAForCausalLM.from_hugging_face")
    assert [(c["mapping"].rank, c["mapping"].world_size, c["mapping"].tp_size, c["mapping"].pp_size) for c in loads] == [
        (0, 2, 2, 1), (1, 2, 2, 1)]  # fmt: skip
    for call in loads:
        assert call["hf_model_or_dir"] == str(hf_dir)
        assert call["dtype"] == "float16"
        assert call["quant_config"].quant_algo is None and call["quant_config"].kv_cache_quant_algo is None
        assert call["kwargs"] == {"load_model_on_cpu": True}
    saves = calls(trtllm, "LLaMAForCausalLM.save_checkpoint")
    assert [(s["output_dir"], s["save_config"]) for s in saves] == [(str(out), True), (str(out), False)]
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "rank0.safetensors", "rank1.safetensors", "tokenizer"]  # fmt: skip
    # trtllm-build writes none: the tokenizer travels from here to the engine folder, which `package` reads
    assert facts["tokenizer_files"] == ["tokenizer.json"] and (out / "tokenizer" / "tokenizer.json").is_file()
    assert facts["trtllm_model_class"] == "LLaMAForCausalLM" and facts["tensorrt_llm_version"] == "1.2.0"


def test_convert_applies_weight_only_itself(trtllm: Any, hf_dir: Path, tmp_path: Path) -> None:
    convert(make_cfg(quantization={"mode": "int4_wo"}), hf_dir, tmp_path)
    (call,) = calls(trtllm, "LLaMAForCausalLM.from_hugging_face")
    assert call["quant_config"].quant_algo == trtllm.quantization.QuantAlgo.W4A16


def test_convert_leaves_calibrated_modes_to_quantize(trtllm: Any, hf_dir: Path, tmp_path: Path) -> None:
    convert(make_cfg(quantization={"mode": "int8_wo", "kv_cache_dtype": "int8"}), hf_dir, tmp_path)
    (call,) = calls(trtllm, "LLaMAForCausalLM.from_hugging_face")
    assert call["quant_config"].quant_algo is None


def test_convert_maps_qwen2_to_its_class(trtllm: Any, hf_dir: Path, tmp_path: Path) -> None:
    (hf_dir / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    convert(make_cfg(), hf_dir, tmp_path)
    assert calls(trtllm, "QWenForCausalLM.from_hugging_face")


# ---- quantize -----------------------------------------------------------------------------------------------
def test_quantize_int4_awq_tp2_through_modelopt(trtllm: Any, hf_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(dtype="float16", parallel={"tp_size": 2},
                   quantization={"mode": "int4_awq", "group_size": 64,
                                 "calibration": {"num_samples": 256, "max_seq_length": 1024}})  # fmt: skip
    out = tmp_path / "q"
    out.mkdir()
    facts = quantize(cfg, tmp_path / "ckpt", out, hf_dir=hf_dir)
    (call,) = calls(trtllm, "LLaMAForCausalLM.quantize")
    assert (call["hf_model_dir"], call["output_dir"], call["dtype"]) == (str(hf_dir), str(out), "float16")
    assert (call["mapping"].world_size, call["mapping"].tp_size, call["mapping"].pp_size) == (2, 2, 1)
    qc = call["quant_config"]
    assert (qc.quant_algo, qc.kv_cache_quant_algo, qc.group_size) == (
        trtllm.quantization.QuantAlgo.W4A16_AWQ,
        None,
        64,
    )
    # builtin is the shipped calibration set, handed to ModelOpt as a local folder: nothing from a hub
    shipped = load_records("builtin")
    texts = [json.loads(r)["text"] for r in call["calib_records"]]
    assert len(texts) == len(shipped) and texts[0] == shipped[0]
    assert not Path(call["calib_dataset"]).exists()
    assert (call["calib_batches"], call["calib_batch_size"], call["calib_max_seq_length"]) == (256, 1, 1024)
    assert call["tokenizer_max_seq_length"] == 2048
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "rank0.safetensors", "rank1.safetensors"]
    assert facts["quant_algo"] == "W4A16_AWQ" and facts["calib_samples"] == 256


def test_quantize_fp8_with_fp8_kv_cache(trtllm: Any, hf_dir: Path, tmp_path: Path) -> None:
    quantize(
        make_cfg(quantization={"mode": "fp8", "kv_cache_dtype": "fp8"}),
        tmp_path,
        tmp_path / "q",
        hf_dir=hf_dir,
    )
    (call,) = calls(trtllm, "LLaMAForCausalLM.quantize")
    algo = trtllm.quantization.QuantAlgo
    assert (call["quant_config"].quant_algo, call["quant_config"].kv_cache_quant_algo) == (algo.FP8, algo.FP8)


def test_int8_kv_cache_calibrates_on_the_users_samples(trtllm: Any, hf_dir: Path, tmp_path: Path) -> None:
    samples = tmp_path / "calib.jsonl"
    samples.write_text(
        '{"text": "first sample"}\n{"messages": [{"role": "user", "content": "second sample"}]}\n'
    )
    cfg = make_cfg(quantization={"kv_cache_dtype": "int8", "calibration": {"dataset": str(samples)}})
    quantize(cfg, tmp_path, tmp_path / "q", hf_dir=hf_dir)
    (call,) = calls(trtllm, "LLaMAForCausalLM.quantize")
    assert call["quant_config"].quant_algo is None
    assert call["quant_config"].kv_cache_quant_algo == trtllm.quantization.QuantAlgo.INT8
    assert [json.loads(r)["text"] for r in call["calib_records"]] == ["first sample", "second sample"]
    assert not Path(call["calib_dataset"]).exists()  # the scratch folder is removed afterwards


def test_weight_only_passes_the_converted_checkpoint_through(trtllm: Any, tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "q"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "rank0.safetensors").write_bytes(b"x")
    facts = quantize(make_cfg(quantization={"mode": "int8_wo"}), ckpt, out)
    assert facts["pass_through"] and not trtllm.CALLS
    assert (out / "rank0.safetensors").read_bytes() == b"x"


def test_quantize_lm_head_is_refused_on_this_path(trtllm: Any, hf_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(quantization={"mode": "fp8", "quantize_lm_head": True})
    with pytest.raises(ConfigError, match="quantize_lm_head"):
        quantize(cfg, tmp_path, tmp_path / "q", hf_dir=hf_dir)


# ---- build --------------------------------------------------------------------------------------------------
FAKE_TRTLLM_BUILD = textwrap.dedent('''\
    #!{python}
    """Writes what trtllm-build writes: config.json, rank engines, and with --visualize_network one
    network.onnx (builder.py's Network.to_onnx) into a folder that must already exist."""
    import json, sys
    from pathlib import Path
    import onnx
    from onnx import TensorProto, helper
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    Path("{argv_file}").write_text(json.dumps(sys.argv[1:]))
    if args.get("--max_batch_size") == "13":
        print("[TRT-LLM] [E] out of memory"); sys.exit(3)
    out = Path(args["--output_dir"])
    print("[TRT-LLM] [I] Build phase started")
    ckpt = json.loads((Path(args["--checkpoint_dir"]) / "config.json").read_text())
    world = ckpt["mapping"]["world_size"]
    (out / "config.json").write_text(json.dumps({{"version": "1.2.0", "pretrained_config": ckpt,
        "build_config": {{"max_batch_size": int(args["--max_batch_size"])}}}}))
    for rank in range(world):
        (out / f"rank{{rank}}.engine").write_bytes(b"plan")
    if "--visualize_network" in args:
        # one file for every rank, into a folder it does not create, with TensorRT layer types
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
        graph = helper.make_graph([helper.make_node("PLUGIN_V2", ["x"], ["y"])], "network", [x], [y])
        onnx.save(helper.make_model(graph), str(Path(args["--visualize_network"]) / "network.onnx"))
    print("[TRT-LLM] [I] Engine serialized")
''')


@pytest.fixture
def gpu_host(trtllm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake GPU host: two H100s, TensorRT 10.14, and a `trtllm-build` on PATH. Returns the argv record file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    argv_file = tmp_path / "argv.json"
    script = bin_dir / "trtllm-build"
    script.write_text(FAKE_TRTLLM_BUILD.format(python=sys.executable, argv_file=argv_file))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    h100 = [env.Gpu(i, "NVIDIA H100 80GB HBM3", "9.0", 81559, 80000) for i in range(2)]
    monkeypatch.setattr(env, "gpus", lambda: env.Probe(h100))
    monkeypatch.setattr(env, "tensorrt_version", lambda: env.Probe("10.14.1.48"))
    return argv_file


def _checkpoint(folder: Path, world: int, max_positions: int = 8192) -> Path:
    folder.mkdir()
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
              "dtype": "float16", "max_position_embeddings": max_positions,
              "mapping": {"world_size": world, "tp_size": world, "pp_size": 1}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    for rank in range(world):
        (folder / f"rank{rank}.safetensors").write_bytes(b"w" * 1024)
    return folder


def test_build_runs_trtllm_build_and_records_the_facts_p1_needs(gpu_host: Path, tmp_path: Path) -> None:
    cfg = make_cfg(parallel={"tp_size": 2}, kv_cache={"free_memory_fraction": 0.5})
    ckpt, out = _checkpoint(tmp_path / "ckpt", 2), tmp_path / "engine.tmp"
    out.mkdir()
    facts = build_step.build(cfg, ckpt, out)
    argv = json.loads(gpu_host.read_text())
    assert argv[:4] == ["--checkpoint_dir", str(ckpt), "--output_dir", str(out)]
    assert facts["argv"][1:] == argv
    log = (out / "trtllm-build.log").read_text()
    assert log.startswith("$ trtllm-build") and "Engine serialized" in log
    assert (facts["tensorrt_llm_version"], facts["tensorrt_version"]) == ("1.2.0", "10.14.1.48")
    assert (facts["gpu_compute_capability"], facts["release"], facts["engine_version"]) == (
        "9.0",
        "1.2.0",
        "1.2.0",
    )
    assert "--visualize_network" not in argv and facts["network_onnx"] == []  # off by default
    assert facts["kv_tokens_per_sequence"] == 2048 and facts["kv_full_sequences"] > 100


def test_the_engine_folder_carries_the_checkpoints_tokenizer(gpu_host: Path, tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path / "ckpt", 1), tmp_path / "engine.tmp"
    (ckpt / "tokenizer").mkdir()
    (ckpt / "tokenizer" / "tokenizer.json").write_text("{}")
    out.mkdir()
    build_step.build(make_cfg(), ckpt, out)
    assert (out / "tokenizer" / "tokenizer.json").read_text() == "{}"


def test_visualize_network_gets_its_folder_and_the_network_is_recorded(
    gpu_host: Path, tmp_path: Path
) -> None:
    cfg = make_cfg(parallel={"tp_size": 2}, engine={"visualize_network": True})
    ckpt, out = _checkpoint(tmp_path / "ckpt", 2), tmp_path / "engine.tmp"
    out.mkdir()
    facts = build_step.build(cfg, ckpt, out)
    (network,) = facts["network_onnx"]
    assert network["file"] == "network.onnx" and network["bytes"] > 0


def test_failed_build_keeps_its_log_beside_the_work_dir(gpu_host: Path, tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path / "ckpt", 1), tmp_path / "engine.tmp"
    out.mkdir()
    with pytest.raises(build_step.EngineBuildError, match="exited with 3"):
        build_step.build(make_cfg(engine={"max_batch_size": 13}), ckpt, out)
    assert "out of memory" in (tmp_path / build_step.FAILED_LOG_NAME).read_text()


def test_guards_run_before_trtllm_build(gpu_host: Path, tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path / "ckpt", 1, max_positions=1024), tmp_path / "engine.tmp"
    out.mkdir()
    with pytest.raises(ConfigError, match="max_position_embeddings=1024"):
        build_step.build(make_cfg(), ckpt, out)
    assert not gpu_host.exists()  # trtllm-build never ran
