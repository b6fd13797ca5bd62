"""The runtime checkpoint's linear layers, which quantization walks (where each comes from in a Hugging Face
checkpoint: pipeline.architectures.weight_map)."""

from __future__ import annotations

# The linear layers of each dense transformer block (runtime names without ".weight").
LAYER_LINEARS: tuple[str, ...] = ("attention.qkv", "attention.dense", "mlp.gate_up", "mlp.proj")
