"""Triton entry point (backend python); the logic is pipeline.serving.triton_models.engine_model."""

from pipeline.serving.triton_models.engine_model import TorchEngineModel as TritonPythonModel  # noqa: F401
