"""`llmpipe inspect ENGINE --onnx FILE` on a torch engine: the exported decoder step passes onnx.checker and,
run step by step in ONNX Runtime, reproduces Hugging Face's logits and greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from pipeline.backends.trtllm.inspect.onnx_export import INPUT_NAMES, OUTPUT_NAMES
from pipeline.cli.inspect import inspect
from pipeline.runtime.engine_config import load_engine_config
from tests.serving_helpers import build_tiny_engine


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_engine(
        tiny_llama_dir, tmp_path_factory.mktemp("onnx"), engine={"max_seq_len": 64, "max_input_len": 32}
    )


def test_exported_step_matches_hf_token_for_token(
    tiny_engine: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    onnx_file = tmp_path / "step.onnx"
    result = CliRunner().invoke(inspect, [str(tiny_engine), "--onnx", str(onnx_file)])
    assert result.exit_code == 0, result.output
    assert "onnx.checker: ok" in result.output
    model = load_engine_config(tiny_engine).model
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == INPUT_NAMES
    assert [o.name for o in session.get_outputs()] == OUTPUT_NAMES

    prompt = [1, 57, 300, 12, 999]
    shape = (model.num_hidden_layers, 1, model.num_key_value_heads, 0, model.head_dim)
    keys, values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    tokens, step_logits = list(prompt), []
    for position in range(len(prompt) + 6):
        logits, keys, values = session.run(None, {
            "input_ids": np.array([tokens[position]], np.int64), "positions": np.array([position], np.int64),
            "past_keys": keys, "past_values": values})  # fmt: skip
        step_logits.append(logits[0])
        if position >= len(prompt) - 1:
            tokens.append(int(logits[0].argmax()))

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(torch.tensor([tokens[:-1]])).logits[0].numpy()
        greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=7, do_sample=False)[0].tolist()
    np.testing.assert_allclose(np.stack(step_logits), reference[: len(step_logits)], rtol=1e-4, atol=1e-4)
    assert tokens == greedy


def test_inspect_a_trtllm_engine_copies_its_network(tmp_path: Path) -> None:
    import json

    import onnx
    from onnx import TensorProto, helper

    engine = tmp_path / "engine"
    (engine / "network_onnx").mkdir(parents=True)
    (engine / "rank0.engine").write_bytes(b"plan")
    (engine / "config.json").write_text(
        json.dumps(
            {
                "version": "1.2.0",
                "pretrained_config": {"architecture": "LlamaForCausalLM", "mapping": {"world_size": 1}},
                "build_config": {"max_seq_len": 4096},
            }
        )
    )
    x = helper.make_tensor_value_info("input_ids", TensorProto.INT32, [-1])
    y = helper.make_tensor_value_info("logits", TensorProto.INT32, [-1])
    # TensorRT layer types, as trtllm-build writes them: no ONNX model onnx.checker accepts
    graph = helper.make_graph([helper.make_node("PLUGIN_V2", ["input_ids"], ["logits"])], "net", [x], [y])
    onnx.save(helper.make_model(graph), str(engine / "network_onnx" / "network.onnx"))
    result = CliRunner().invoke(inspect, [str(engine), "--onnx", str(tmp_path / "net.onnx"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["backend"] == "trtllm" and report["limits"]["max_seq_len"] == 4096
    assert report["onnx"]["files"][0]["file"] == "network.onnx"
    assert (tmp_path / "net.onnx").read_bytes() == (engine / "network_onnx" / "network.onnx").read_bytes()
