"""A stand-in for TensorRT-LLM 1.1.0's `trtllm-build` (which needs a GPU), built from the recorded facts in
upstream/: its argv is parsed by argparse from trtllm_build_flags.tsv, so an unknown flag or a value outside
a closed choice set exits 2 with argparse's usage and error on stderr, as the real command does. It writes
only what trtllm_build_outputs.tsv says the real one writes: config.json in the layout of
engine_config_layout.tsv (build_config from the flags and upstream's defaults, with the adjustments of
engine_config_adjustments.tsv; pretrained_config from the checkpoint's config.json), rank{r}.engine per
checkpoint rank, <visualize_network>/network.onnx into a folder it does not create, and the timing cache.

Two hooks for the orchestration tests, read from the environment: FAKE_TRTLLM_BUILD_ARGV (a file the argv is
recorded to, as JSON) and FAKE_TRTLLM_BUILD_FAIL (a message: print it and fail like a crashed build).

Run it as a program: `write_launcher` puts a `trtllm-build` that runs `main` into a bin folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.contract.upstream_facts import (
    RELEASE,
    Flag,
    all_trtllm_build_flags,
    engine_config_layout,
    layout_children,
)

ARGV_ENV = "FAKE_TRTLLM_BUILD_ARGV"
FAIL_ENV = "FAKE_TRTLLM_BUILD_FAIL"

# Upstream's defaults for what no flag sets (BuildConfig and PluginConfig field defaults in
# gh-pages:1.1.0/_modules/tensorrt_llm/builder.html and plugin/plugin.html@8660c11).
BUILD_DEFAULTS: dict[str, Any] = {
    "max_input_len": 1024, "max_seq_len": None, "opt_batch_size": 8, "max_batch_size": 2048,
    "max_beam_width": 1, "max_num_tokens": 8192, "opt_num_tokens": None, "max_prompt_embedding_table_size": 0,
    "kv_cache_type": None, "gather_context_logits": False, "gather_generation_logits": False,
    "strongly_typed": True, "force_num_profiles": None, "profiling_verbosity": "layer_names_only",
    "enable_debug_output": False, "max_draft_len": 0, "speculative_decoding_mode": None, "use_refit": False,
    "input_timing_cache": None, "output_timing_cache": "model.cache", "lora_config": {},
    "auto_parallel_config": {}, "weight_sparsity": False, "weight_streaming": False, "use_strip_plan": False,
    "max_encoder_input_len": 1024, "monitor_memory": False, "use_mrope": False,
}  # fmt: skip
PLUGIN_DEFAULTS: dict[str, Any] = {
    "dtype": "float16", "bert_attention_plugin": "auto", "gpt_attention_plugin": "auto", "nccl_plugin": "auto",
    "moe_plugin": "auto", "mamba_conv1d_plugin": "auto", "smooth_quant_plugins": True, "context_fmha": True,
    "remove_input_padding": True, "tokens_per_block": 32, "use_paged_context_fmha": True,
    "use_fp8_context_fmha": True, "paged_state": True, "use_fused_mlp": True, "paged_kv_cache": None,
}  # fmt: skip
# SpeculativeDecodingMode (an IntFlag, written as its number): --speculative_decoding_mode value -> number.
SPECULATIVE_MODES = {
    None: 1, "draft_tokens_external": 2, "medusa": 4, "lookahead_decoding": 8, "explicit_draft_tokens": 16,
    "eagle": 32,
}  # fmt: skip
# build_config key -> the trtllm-build flag that sets it, where the names differ.
KEY_FLAGS = {"use_strip_plan": "strip_plan"}


def parser() -> argparse.ArgumentParser:
    """trtllm-build's command line for the recorded release, every default None (upstream's apply later)."""
    cli = argparse.ArgumentParser(prog="trtllm-build")
    for flag in all_trtllm_build_flags():
        if flag.releases is None or RELEASE in flag.releases:
            cli.add_argument(flag.name, *flag.aliases, **_argument(flag))
    return cli


def _argument(flag: Flag) -> dict[str, Any]:
    if flag.kind == "switch":
        return {"action": "store_true", "default": None}
    spec: dict[str, Any] = {"default": None, "type": int if flag.kind == "int" else str}
    if flag.choices:
        spec["choices"] = flag.choices
    if flag.many:
        spec["nargs"] = "+"
    return spec


def _plugin_config(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """PluginConfig.to_dict: a plugin flag takes a dtype or "disable" (None), a feature flag enable/disable."""
    layout = engine_config_layout()
    config: dict[str, Any] = {}
    for key in sorted(layout_children("build_config.plugin_config")):
        feature = layout[f"build_config.plugin_config.{key}"].startswith("bool")
        value = getattr(args, key, None)
        if value is None:
            config[key] = PLUGIN_DEFAULTS.get(key, False if feature else None)
        elif feature:
            config[key] = value == "enable"
        else:
            config[key] = None if value == "disable" else value
    config["dtype"] = dtype
    return config


def build_config(args: argparse.Namespace, pretrained: dict[str, Any]) -> dict[str, Any]:
    """BuildConfig.to_dict of this run, with build()'s adjustments."""
    config: dict[str, Any] = {}
    for key in layout_children("build_config"):
        value = getattr(args, KEY_FLAGS.get(key, key), None)
        config[key] = BUILD_DEFAULTS.get(key) if value is None else value
    world_size = int(pretrained.get("mapping", {}).get("world_size", 1))
    plugin = _plugin_config(args, str(pretrained.get("dtype", "float16")))
    plugin["nccl_plugin"] = plugin["dtype"] if world_size > 1 else None
    config["kv_cache_type"] = (args.kv_cache_type or "paged").upper()
    plugin["paged_kv_cache"] = config["kv_cache_type"] == "PAGED"
    kv_algo = (pretrained.get("quantization") or {}).get("kv_cache_quant_algo")
    if not plugin["context_fmha"]:
        plugin["use_paged_context_fmha"] = plugin["use_fp8_context_fmha"] = False
    if kv_algo == "INT8":
        plugin["use_paged_context_fmha"] = False
    config["plugin_config"] = plugin
    if config["max_seq_len"] is None:
        config["max_seq_len"] = int(pretrained["max_position_embeddings"])
    config["speculative_decoding_mode"] = SPECULATIVE_MODES[args.speculative_decoding_mode]
    if args.speculative_decoding_mode is not None:
        config["max_seq_len"] += config["max_draft_len"]
        needed = config["max_batch_size"] * (config["max_draft_len"] + 1)
        config["max_num_tokens"] = max(config["max_num_tokens"], needed)
    return config


