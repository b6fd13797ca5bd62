"""Stand-in model classes: TensorRT-LLM 1.x signatures, calls recorded, placeholder files written."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import tensorrt_llm
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.models.modeling_utils import QuantConfig


def _record(name: str, func: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    bound = inspect.signature(func).bind(*args, **kwargs)  # TypeError on a keyword the real API lacks
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("cls", None)
    arguments.pop("self", None)
    tensorrt_llm.CALLS.append((name, arguments))
    return arguments


def _write_config(out: Path, arch: str, mapping: Mapping, quant: QuantConfig | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    quantization = {
        "quant_algo": quant.quant_algo.value if quant and quant.quant_algo else None,
        "kv_cache_quant_algo": quant.kv_cache_quant_algo.value
        if quant and quant.kv_cache_quant_algo
        else None,
        "group_size": quant.group_size if quant else 128,
        "clamp_val": quant.clamp_val if quant else None,
    }
    config = {
        "architecture": arch,
        "dtype": "float16",
        "quantization": quantization,
        "mapping": {"world_size": mapping.world_size, "tp_size": mapping.tp_size, "pp_size": mapping.pp_size},
    }
    (out / "config.json").write_text(json.dumps(config))


class _StandInModel:
    ARCH = ""

    def __init__(self, mapping: Mapping, quant_config: QuantConfig | None) -> None:
        self.mapping, self.quant_config = mapping, quant_config

    @classmethod
    def from_hugging_face(
        cls,
        hf_model_or_dir: Any,
        dtype: str = "auto",
        mapping: Mapping | None = None,
        quant_config: QuantConfig | None = None,
        **kwargs: Any,
    ) -> _StandInModel:
        args = _record(
            f"{cls.__name__}.from_hugging_face",
            cls.from_hugging_face.__func__,
            cls,
            hf_model_or_dir,
            dtype,
            mapping,
            quant_config,
            **kwargs,
        )
        return cls(args["mapping"] or Mapping(), args["quant_config"])

    def save_checkpoint(self, output_dir: str, save_config: bool = True) -> None:
        _record(
            f"{type(self).__name__}.save_checkpoint",
            type(self).save_checkpoint,
            self,
            output_dir,
            save_config,
        )
        out = Path(output_dir)
        if save_config:
            _write_config(out, self.ARCH, self.mapping, self.quant_config)
        (out / f"rank{self.mapping.rank}.safetensors").write_bytes(b"stand-in shard")


class LLaMAForCausalLM(_StandInModel):
    ARCH = "LlamaForCausalLM"


class QWenForCausalLM(_StandInModel):
    ARCH = "Qwen2ForCausalLM"
