"""Triton entry point; the logic is pipeline.serving.triton_models.preprocessing."""

from pipeline.serving.triton_models.preprocessing import PreprocessingModel as TritonPythonModel  # noqa: F401
