"""rank0.safetensors (runtime layout) -> the model's weights on the compute device. Linear layers go
through one hook, `make_linear`, which routes quantized ones to pipeline.runtime.quant."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from pipeline.errors import IntegrityError, MissingArtifactError, UnsupportedModelError
from pipeline.runtime.engine_config import EngineConfig
from pipeline.runtime.model.layers import DenseLinear, Linear
from pipeline.runtime.model.weights import LayerWeights, ModelWeights, MoEWeights
from pipeline.runtime.model_config import ModelConfig, QuantConfig

# The norms of a layer in each norm_layout (runtime names).
NORMS: dict[str, tuple[str, ...]] = {
    "pre": ("input_layernorm.weight", "post_layernorm.weight"),
    "sandwich": (
        "input_layernorm.weight",
        "attention.output_norm.weight",
        "post_layernorm.weight",
        "mlp.output_norm.weight",
    ),
    "post": ("attention.output_norm.weight", "mlp.output_norm.weight"),
}
# pretrained_config.quantization.quant_algo -> QuantLinear scheme. AWQ is int4 group-wise once its
# activation scales are folded into the preceding weights (quantization.pre_quant_scale false); GPTQ only
# chooses the int4 levels.
QUANT_SCHEMES: dict[str, Literal["int8", "w8a8", "int4"]] = {
    "W8A16": "int8",
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": "w8a8",
    "W4A16": "int4",
    "W4A16_AWQ": "int4",
    "W4A16_GPTQ": "int4",
}


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """Read-only, lazy view of a safetensors file: a tensor is read when asked for (on CPU, stored dtype)."""

    def __init__(self, handle: object) -> None:
        self._handle = handle
        self._keys = list(handle.keys())  # type: ignore[attr-defined]
        self._key_set = set(self._keys)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._key_set:
            raise IntegrityError(
                f"engine weights lack tensor {name!r}", hint="rebuild the engine (`llmpipe build`)"
            )
        return self._handle.get_tensor(name)  # type: ignore[attr-defined]

    def __contains__(self, name: object) -> bool:
        return name in self._key_set

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def make_linear(
    prefix: str,
    tensors: Mapping[str, torch.Tensor],
    quant: QuantConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None = None,
    widened: bool = False,
) -> Linear:
    """The linear layer stored under `prefix` (e.g. transformer.layers.0.attention.qkv): dense from
    `{prefix}.weight` (+ `.bias`), or quantized from `{prefix}.qweight/.scales/.zeros` (+ `.bias`) by
    pipeline.runtime.quant.linear.QuantLinear with the scheme that `quant.quant_algo` names. A dense weight
    is kept in `weight_dtype` (default `dtype`, the compute dtype, which the bias always takes); with
    `widened`, a bf16 one stays as stored under fp32 compute on the CPU (DenseLinear.widened)."""
    bias_name = f"{prefix}.bias"
    if f"{prefix}.qweight" not in tensors:
        stored = tensors[f"{prefix}.weight"]
        bias = tensors[bias_name].to(device=device, dtype=dtype) if bias_name in tensors else None
        if widened and stored.dtype == torch.bfloat16 and dtype == torch.float32 and device.type == "cpu":
            return DenseLinear(stored.contiguous(), bias, widened=True)
        return DenseLinear(stored.to(device=device, dtype=weight_dtype or dtype).contiguous(), bias)
    if quant.quant_algo is None:
        raise IntegrityError(
            f"{prefix}.qweight is present but pretrained_config.quantization.quant_algo is null"
        )
    if _excluded(prefix, quant.exclude_modules):
        raise IntegrityError(f"{prefix} is quantized although quantization.exclude_modules excludes it")
    scheme = QUANT_SCHEMES.get(quant.quant_algo)
    if scheme is None:
        raise UnsupportedModelError(
            f"quant_algo {quant.quant_algo} is not implemented by the torch runtime; "
            f"supported: {', '.join(QUANT_SCHEMES)}"
        )
    if quant.pre_quant_scale:
        raise UnsupportedModelError(
            f"{prefix}: quantization.pre_quant_scale=true (AWQ activation scales applied at run time) is not "
            "implemented by the torch runtime; the quantizer must fold the scales into the weights"
        )
    from pipeline.runtime.quant.linear import QuantLinear

    parts = {
        key: tensors[f"{prefix}.{key}"]
        for key in ("qweight", "scales", "zeros", "bias")
        if f"{prefix}.{key}" in tensors
    }
    group_size = quant.group_size if scheme == "int4" else None
    return QuantLinear.from_packed(parts, scheme, group_size).to(device)


def _excluded(prefix: str, patterns: list[str] | None) -> bool:
    name = prefix.removeprefix("transformer.")
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(prefix, p) for p in patterns or [])


def expected_dense_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Runtime tensor name -> shape in the dense layout (what convert writes)."""
    hidden, d = model.hidden_size, model.head_dim
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    qkv_rows = (heads + 2 * kv_heads) * d
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.vocab_embedding.weight": (model.vocab_size, hidden),
        "transformer.ln_f.weight": (hidden,),
        "lm_head.weight": (model.vocab_size, hidden),
    }
    q_norm, k_norm = {"per_head": ((d,), (d,)), "full": ((heads * d,), (kv_heads * d,))}.get(
        model.qk_norm or "", (None, None)
    )
    for i in range(model.num_hidden_layers):
        p = f"transformer.layers.{i}."
        layer: dict[str, tuple[int, ...] | None] = {
            "attention.qkv.weight": (qkv_rows, hidden),
            "attention.qkv.bias": (qkv_rows,) if model.qkv_bias else None,
            "attention.dense.weight": (hidden, heads * d),
            "attention.dense.bias": (hidden,) if model.dense_bias else None,
            "attention.q_norm.weight": q_norm,
            "attention.k_norm.weight": k_norm,
            **dict.fromkeys(NORMS[model.norm_layout], (hidden,)),
        }
        if model.is_sparse(i):
            e, inter = model.num_experts, model.moe_intermediate_size
            layer["mlp.router.weight"] = (e, hidden)
            layer["mlp.experts.gate_up.weight"] = (e, 2 * inter, hidden)
            layer["mlp.experts.proj.weight"] = (e, hidden, inter)
        else:
            layer["mlp.gate_up.weight"] = (2 * model.intermediate_size, hidden)
            layer["mlp.proj.weight"] = (hidden, model.intermediate_size)
        shapes.update({p + name: shape for name, shape in layer.items() if shape is not None})
    return shapes


