"""Triton entry point; the logic is pipeline.serving.postprocessing."""
from pipeline.serving.postprocessing import PostprocessingModel as TritonPythonModel  # noqa: F401
