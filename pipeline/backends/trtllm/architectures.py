"""Which TensorRT-LLM model class the engine route converts each HF architecture with, as data.

The table is the engine route's one home of this fact: the convert step and its `--dry-run` plan both read
it, and refuse an architecture it lacks before anything loads. Source: MODEL_MAP in
tensorrt_llm/models/__init__.py of TensorRT-LLM 1.1.0 (the pinned release, commit 48b7b5d), read in the
1.1.0rc6 merge of fork Ataraksia/TensorRT-LLM@a451bf93888ef588251268516ac6cd4be0a124c5 (upstream side);
the converters' model types: QWenConfig (qwen/config.py: qwen2, qwen3, qwen3_moe, ...), GemmaConfig
(gemma/config.py: gemma, gemma2, gemma3_text; gh-pages 1.1.0/_modules/... @8660c11, generated from
48b7b5d), LLaMAConfig (llama/config.py: any AutoConfig; Mixtral as MoE, Granite's multipliers). MODEL_MAP
1.1.0 has no class for Olmo2ForCausalLM or SmolLM3ForCausalLM. tests/contract/upstream/engine_model_classes.tsv
records the rows and their sources.
"""

from __future__ import annotations

from pipeline.architectures import SUPPORTED_ARCHITECTURES
from pipeline.backends.trtllm.versions import PINNED
from pipeline.errors import UnsupportedModelError

# HF architecture (config.json `architectures[0]`) -> TensorRT-LLM 1.1.0 model class (MODEL_MAP).
MODEL_CLASS_FOR_ARCHITECTURE: dict[str, str] = {
    "LlamaForCausalLM": "LLaMAForCausalLM",
    "MistralForCausalLM": "LLaMAForCausalLM",
    "MixtralForCausalLM": "LLaMAForCausalLM",
    "GraniteForCausalLM": "LLaMAForCausalLM",
    "Qwen2ForCausalLM": "QWenForCausalLM",
    "Qwen3ForCausalLM": "QWenForCausalLM",
    "Qwen3MoeForCausalLM": "QWenForCausalLM",
    "Gemma2ForCausalLM": "GemmaForCausalLM",
    "Gemma3ForCausalLM": "GemmaForCausalLM",
    "Phi3ForCausalLM": "Phi3ForCausalLM",
}


# The PyTorch backend's list lives beside the engine route's table so both refusals can name the other
# route without the two packages importing each other.
# Of llmpipe's architectures, those the PyTorch backend of TensorRT-LLM 1.1.0 registers.
PYTORCH_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)


def other_routes(arch: str, refused_by: str) -> str:
    """What to use instead of backend `refused_by` for `arch`: the other llmpipe backends that build it."""
    routes = {
        "trtllm_pytorch": arch in PYTORCH_ARCHITECTURES,
        "trtllm": arch in MODEL_CLASS_FOR_ARCHITECTURE,
        "torch": arch in SUPPORTED_ARCHITECTURES,
    }
    usable = [f"backend: {name}" for name, ok in routes.items() if ok and name != refused_by]
    if not usable:
        return "no llmpipe backend builds it"
    return "use " + " or ".join(usable)


def engine_model_class(arch: str) -> str:
    """The TensorRT-LLM model class that converts `arch`; UnsupportedModelError (one line, naming the
    routes that do take it) when the pinned release's engine route has none."""
    if arch in MODEL_CLASS_FOR_ARCHITECTURE:
        return MODEL_CLASS_FOR_ARCHITECTURE[arch]
    raise UnsupportedModelError(
        f"backend trtllm: architecture {arch or '(none)'} has no model class in TensorRT-LLM {PINNED}'s engine "
        f"route (tensorrt_llm.models.MODEL_MAP); it has {', '.join(MODEL_CLASS_FOR_ARCHITECTURE)}; "
        f"{other_routes(arch, 'trtllm')}"
    )
