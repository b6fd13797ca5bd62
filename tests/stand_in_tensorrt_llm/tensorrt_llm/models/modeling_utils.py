"""Stand-in `tensorrt_llm.models.modeling_utils.QuantConfig` (the 1.x dataclass fields llmpipe sets)."""

from __future__ import annotations

from dataclasses import dataclass

from tensorrt_llm.quantization import QuantAlgo


@dataclass
class QuantConfig:
    quant_algo: QuantAlgo | None = None
    kv_cache_quant_algo: QuantAlgo | None = None
    group_size: int = 128
    smoothquant_val: float = 0.5
    clamp_val: list[float] | None = None
    use_meta_recipe: bool = False
    has_zero_point: bool = False
    pre_quant_scale: bool = False
    exclude_modules: list[str] | None = None
