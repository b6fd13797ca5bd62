"""Stand-in for TensorRT-LLM's llmapi Triton model (triton_backend/all_models/llmapi/tensorrt_llm/1/model.py),
which NVIDIA's serving image carries and a trtllm_pytorch repository's loader runs. Tests point the loader at
this folder (LLMPIPE_LLMAPI_MODEL_DIR).

It does what upstream's does with its surroundings, nothing more
(NVIDIA/TensorRT-LLM:triton_backend/all_models/llmapi/tensorrt_llm/1/model.py@044a90d): imports `helpers`
from its own folder, reads `os.path.join(pb_utils.get_model_dir(), os.environ.get("LLM_CONFIG_PATH",
"model.yaml"))`, hands Triton triton_config's decoupled and max_batch_size in auto_complete_config, and
passes every other key to LLM(**args), whose `model` path resolves against the working directory. Instead
of starting an LLM it records what it found (`seen`), and answers every request with that record as JSON in
text_output.
"""

import json
import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml
from helpers import STAND_IN


def _model_yaml() -> dict:
    path = os.path.join(pb_utils.get_model_dir(), os.environ.get("LLM_CONFIG_PATH", "model.yaml"))
    with open(path) as file:
        return yaml.safe_load(file)


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        triton_config = _model_yaml()["triton_config"]
        auto_complete_model_config.set_model_transaction_policy(
            {"decoupled": bool(triton_config["decoupled"])}
        )
        auto_complete_model_config.set_max_batch_size(int(triton_config["max_batch_size"]))
        return auto_complete_model_config

    def initialize(self, args):
        llm_args = {k: v for k, v in _model_yaml().items() if k != "triton_config"}
        model = Path(llm_args["model"])  # what LLM(model=...) would open
        self.seen = {
            "cwd": os.getcwd(),
            "helpers": STAND_IN,
            "model": str(model.resolve()),
            "model_has_config": (model / "config.json").is_file(),
            "llm_args": sorted(llm_args),
        }

    def execute(self, requests):
        text = np.array([json.dumps(self.seen).encode()], dtype=object)
        for request in requests:
            response = pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)])
            sender = request.get_response_sender()
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