def check_dense_shapes(tensors: Mapping[str, torch.Tensor], model: ModelConfig, origin: str) -> None:
    handle_shapes = getattr(tensors, "_handle", None)
    for name, shape in expected_dense_shapes(model).items():
        if name not in tensors:
            continue  # quantized (.qweight) or checked when loaded
        actual = (
            tuple(handle_shapes.get_slice(name).get_shape()) if handle_shapes else tuple(tensors[name].shape)
        )
        if actual != shape:
            raise IntegrityError(f"{origin}: {name} has shape {actual}, config.json implies {shape}")


def _moe_weights(
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    model: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None,
) -> MoEWeights:
    """A sparse layer's router and experts (dense weights: quantization is refused for MoE models)."""

    def experts(name: str) -> list[Linear]:
        stacked = tensors[prefix + name].to(device=device, dtype=weight_dtype or dtype)
        return [DenseLinear(stacked[e].contiguous()) for e in range(model.num_experts)]

    return MoEWeights(
        router=tensors[prefix + "mlp.router.weight"].to(device=device, dtype=dtype).contiguous(),
        gate_up=experts("mlp.experts.gate_up.weight"),
        proj=experts("mlp.experts.proj.weight"),
        num_experts_per_tok=model.num_experts_per_tok,
        normalize_top_k=model.normalize_top_k,
    )


def load_model_weights(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    layer_weight_dtype: torch.dtype | None = None,
    widened_head: bool = False,
) -> ModelWeights:
    """The weights in `dtype`; the decoder layers' dense linear weights in `layer_weight_dtype` if given. The
    embedding and lm_head keep `dtype`, except with `widened_head` (CPU kernels only: they read it widened): a
    dense bf16 lm_head stays as stored (DenseLinear.widened: the same logits, half the bytes a step reads)."""
    path: Path = config.weights_path
    if not path.is_file():
        raise MissingArtifactError(f"{path} not found", hint="rebuild the engine (`llmpipe build`)")
    model, quant = config.model, config.model.quantization
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        tensors = CheckpointTensors(handle)
        check_dense_shapes(tensors, model, str(path))

        def vector(name: str) -> torch.Tensor:
            return tensors[name].to(device=device, dtype=dtype).contiguous()

        def linear(prefix: str, weight_dtype: torch.dtype | None = None, widened: bool = False) -> Linear:
            return make_linear(
                prefix, tensors, quant, device=device, dtype=dtype, weight_dtype=weight_dtype, widened=widened
            )

        def optional(name: str) -> torch.Tensor | None:
            return vector(name) if name in tensors else None

        layers = []
        for i in range(model.num_hidden_layers):
            p = f"transformer.layers.{i}."
            sparse = model.is_sparse(i)
            layers.append(
                LayerWeights(
                    input_norm=optional(p + "input_layernorm.weight"),
                    qkv=linear(p + "attention.qkv", layer_weight_dtype),
                    dense=linear(p + "attention.dense", layer_weight_dtype),
                    post_norm=optional(p + "post_layernorm.weight"),
                    gate_up=None if sparse else linear(p + "mlp.gate_up", layer_weight_dtype),
                    proj=None if sparse else linear(p + "mlp.proj", layer_weight_dtype),
                    attention_output_norm=optional(p + "attention.output_norm.weight"),
                    mlp_output_norm=optional(p + "mlp.output_norm.weight"),
                    q_norm=optional(p + "attention.q_norm.weight"),
                    k_norm=optional(p + "attention.k_norm.weight"),
                    moe=_moe_weights(tensors, p, model, device, dtype, layer_weight_dtype)
                    if sparse
                    else None,
                )
            )
        lm_head = linear("lm_head", widened=widened_head)
        # Tied and dense: the embedding is the same matrix, so keep one copy in memory.
        if model.tie_word_embeddings and isinstance(lm_head, DenseLinear):
            embedding = lm_head.weight
        else:
            embedding = vector("transformer.vocab_embedding.weight")
        return ModelWeights(
            embedding=embedding, layers=layers, final_norm=vector("transformer.ln_f.weight"), lm_head=lm_head
        )
