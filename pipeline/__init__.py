"""llmpipe: Hugging Face checkpoint -> quantized in-flight-batching engine -> Triton model repository."""

__version__ = "0.1.0"
