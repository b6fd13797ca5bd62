"""llmpipe: Hugging Face checkpoint -> quantized in-flight-batching engine -> Triton model repository."""

import os

__version__ = "0.1.0"

# NOTE: must be set before torch (and its OpenMP runtime) is imported. With the default active wait
# policy, idle OpenMP workers spin and a loaded 2-core machine runs 10-40x slower (measured here).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