def _write_network(folder: str) -> None:
    """Network.to_onnx: one file, TensorRT layer types as node types, saved into a folder it never creates."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("input_ids", TensorProto.INT32, [-1])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [-1, -1])
    graph = helper.make_graph([helper.make_node("PLUGIN_V2", ["input_ids"], ["logits"])], "network", [x], [y])
    onnx.save(helper.make_model(graph), folder + "/network.onnx")


def run(args: argparse.Namespace) -> None:
    if args.lora_dir or args.model_cls_file or args.build_config or args.auto_parallel:
        raise SystemExit(
            "fake trtllm-build: LoRA, model classes, build config files, auto parallel: not modelled"
        )
    source = args.checkpoint_dir or args.model_config
    config_path = Path(source) if source.endswith(".json") else Path(source) / "config.json"
    pretrained = json.loads(config_path.read_text())
    output_dir = Path(args.output_dir or "engine_outputs")
    output_dir.mkdir(parents=True, exist_ok=True)
    print("[TRT-LLM] [I] Set dtype to", pretrained.get("dtype"))
    config = build_config(args, pretrained)
    world_size = int(pretrained.get("mapping", {}).get("world_size", 1))
    for rank in range(world_size):
        print(f"[TRT-LLM] [I] Build phase started for rank {rank}")
        if args.visualize_network is not None:
            _write_network(args.visualize_network)
        if not args.dry_run:
            (output_dir / f"rank{rank}.engine").write_bytes(b"fake TensorRT plan")
            print(f"[TRT-LLM] [I] Engine serialized for rank {rank}")
        if args.fast_build:
            (output_dir / f"rank{rank}_managed_weights.safetensors").write_bytes(b"{}")
        if rank == 0:
            engine_config = {"version": RELEASE, "pretrained_config": pretrained, "build_config": config}
            (output_dir / "config.json").write_text(json.dumps(engine_config, indent=4))
            if (pretrained.get("quantization") or {}).get("quant_algo") == "MIXED_PRECISION":
                (output_dir / "quant_cfg.json").write_text(json.dumps({"version": RELEASE}))
            Path(config["output_timing_cache"]).write_bytes(b"fake timing cache")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get(ARGV_ENV):
        Path(os.environ[ARGV_ENV]).write_text(json.dumps(argv))
    args = parser().parse_args(argv)  # exits 2 on an unknown flag or an invalid choice
    if os.environ.get(FAIL_ENV):
        print(f"[TRT-LLM] [E] {os.environ[FAIL_ENV]}", flush=True)
        return 1
    run(args)
    return 0


def write_launcher(bin_dir: Path) -> Path:
    """A `trtllm-build` executable in `bin_dir` that runs this module with the current interpreter."""
    root = Path(__file__).resolve().parents[2]
    launcher = bin_dir / "trtllm-build"
    launcher.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(root)!r})\n"
        "from tests.contract.fake_trtllm_build import main\nsys.exit(main())\n"
    )
    launcher.chmod(0o755)
    return launcher
