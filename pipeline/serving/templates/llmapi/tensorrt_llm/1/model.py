"""Triton entry point (backend python); the logic is pipeline.serving.triton_models.llmapi_model."""

from pipeline.serving.triton_models.llmapi_model import LlmApiModel as TritonPythonModel  # noqa: F401
