"""onnx.checker over exported networks: trtllm-build's `--visualize_network` folder, or one exported file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import IntegrityError


def check_onnx_file(path: Path) -> dict[str, Any]:
    """Run onnx.checker on `path` (by path, so external-data models over 2 GB work); summarise the graph."""
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as err:
        raise IntegrityError(f"{path} fails onnx.checker: {str(err).splitlines()[0]}") from None
    model = onnx.load(str(path), load_external_data=False)
    return {
        "file": path.name,
        "bytes": path.stat().st_size,
        "ir_version": model.ir_version,
        "opsets": {op.domain or "ai.onnx": op.version for op in model.opset_import},
        "nodes": len(model.graph.node),
        "inputs": [i.name for i in model.graph.input],
        "outputs": [o.name for o in model.graph.output],
    }


def check_onnx_files(folder: Path) -> list[dict[str, Any]]:
    """Check every .onnx file under `folder` (empty list when the folder does not exist)."""
    if not folder.is_dir():
        return []
    return [check_onnx_file(path) for path in sorted(folder.rglob("*.onnx"))]
