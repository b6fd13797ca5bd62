"""Triton entry point; the logic is pipeline.serving.triton_models.bls."""

from pipeline.serving.triton_models.bls import BlsModel as TritonPythonModel  # noqa: F401
