"""Stand-in model classes: TensorRT-LLM 1.2 signatures, calls recorded, placeholder files written."""

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


def _write_checkpoint(
    out: Path, arch: str, mapping: Mapping, quant: QuantConfig | None, ranks: range
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    quantization = {
        "quant_algo": quant.quant_algo.value if quant and quant.quant_algo else None,
        "kv_cache_quant_algo": quant.kv_cache_quant_algo.value
        if quant and quant.kv_cache_quant_algo
        else None,
        "group_size": quant.group_size if quant else 128,
    }
    config = {
        "architecture": arch,
        "dtype": "float16",
        "quantization": quantization,
        "mapping": {"world_size": mapping.world_size, "tp_size": mapping.tp_size, "pp_size": mapping.pp_size},
    }
    (out / "config.json").write_text(json.dumps(config))
    for rank in ranks:
        (out / f"rank{rank}.safetensors").write_bytes(b"stand-in shard")


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
            _write_checkpoint(out, self.ARCH, self.mapping, self.quant_config, range(0))
        (out / f"rank{self.mapping.rank}.safetensors").write_bytes(b"stand-in shard")

    @classmethod
    def quantize(
        cls,
        hf_model_dir: str,
        output_dir: str,
        dtype: str = "auto",
        mapping: Mapping | None = None,
        quant_config: QuantConfig | None = None,
        *,
        device: str = "cuda",
        calib_dataset: str = "cnn_dailymail",
        calib_batches: int = 512,
        calib_batch_size: int = 1,
        calib_max_seq_length: int = 512,
        random_seed: int = 1234,
        tokenizer_max_seq_length: int = 2048,
        **kwargs: Any,
    ) -> None:
        args = _record(
            f"{cls.__name__}.quantize",
            cls.quantize.__func__,
            cls,
            hf_model_dir,
            output_dir,
            dtype,
            mapping,
            quant_config,
            device=device,
            calib_dataset=calib_dataset,
            calib_batches=calib_batches,
            calib_batch_size=calib_batch_size,
            calib_max_seq_length=calib_max_seq_length,
            random_seed=random_seed,
            tokenizer_max_seq_length=tokenizer_max_seq_length,
            **kwargs,
        )
        # What a local calibration folder held at call time (it is a temporary folder).
        calib = Path(calib_dataset) / "train.jsonl"
        args["calib_records"] = calib.read_text().splitlines() if calib.is_file() else None
        mapping = mapping or Mapping()
        _write_checkpoint(Path(output_dir), cls.ARCH, mapping, quant_config, range(mapping.world_size))


class LLaMAForCausalLM(_StandInModel):
    ARCH = "LlamaForCausalLM"


class QWenForCausalLM(_StandInModel):
    ARCH = "Qwen2ForCausalLM"
