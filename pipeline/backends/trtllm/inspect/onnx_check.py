"""ONNX files of engines: onnx.checker over a torch engine's exported step, and the listing of what trtllm-build
--visualize_network wrote (TensorRT layer types, which onnx.checker cannot accept)."""

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


def network_files(folder: Path) -> list[dict[str, Any]]:
    """What trtllm-build --visualize_network wrote (name and size). Not checked as ONNX: the file holds
    TensorRT layer types (PLUGIN_V2, ...) that are no ONNX operators, so onnx.checker refuses every real one."""
    if not folder.is_dir():
        return []
    return [{"file": p.name, "bytes": p.stat().st_size} for p in sorted(folder.rglob("*.onnx"))]
