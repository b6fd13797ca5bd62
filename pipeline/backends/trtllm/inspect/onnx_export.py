"""One decoder step of a torch-backend engine as ONNX (for Netron, and for diffing graphs between builds).

The runtime's forward reads a paged cache through custom kernels, which ONNX cannot express. The step
exported here computes the same function with a contiguous cache: the engine's own weights (loaded by the
runtime's loader) and RoPE tables (the runtime's rotary_cos_sin / apply_rope), one new token per sequence,
attention over past + current keys. Inputs and outputs:

  input_ids [B] int64, positions [B] int64 (= tokens already cached),
  past_keys / past_values [L, B, KV, P, D]  ->  logits [B, vocab], present_keys / present_values [L, B, KV, P+1, D]

All sequences of a batch share P (the cache length); a single sequence is B = 1.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.backends.trtllm.inspect.onnx_check import check_onnx_file
from pipeline.errors import UnsupportedModelError
from pipeline.runtime.engine_config import load_engine_config
from pipeline.runtime.model.attention import apply_rope
from pipeline.runtime.model.layers import DenseLinear, Linear
from pipeline.runtime.model.loader import load_model_weights
from pipeline.runtime.model.rope import rotary_cos_sin
from pipeline.runtime.model.weights import ModelWeights
from pipeline.runtime.model_config import ModelConfig

OPSET = 17
INPUT_NAMES = ["input_ids", "positions", "past_keys", "past_values"]
OUTPUT_NAMES = ["logits", "present_keys", "present_values"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Spelled out: the TorchScript exporter has no symbolic for aten::rms_norm at opset 17.
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _linear(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    # The runtime's DenseLinear may call a hand-written C GEMV the tracer cannot see into (it would export
    # as a constant); export the plain matmul with the same weights instead.
    assert isinstance(layer, DenseLinear), "quantized engines are refused in load_decoder_step"
    return F.linear(x, layer.weight, layer.bias)


# Architectures whose engines are plain pre-norm SwiGLU decoders, which the exported step spells out.
LLAMA_LAYOUT = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class DecoderStep(torch.nn.Module):
    def __init__(self, config: ModelConfig, weights: ModelWeights) -> None:
        super().__init__()
        self.config, self.weights = config, weights
        # A plain attribute, not a buffer: the tracer folds it into the graph as a constant.
        self.cos_sin = rotary_cos_sin(config, config.max_position_embeddings)  # [positions, D]

    def _attention(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        batch = qkv.shape[0]
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q = apply_rope(q.view(batch, heads, d), cos, sin)  # [B, H, D]
        k = apply_rope(k.view(batch, kv_heads, d), cos, sin)  # [B, KV, D]
        keys = torch.cat([past_k, k.unsqueeze(2)], dim=2)  # [B, KV, P+1, D]
        values = torch.cat([past_v, v.view(batch, kv_heads, 1, d)], dim=2)
        group = heads // kv_heads
        q = q.view(batch, kv_heads, group, d)  # query heads grouped by the KV head they read
        scores = torch.matmul(q, keys.transpose(-1, -2)) * (d**-0.5)  # [B, KV, G, P+1]
        out = torch.matmul(scores.softmax(dim=-1), values)  # [B, KV, G, D]
        return out.reshape(batch, heads * d), keys, values

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        past_keys: torch.Tensor,
        past_values: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c, w = self.config, self.weights
        half = c.head_dim // 2
        table = self.cos_sin[positions]  # [B, D]
        cos, sin = table[:, None, :half], table[:, None, half:]  # [B, 1, D/2]
        hidden = F.embedding(input_ids, w.embedding)  # [B, hidden]
        presents_k, presents_v = [], []
        for i, layer in enumerate(w.layers):
            assert layer.input_norm is not None and layer.post_norm is not None  # the Llama layout
            assert layer.gate_up is not None and layer.proj is not None
            x = _rms_norm(hidden, layer.input_norm, c.norm_epsilon)
            attn, keys, values = self._attention(
                _linear(layer.qkv, x), cos, sin, past_keys[i], past_values[i]
            )
            hidden = hidden + _linear(layer.dense, attn)
            x = _rms_norm(hidden, layer.post_norm, c.norm_epsilon)
            gate, up = _linear(layer.gate_up, x).split(c.intermediate_size, dim=-1)
            hidden = hidden + _linear(layer.proj, F.silu(gate) * up)
            presents_k.append(keys)
            presents_v.append(values)
        logits = _linear(w.lm_head, _rms_norm(hidden, w.final_norm, c.norm_epsilon)).float()
        return logits, torch.stack(presents_k), torch.stack(presents_v)


def load_decoder_step(engine_dir: Path) -> DecoderStep:
    engine = load_engine_config(engine_dir)
    model = engine.model
    if model.quantization.quant_algo is not None:
        raise UnsupportedModelError(
            f"{engine_dir}: ONNX export covers dense engines; this one is {model.quantization.quant_algo}",
            hint="Export the unquantized build of the same model (quantization.mode: none).",
        )
    if model.sliding_window is not None:
        raise UnsupportedModelError(
            f"{engine_dir}: sliding-window attention is not part of the exported step"
        )
    if model.architecture not in LLAMA_LAYOUT:
        raise UnsupportedModelError(
            f"{engine_dir}: the exported step is the Llama layout ({', '.join(LLAMA_LAYOUT)}); "
            f"this engine is {model.architecture}"
        )
    weights = load_model_weights(engine, torch.device("cpu"), torch.float32)
    return DecoderStep(model, weights).eval()


def example_inputs(config: ModelConfig, batch: int = 1, past: int = 3) -> tuple[torch.Tensor, ...]:
    shape = (config.num_hidden_layers, batch, config.num_key_value_heads, past, config.head_dim)
    return (
        torch.zeros(batch, dtype=torch.int64),
        torch.full((batch,), past, dtype=torch.int64),
        torch.zeros(shape),
        torch.zeros(shape),
    )


def export_decoder_step(engine_dir: Path, onnx_file: Path) -> dict[str, Any]:
    """Write one decoder step of the torch engine in `engine_dir` to `onnx_file`; check it with onnx.checker."""
    step = load_decoder_step(engine_dir)
    onnx_file.parent.mkdir(parents=True, exist_ok=True)
    dynamic = {"input_ids": {0: "batch"}, "positions": {0: "batch"},
               "past_keys": {1: "batch", 3: "past"}, "past_values": {1: "batch", 3: "past"},
               "logits": {0: "batch"}, "present_keys": {1: "batch", 3: "past_plus_one"},
               "present_values": {1: "batch", 3: "past_plus_one"}}  # fmt: skip
    with torch.no_grad(), warnings.catch_warnings():
        # NOTE: the TorchScript exporter is deprecated in favour of torch.export, which needs onnxscript
        # (not a dependency of llmpipe); it still exports this plain graph faithfully.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            step, example_inputs(step.config), str(onnx_file), dynamo=False, opset_version=OPSET,
            input_names=INPUT_NAMES, output_names=OUTPUT_NAMES, dynamic_axes=dynamic,
        )  # fmt: skip
    return check_onnx_file(onnx_file)
