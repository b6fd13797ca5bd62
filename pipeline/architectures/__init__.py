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

# Architectures whose HF decoder layer has Llama's modules and norm order, which the torch backend's
# calibrated quantizers (AWQ, GPTQ, grid tuning) run block by block.
CALIBRATED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def torch_quantization_problem(pretrained: dict[str, object], mode: str, calibrated: bool) -> str | None:
    """Why the torch backend cannot quantize this model (pretrained_config `pretrained`) with weight `mode`
    (`calibrated`: on calibration data); None when it can."""
    architecture = str(pretrained["architecture"])
    if mode == "none":
        return None
    if pretrained.get("num_experts"):
        return (
            f"quantization.mode={mode}: the torch backend keeps MoE experts dense ({architecture}); "
            "use mode none (kv_cache_dtype int8 still works)"
        )
    if calibrated and architecture not in CALIBRATED_ARCHITECTURES:
        return (
            f"quantization.mode={mode} with calibration runs on {', '.join(CALIBRATED_ARCHITECTURES)}; "
            f"{architecture} gets round-to-nearest int8_wo / int4_wo"
        )
    return None
