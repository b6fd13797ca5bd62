"""Stand-in for the helpers.py beside TensorRT-LLM's llmapi model.py, which that model imports as a top-level
module (`from helpers import ...`). Imported only by the stand-in model.py next to it."""

STAND_IN = "tests/stand_in_llmapi_model/helpers.py"
