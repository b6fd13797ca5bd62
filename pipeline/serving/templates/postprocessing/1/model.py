"""Triton entry point; the logic is pipeline.serving.triton_models.postprocessing."""

from pipeline.serving.triton_models.postprocessing import PostprocessingModel as TritonPythonModel  # noqa: F401
