"""Stand-in for TensorRT-LLM 1.2 (tests only; see ../README.md). `CALLS` records every entry-point call."""

from __future__ import annotations

from typing import Any

__version__ = "1.2.0"

# (qualified name, bound arguments) in call order; tests clear it.
CALLS: list[tuple[str, dict[str, Any]]] = []
