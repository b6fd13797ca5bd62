"""The model architectures llmpipe builds: what each Hugging Face config means to the runtime
(`hf_config`), and where each of its tensors goes (`weight_map`)."""

from __future__ import annotations

# HF model classes (config.json `architectures[0]`) the torch runtime implements, in the README's order.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
    "SmolLM3ForCausalLM",
)
