"""convert / build of the trtllm backend, and the quantize step's routing.

convert runs against tests/stand_in_tensorrt_llm, a package with TensorRT-LLM 1.x's signatures that records
calls (the real one cannot be installed here): the tests assert the exact calls for the modes TensorRT-LLM
applies itself; the calibrated formats go through the real ModelOpt (tests/integration/test_modelopt_quantize.py).
build runs tests/contract/fake_trtllm_build.py as `trtllm-build` on PATH: TensorRT-LLM 1.1.0's recorded command
line and outputs (tests/contract/upstream/), to check the orchestration around it: the guards, the streamed and
kept log, the ONNX check, the manifest facts, and that what llmpipe reads of config.json is upstream's layout.
Without TensorRT-LLM every step that needs it stops at once with what to install, while the plan still prints.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline.backends.trtllm import build as build_step
from pipeline.backends.trtllm import build_cmd, env, guards
from pipeline.backends.trtllm.api import stages_need_trtllm
from pipeline.backends.trtllm.build_cmd import NETWORK_DIRNAME
from pipeline.backends.trtllm.convert import convert
from pipeline.backends.trtllm.plan import plan
from pipeline.backends.trtllm.quantize import quantize
from pipeline.config.build_config import BuildConfig
from pipeline.errors import BackendUnavailableError, ConfigError, ServingError
from tests.contract import fake_trtllm_build, upstream_facts
from tests.contract.conftest import drop_trtllm_modules
from tests.contract.render import CONFIG_DIR, load
from tests.contract.upstream_facts import RELEASE, key_paths, layout_children


def make_cfg(**sections: Any) -> BuildConfig:
    data = {"name": "s", "backend": "trtllm", "source": {"kind": "local", "path": "m"}, **sections}
    return BuildConfig.model_validate(data)


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
    drop_trtllm_modules()
    for cfg, step in ((make_cfg(), convert), (make_cfg(quantization={"mode": "int8_wo"}), convert),
                      (make_cfg(), build_step.build)):  # fmt: skip
        with pytest.raises(BackendUnavailableError) as info:
            step(cfg, hf_dir, tmp_path)
        message = str(info.value)
        assert "\n" not in message
        assert "pip install llmpipe[trtllm]" in message and "tritonserver:25.12-trtllm-python-py3" in message


def test_convert_for_a_modelopt_format_needs_no_tensorrt_llm(tmp_path: Path, hf_dir: Path) -> None:
    drop_trtllm_modules()
    (hf_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128}))  # fmt: skip
    out = tmp_path / "ckpt"
    facts = convert(make_cfg(quantization={"mode": "fp8", "kv_cache_dtype": "fp8"}), hf_dir, out)
    assert "tensorrt_llm" not in sys.modules
    # no checkpoint: quantize exports it from the HF checkpoint; the tokenizer travels on from here
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "tokenizer",
        "tokenizer/tokenizer.json",
    ]
    assert facts["route"] == "modelopt" and facts["tokenizer_files"] == ["tokenizer.json"]
    assert not stages_need_trtllm(make_cfg(quantization={"mode": "nvfp4"}), ["fetch", "convert", "quantize"])
    assert stages_need_trtllm(make_cfg(quantization={"mode": "nvfp4"}), ["quantize", "engine"])
    assert stages_need_trtllm(make_cfg(quantization={"mode": "int8_wo"}), ["convert"])


def test_convert_checks_the_group_size_before_quantize_loads_anything(tmp_path: Path, hf_dir: Path) -> None:
    (hf_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_attention_heads": 9,
        "head_dim": 64, "intermediate_size": 1536}))  # fmt: skip
    cfg = make_cfg(quantization={"mode": "int4_awq", "group_size": 128})
    with pytest.raises(
        ConfigError, match=r"quantization.group_size=128 does not divide the model's hidden_size=576"
    ) as info:
        convert(cfg, hf_dir, tmp_path / "ckpt")
    assert info.value.hint == "group sizes that fit: 32, 64"


def test_plan_works_without_tensorrt_llm(tmp_path: Path) -> None:
    lines = plan(
        make_cfg(quantization={"mode": "int4_awq"}, parallel={"tp_size": 2}), tmp_path / "build" / "s"
    )
    text = "\n".join(lines)
    assert "no TensorRT-LLM conversion for mode=int4_awq" in text
    assert "mtq.quantize(model, INT4_AWQ_CFG, weight blocks of 128)" in text
    assert (
        "export_tensorrt_llm_checkpoint(model, 'llama', auto (float32 -> float16), inference_tensor_parallel=2"
        in text
    )
    assert "quant_algo W4A16_AWQ" in text and "modelopt_state.pth" in text
    assert "trtllm-build \\" in text and "--workers 2" in text
    assert "rank0.engine, rank1.engine" in text
    assert "gpt_model_type=inflight_fused_batching" in text
    assert "cannot run it: TensorRT-LLM is not installed" in text


def test_plan_of_the_quantize_step_checks_the_model_shapes(tmp_path: Path, hf_dir: Path) -> None:
    (hf_dir / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "dtype": "bfloat16"}))  # fmt: skip
    cfg = make_cfg(
        source={"kind": "local", "path": str(hf_dir)}, quantization={"mode": "w4a8_awq", "group_size": 64}
    )
    text = "\n".join(plan(cfg, tmp_path, "quantize"))
    assert "export_tensorrt_llm_checkpoint(model, 'qwen', bfloat16," in text
    assert "cannot run it" not in text  # quantize runs without TensorRT-LLM
    with pytest.raises(
        ConfigError, match="group_size=64 does not divide the model's hidden_size=64 / parallel.tp_size=2"
    ):
        plan(
            cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"tp_size": 2})}),
            tmp_path,
            "quantize",
        )


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


def test_convert_applies_fp8_rowwise_with_convert_checkpoints_clamp(
    trtllm: Any, hf_dir: Path, tmp_path: Path
) -> None:
    # convert_checkpoint.py --use_fp8_rowwise: from_hugging_face with FP8_PER_CHANNEL_PER_TOKEN, clamp +-1200
    convert(make_cfg(quantization={"mode": "fp8_pc_pt"}), hf_dir, tmp_path)
    (call,) = calls(trtllm, "LLaMAForCausalLM.from_hugging_face")
    qc = call["quant_config"]
    assert (qc.quant_algo, qc.kv_cache_quant_algo, qc.clamp_val) == (
        trtllm.quantization.QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN, None, [-1200.0, 1200.0])  # fmt: skip


def test_a_quantized_kv_cache_over_a_convert_mode_is_refused(
    trtllm: Any, hf_dir: Path, tmp_path: Path
) -> None:
    cfg = make_cfg(quantization={"mode": "int8_wo", "kv_cache_dtype": "int8"})
    for step in (lambda: convert(cfg, hf_dir, tmp_path), lambda: quantize(cfg, tmp_path, tmp_path, hf_dir=hf_dir),
                 lambda: plan(cfg, tmp_path)):  # fmt: skip
        with pytest.raises(ConfigError, match="mode=int8_wo with quantization.kv_cache_dtype=int8"):
            step()
    assert not trtllm.CALLS


def test_convert_maps_qwen2_to_its_class(trtllm: Any, hf_dir: Path, tmp_path: Path) -> None:
    (hf_dir / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    convert(make_cfg(), hf_dir, tmp_path)
    assert calls(trtllm, "QWenForCausalLM.from_hugging_face")


# ---- quantize -----------------------------------------------------------------------------------------------
def test_weight_only_passes_the_converted_checkpoint_through(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "q"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "rank0.safetensors").write_bytes(b"x")
    drop_trtllm_modules()
    facts = quantize(make_cfg(quantization={"mode": "int8_wo"}), ckpt, out)
    assert facts["pass_through"] and "tensorrt_llm" not in sys.modules
    assert (out / "rank0.safetensors").read_bytes() == b"x"


# ---- build ----------------------------------------------------------------------------------------------
@pytest.fixture
def gpu_host(trtllm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake GPU host: two H100s, TensorRT 10.14, the recorded TensorRT-LLM release with its `trtllm-build`
    on PATH (tests/contract/fake_trtllm_build.py), run from a scratch working directory. Returns the file
    the fake records its argv to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_trtllm_build.write_launcher(bin_dir)
    argv_file = tmp_path / "argv.json"
    monkeypatch.setenv(fake_trtllm_build.ARGV_ENV, str(argv_file))
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    monkeypatch.setattr(trtllm, "__version__", RELEASE)  # one release, as inside the serving image
    monkeypatch.chdir(tmp_path)
    h100 = [env.Gpu(i, "NVIDIA H100 80GB HBM3", "9.0", 81559, 80000) for i in range(2)]
    monkeypatch.setattr(env, "gpus", lambda: env.Probe(h100))
    monkeypatch.setattr(env, "tensorrt_version", lambda: env.Probe("10.14.1.48"))
    return argv_file


def _checkpoint(folder: Path, world: int, max_positions: int = 8192) -> Path:
    folder.mkdir()
    config = {"architecture": "LlamaForCausalLM", "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "hidden_size": 4096, "dtype": "float16",
              "max_position_embeddings": max_positions,
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
    assert log.startswith("$ trtllm-build") and "Engine serialized for rank 1" in log
    assert (facts["tensorrt_llm_version"], facts["tensorrt_version"]) == (RELEASE, "10.14.1.48")
    assert (facts["gpu_compute_capability"], facts["release"], facts["engine_version"]) == (
        "9.0",
        RELEASE,
        RELEASE,
    )
    assert "--visualize_network" not in argv and facts["network_onnx"] == []  # off by default
    assert facts["kv_tokens_per_sequence"] == 2048 and facts["kv_full_sequences"] > 100


def test_the_engine_folder_holds_what_trtllm_build_writes(gpu_host: Path, tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path / "ckpt", 2), tmp_path / "engine.tmp"
    out.mkdir()
    build_step.build(make_cfg(parallel={"tp_size": 2}), ckpt, out)
    # upstream's files, plus the log llmpipe keeps beside them
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "rank0.engine", "rank1.engine", build_step.BUILD_LOG_NAME]  # fmt: skip
    engine_config = json.loads((out / "config.json").read_text())
    layout = upstream_facts.engine_config_layout()
    # below the objects the layout lists no keys of (pretrained_config, lora_config, ...) is not its business
    written = {p for p in key_paths(engine_config) if "." not in p or layout_children(p.rsplit(".", 1)[0])}
    assert written == set(layout)
    assert engine_config["pretrained_config"] == json.loads((ckpt / "config.json").read_text())
    # the timing cache goes where --output_timing_cache says: the work dir, not the directory of the build
    assert (tmp_path / build_cmd.TIMING_CACHE_NAME).is_file() and not Path("model.cache").exists()


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
    (network,) = facts["network_onnx"]  # every rank writes the same file
    assert network["file"] == "network.onnx" and network["bytes"] > 0
    assert (out / NETWORK_DIRNAME / "network.onnx").is_file()


def test_trtllm_build_fails_when_the_network_folder_is_missing(gpu_host: Path, tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt", 1)
    argv = ["trtllm-build", "--checkpoint_dir", str(ckpt), "--output_dir", str(tmp_path / "e"),
            "--visualize_network", str(tmp_path / "absent")]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "FileNotFoundError" in done.stderr


def test_trtllm_build_refuses_a_flag_it_lacks_with_exit_2(gpu_host: Path, tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt", 1)
    done = subprocess.run(
        ["trtllm-build", "--checkpoint_dir", str(ckpt), "--paged_kv_cache_type", "paged"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("usage: trtllm-build") and "unrecognized arguments" in done.stderr


def test_failed_build_keeps_its_log_beside_the_work_dir(
    gpu_host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, out = _checkpoint(tmp_path / "ckpt", 1), tmp_path / "engine.tmp"
    out.mkdir()
    monkeypatch.setenv(fake_trtllm_build.FAIL_ENV, "out of memory")
    with pytest.raises(build_step.EngineBuildError, match="exited with 1"):
        build_step.build(make_cfg(), ckpt, out)
    assert "out of memory" in (tmp_path / build_step.FAILED_LOG_NAME).read_text()


def test_guards_run_before_trtllm_build(gpu_host: Path, tmp_path: Path) -> None:
    ckpt, out = _checkpoint(tmp_path / "ckpt", 1, max_positions=1024), tmp_path / "engine.tmp"
    out.mkdir()
    with pytest.raises(ConfigError, match="max_position_embeddings=1024"):
        build_step.build(make_cfg(), ckpt, out)
    assert not gpu_host.exists()  # trtllm-build never ran


class _Recorder(dict[str, Any]):
    """A dict that records every key read from it (nested dicts too), as dotted paths into `seen`."""

    def __init__(self, data: dict[str, Any], seen: set[str], prefix: str = "") -> None:
        super().__init__(data)
        self.seen, self.prefix = seen, prefix

    def _wrap(self, key: str, value: Any) -> Any:
        self.seen.add(self.prefix + key)
        return _Recorder(value, self.seen, f"{self.prefix}{key}.") if isinstance(value, dict) else value

    def __getitem__(self, key: str) -> Any:
        return self._wrap(key, super().__getitem__(key))

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(self.prefix + key)
        return self._wrap(key, super().__getitem__(key)) if key in self else default


def _built_engine(name: str, tmp_path: Path) -> tuple[BuildConfig, Path, Path]:
    cfg = load(CONFIG_DIR / f"{name}.yaml")
    ckpt, out = _checkpoint(tmp_path / "ckpt", cfg.parallel.world_size), tmp_path / "engine.tmp"
    out.mkdir()
    return cfg, ckpt, out


CONTRACT_CONFIGS = ["fp16-tp1", "int4-awq-tp2", "fp8-kv-reuse-chunked", "draft-target", "lookahead"]


@pytest.mark.parametrize("name", CONTRACT_CONFIGS)
def test_what_llmpipe_reads_of_the_engine_config_is_upstreams_layout(
    gpu_host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Every key build and the serve-time guards read from config.json is in the recorded layout (or, under
    pretrained_config, in the checkpoint's config.json that trtllm-build copies there)."""
    cfg, ckpt, out = _built_engine(name, tmp_path)
    seen: set[str] = set()
    loads = json.loads
    with monkeypatch.context() as patch:
        patch.setattr(build_step.json, "loads", lambda text: _recorded(loads(text), seen))
        build_step.build(cfg, ckpt, out)
    with contextlib.suppress(ServingError):  # a refusal only ends the reading early: see the next test
        guards.check_runtime_features(cfg, _Recorder(json.loads((out / "config.json").read_text()), seen))
    layout = upstream_facts.engine_config_layout()
    checkpoint_keys = key_paths(json.loads((ckpt / "config.json").read_text()), "pretrained_config.")
    assert {"version", "build_config.max_seq_len", "build_config.plugin_config.tokens_per_block"} <= seen
    assert seen <= set(layout) | checkpoint_keys, seen - set(layout) - checkpoint_keys


@pytest.mark.parametrize("name", CONTRACT_CONFIGS)
def test_an_engine_passes_the_runtime_checks_of_its_own_config(
    gpu_host: Path, tmp_path: Path, name: str
) -> None:
    cfg, ckpt, out = _built_engine(name, tmp_path)
    build_step.build(cfg, ckpt, out)
    guards.check_runtime_features(cfg, json.loads((out / "config.json").read_text()))


def _recorded(data: Any, seen: set[str]) -> Any:
    """Record reads only of engine configs (the build also parses the checkpoint's config.json)."""
    return _Recorder(data, seen) if isinstance(data, dict) and "build_config" in data else data
