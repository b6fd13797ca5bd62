"""Triton entry point; the logic is pipeline.serving.bls."""
from pipeline.serving.bls import BlsModel as TritonPythonModel  # noqa: F401
