"""Triton entry point (backend python) of a trtllm_pytorch model repository, written by `llmpipe package`.

It runs TensorRT-LLM's own llmapi model (triton_backend/all_models/llmapi/tensorrt_llm/1/model.py) as it
is, so the model always matches the TensorRT-LLM release of the image it runs in; that model reads model.yaml
beside this file. NVIDIA's serving image carries it in UPSTREAM_MODEL_DIR; the environment variable named by
UPSTREAM_MODEL_ENV points at another folder holding its model.py and helpers.py.
"""

import importlib.util
import os
import sys
from pathlib import Path

UPSTREAM_MODEL_ENV = "${upstream_model_env}"
UPSTREAM_MODEL_DIR = "${upstream_model_dir}"
CONTAINER = "${serving_container}"
TRTLLM_RELEASE = "${trtllm_release}"
# Not "model": Triton's stub imported this file under that name.
MODULE_NAME = "tensorrt_llm_llmapi_model"


class UpstreamModelMissing(ImportError):
    """The image has no llmapi model.py where this repository looks for it."""


def load_upstream_model(version_dir: Path) -> type:
    """The llmapi model's TritonPythonModel class, imported from its folder."""
    folder = Path(os.environ.get(UPSTREAM_MODEL_ENV) or UPSTREAM_MODEL_DIR)
    source = folder / "model.py"
    if not source.is_file():
        raise UpstreamModelMissing(
            f"{source} not found: this repository runs TensorRT-LLM's llmapi model from the serving image; "
            f"serve it in {CONTAINER} (TensorRT-LLM {TRTLLM_RELEASE}), or set {UPSTREAM_MODEL_ENV} to a "
            "folder holding triton_backend/all_models/llmapi/tensorrt_llm/1 (model.py, helpers.py)"
        )
    sys.path.insert(0, str(folder))  # it imports its helpers.py as a top-level module
    # model.yaml names the checkpoint relative to this folder and upstream hands that path to LLM(model=...)
    # as it is, which resolves it against the working directory. Triton runs every model instance in a
    # stub process of its own, so the change reaches this model only (and the workers its LLM starts).
    os.chdir(version_dir)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    spec.loader.exec_module(module)
    return module.TritonPythonModel


TritonPythonModel = load_upstream_model(Path(__file__).resolve().parent)
