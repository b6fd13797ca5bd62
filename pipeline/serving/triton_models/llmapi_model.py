"""The llmapi `tensorrt_llm` model (serving.interface=llmapi): TensorRT-LLM's llmapi Triton model's
tensors (triton_backend/all_models/llmapi/tensorrt_llm) over llmpipe's torch engine, tokenizing and
detokenizing in-process. The engine, its threads, cancellation and `stop` are EngineModel's; the tensors
are llmapi_io's.

As upstream's, the model is configured by `1/model.yaml`: `model` is the engine folder, and
`triton_config.{max_batch_size, decoupled}` reach Triton through `auto_complete_config` (config.pbtxt leaves
them out), `triton_config.cancellation_check_period_ms` sets how often clients are checked for having gone
away. The engine's other settings are config.pbtxt parameters, as for the inflight_batcher_llm model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

from pipeline.runtime.engine_config import TOKENIZER_DIR
from pipeline.serving.triton_models import triton_utils as tu
from pipeline.serving.triton_models.engine_model import EngineModel, engine_settings
from pipeline.serving.triton_models.io import EngineRequest, StopRequest
from pipeline.serving.triton_models.llmapi_io import (
    LLMAPI_INPUTS,
    LlmApiRequest,
    LlmApiState,
    parse_llmapi_request,
)
from pipeline.serving.triton_models.streams import RequestState, ResponseGroup
from pipeline.serving.triton_models.tokenization import PromptEncoder

MODEL_YAML = "model.yaml"
# The keys of upstream's model.yaml that the torch engine takes (tests/contract/upstream/llmapi_model_yaml.txt
# records upstream's); its other LLM() arguments are fixed when llmpipe builds the engine.
TOP_KEYS = ("model", "backend", "tensor_parallel_size", "pipeline_parallel_size", "triton_config")
TRITON_CONFIG_KEYS = ("max_batch_size", "decoupled", "cancellation_check_period_ms")
DEFAULT_CANCELLATION_CHECK_PERIOD_MS = 100  # upstream model.py's


class ModelYamlError(ValueError):
    """model.yaml asks for something the torch engine cannot do: raised at load, naming the key."""

    def __init__(self, path: Path, key: str, value: object, allowed: str) -> None:
        super().__init__(f"{path}: {key}={value!r} is invalid: {allowed}")


@dataclass(frozen=True)
class ModelYaml:
    engine_dir: Path
    decoupled: bool
    cancellation_check_period_ms: int


def _exact(path: Path, key: str, value: object, wanted: object, why: str) -> None:
    if value != wanted or type(value) is not type(wanted):
        raise ModelYamlError(path, key, value, why)


def read_model_yaml(version_dir: Path) -> ModelYaml:
    """The model's `model.yaml`, validated; ModelYamlError names the first key that is wrong."""
    path = version_dir / MODEL_YAML
    if not path.is_file():
        raise ModelYamlError(path, "(file)", None, "missing: the llmapi model reads its settings from it")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ModelYamlError(path, "(top level)", type(data).__name__, "expected a mapping of keys")
    for key in data:
        if key not in TOP_KEYS:
            raise ModelYamlError(
                path,
                str(key),
                data[key],
                f"not a key the torch engine reads ({', '.join(TOP_KEYS)}); its other settings are fixed "
                "when `llmpipe build` builds the engine",
            )
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise ModelYamlError(path, "model", model, "required: the engine folder, relative to model.yaml")
    engine_dir = (version_dir / model).resolve()
    if not engine_dir.is_dir():
        raise ModelYamlError(path, "model", model, f"{engine_dir} is not a folder")
    _exact(path, "backend", data.get("backend", "pytorch"), "pytorch", "llmpipe's torch engine: pytorch")
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        _exact(path, key, data.get(key, 1), 1, "the torch engine runs on one device: 1")
    triton = data.get("triton_config")
    if not isinstance(triton, dict):
        raise ModelYamlError(
            path, "triton_config", triton, "required: a mapping with decoupled and max_batch_size"
        )
    for key in triton:
        if key not in TRITON_CONFIG_KEYS:
            raise ModelYamlError(
                path, f"triton_config.{key}", triton[key], f"choose among {', '.join(TRITON_CONFIG_KEYS)}"
            )
    _exact(
        path,
        "triton_config.max_batch_size",
        triton.get("max_batch_size"),
        0,
        "must be 0: Triton hands over requests one by one and the engine batches them in flight",
    )
    decoupled = triton.get("decoupled")
    if not isinstance(decoupled, bool):
        raise ModelYamlError(path, "triton_config.decoupled", decoupled, "required: true or false")
    period = triton.get("cancellation_check_period_ms", DEFAULT_CANCELLATION_CHECK_PERIOD_MS)
    if not isinstance(period, int) or isinstance(period, bool) or period < 0:
        raise ModelYamlError(path, "triton_config.cancellation_check_period_ms", period, "an integer >= 0")
    return ModelYaml(engine_dir, decoupled, period)


class LlmApiModel(EngineModel):
    """TritonPythonModel of the llmapi `tensorrt_llm` (pipeline/serving/templates/llmapi/tensorrt_llm/1/model.py)."""

    @staticmethod
    def auto_complete_config(auto_complete_model_config: Any) -> Any:
        """Triton's settings from model.yaml's triton_config, as upstream's model applies them."""
        spec = read_model_yaml(Path(pb_utils.get_model_dir()))
        auto_complete_model_config.set_model_transaction_policy({"decoupled": spec.decoupled})
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        version_dir = tu.version_dir(args)
        spec = read_model_yaml(version_dir)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        served = (self.decoupled, int(config.get("max_batch_size", 0)))
        if served != (spec.decoupled, 0):
            raise ModelYamlError(
                version_dir / MODEL_YAML,
                "triton_config",
                {"decoupled": spec.decoupled, "max_batch_size": 0},
                f"Triton serves the model with decoupled={served[0]}, max_batch_size={served[1]}: it did not "
                "call auto_complete_config; start tritonserver without --disable-auto-complete-config",
            )
        params = tu.ModelParameters(self.model_name, config)
        settings = engine_settings(params, spec.engine_dir, spec.cancellation_check_period_ms)
        self.encoder = PromptEncoder.from_dir(
            settings.engine_dir / TOKENIZER_DIR, add_special_tokens=params.boolean("add_special_tokens", True)
        )
        self.skip_special_tokens = params.boolean("skip_special_tokens", True)
        engine = self._start(args, settings, f"{MODEL_YAML} model")
        self.encoder.max_input_len = self.limits.max_input_len
        self.tokens_per_block = engine.runner.tokens_per_block

    def _parse(self, request: Any) -> list[EngineRequest] | StopRequest:
        parsed = parse_llmapi_request(
            tu.request_inputs(request, LLMAPI_INPUTS),
            self.encoder,
            self.limits,
            default_exclude_input=self.settings.exclude_input_in_output,
            decoupled=self.decoupled,
        )
        return parsed if isinstance(parsed, StopRequest) else [parsed]

    def _new_state(
        self, engine_id: str, parsed: EngineRequest, sender: Any, group: ResponseGroup, row: int | None
    ) -> RequestState:
        assert isinstance(parsed, LlmApiRequest)
        return LlmApiState(
            engine_id,
            parsed,
            sender,
            self.encoder.tokenizer,
            skip_special_tokens=self.skip_special_tokens,
            tokens_per_block=self.tokens_per_block,
            timeout_s=self.settings.request_timeout_s,
            group=group,
        )

    def _stop_acknowledgement(self) -> dict[str, np.ndarray]:
        return {"text_output": tu.string_array([""], (1,))}
