"""Triton entry point; the logic is pipeline.serving.preprocessing."""
from pipeline.serving.preprocessing import PreprocessingModel as TritonPythonModel  # noqa: F401
