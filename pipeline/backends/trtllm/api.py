"""The TensorRT-LLM Python entry points llmpipe calls, imported in one place.

Signatures used (TensorRT-LLM 1.x, `tensorrt_llm/models/llama/model.py`, `examples/models/core/llama/
convert_checkpoint.py`):
  Mapping(world_size=, rank=, tp_size=, pp_size=)
  QuantConfig(quant_algo=, kv_cache_quant_algo=, group_size=, clamp_val=, ...)
  <ModelCls>.from_hugging_face(hf_model_or_dir, dtype='auto', mapping=None, quant_config=None, **kwargs)
  <model>.save_checkpoint(output_dir, save_config=True)
Only convert calls them, for the modes TensorRT-LLM applies without calibration; the calibrated formats go
through ModelOpt (pipeline.quantize.modelopt), not TensorRT-LLM's `<ModelCls>.quantize`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.backends.trtllm.architectures import MODEL_CLASS_FOR_ARCHITECTURE, engine_model_class
from pipeline.backends.trtllm.env import require_trtllm
from pipeline.config.build_config import BuildConfig
from pipeline.errors import UnsupportedModelError
from pipeline.quantize.modelopt.formats import uses_modelopt

# MODEL_CLASS_FOR_ARCHITECTURE's home is architectures.py (read by convert and the plan); re-exported here.
__all__ = [
    "MODEL_CLASS_FOR_ARCHITECTURE",
    "TrtllmApi",
    "check_unified_checkpoint",
    "convert_needs_trtllm",
    "hf_architecture",
    "load_api",
    "model_class_name",
    "stages_need_trtllm",
]


@dataclass(frozen=True)
class TrtllmApi:
    version: str
    mapping: Any  # tensorrt_llm.mapping.Mapping
    quant_config: Any  # tensorrt_llm.models.modeling_utils.QuantConfig
    quant_algo: Any  # tensorrt_llm.quantization.QuantAlgo
    models: Any  # the tensorrt_llm.models module

    def model_class(self, class_name: str) -> Any:
        return getattr(self.models, class_name)

    def make_quant_config(
        self,
        quant_algo: str | None,
        kv_cache_quant_algo: str | None,
        group_size: int,
        clamp_val: list[float] | None = None,
    ) -> Any:
        return self.quant_config(
            quant_algo=None if quant_algo is None else self.quant_algo[quant_algo],
            kv_cache_quant_algo=None if kv_cache_quant_algo is None else self.quant_algo[kv_cache_quant_algo],
            group_size=group_size,
            clamp_val=clamp_val,
        )


def convert_needs_trtllm(cfg: BuildConfig) -> bool:
    """Whether convert imports TensorRT-LLM: not for the formats ModelOpt produces from the HF checkpoint."""
    q = cfg.quantization
    return not uses_modelopt(q.mode, q.kv_cache_dtype)


def stages_need_trtllm(cfg: BuildConfig, stages: Iterable[str]) -> bool:
    """Whether running these stages imports TensorRT-LLM: the engine build always, convert for the modes it
    applies itself, quantize never (ModelOpt runs without it)."""
    names = set(stages)
    return "engine" in names or ("convert" in names and convert_needs_trtllm(cfg))


def load_api() -> TrtllmApi:
    """Import TensorRT-LLM (or raise BackendUnavailableError with what to install)."""
    require_trtllm()
    import tensorrt_llm
    import tensorrt_llm.models as models
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.quantization import QuantAlgo

    return TrtllmApi(str(tensorrt_llm.__version__), Mapping, QuantConfig, QuantAlgo, models)


def hf_architecture(hf_dir: Path) -> str:
    config = json.loads((hf_dir / "config.json").read_text())
    architectures = config.get("architectures") or []
    return str(architectures[0]) if architectures else ""


def model_class_name(hf_dir: Path) -> str:
    """The TensorRT-LLM model class of the checkpoint in `hf_dir` (architectures.MODEL_CLASS_FOR_ARCHITECTURE);
    an architecture the engine route lacks is refused in one line."""
    return engine_model_class(hf_architecture(hf_dir))


def check_unified_checkpoint(out_dir: Path, world_size: int) -> list[str]:
    """The files a TensorRT-LLM checkpoint must have: config.json and one rank{r}.safetensors per rank."""
    expected = ["config.json"] + [f"rank{r}.safetensors" for r in range(world_size)]
    missing = [name for name in expected if not (out_dir / name).is_file()]
    if missing:
        raise UnsupportedModelError(
            f"TensorRT-LLM wrote no {', '.join(missing)} into {out_dir}",
            hint="See the TensorRT-LLM log above; the checkpoint is incomplete.",
        )
    return expected
