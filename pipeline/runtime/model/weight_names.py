"""The runtime checkpoint's tensor names: what convert writes, the loader reads and quantization walks."""

from __future__ import annotations

# Runtime name -> the HF tensors it is made of, concatenated along dim 0 in this order.
GLOBAL_WEIGHTS: dict[str, tuple[str, ...]] = {
    "transformer.vocab_embedding.weight": ("model.embed_tokens.weight",),
    "transformer.ln_f.weight": ("model.norm.weight",),
    "lm_head.weight": ("lm_head.weight",),  # falls back to model.embed_tokens.weight when tied
}
LAYER_WEIGHTS: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "attention.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attention.dense.weight": ("self_attn.o_proj.weight",),
    "post_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.proj.weight": ("mlp.down_proj.weight",),
}
QKV_BIAS_WEIGHTS: dict[str, tuple[str, ...]] = {
    "attention.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
}
# The linear layers of each transformer block (runtime names, the weights above without ".weight").
LAYER_LINEARS: tuple[str, ...] = ("attention.qkv", "attention.dense", "mlp.gate_up", "mlp.proj")
