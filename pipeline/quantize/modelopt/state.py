"""The calibrated ModelOpt model, saved beside the export, and rebuilt from it for accuracy validation.

`mto.save` writes ModelOpt's state (which modules carry which quantizers, with what settings) and the model's
state dict (the quantizers' amax and pre-quantization scales, and the weights that SmoothQuant/AWQ rescaled);
`mto.restore` on a fresh float model of the same checkpoint rebuilds the fake-quantized model with the same
scales the export wrote, and reads the file with torch's weights-only loader. The state is saved before
exporting, since ModelOpt's exporters change the model they export.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.errors import MissingArtifactError
from pipeline.quantize.modelopt.library import ModelOptLog, import_modelopt
from pipeline.quantize.modelopt.loop import load_float_model

STATE_FILE = "modelopt_state.pth"
# Where a quantize output whose folder is itself a checkpoint to serve (the unified HF checkpoint of the
# trtllm_pytorch route) keeps the state: a subfolder that packaging leaves out.
SIMULATION_DIR = "simulation"


def state_path(quantized_dir: Path) -> Path:
    """The saved state of a quantize output: in the folder itself, or in its SIMULATION_DIR."""
    direct = Path(quantized_dir) / STATE_FILE
    return direct if direct.is_file() else Path(quantized_dir) / SIMULATION_DIR / STATE_FILE


def save_state(model: torch.nn.Module, out_dir: Path, log: ModelOptLog) -> str:
    """Write the calibrated model's ModelOpt state into `out_dir`; the file's name."""
    import modelopt.torch.opt as mto

    with log.capture():
        mto.save(model, out_dir / STATE_FILE)
    return STATE_FILE


def load_simulated_model(
    hf_dir: Path, quantized_dir: Path, log: ModelOptLog | None = None
) -> torch.nn.Module:
    """The HF model of `hf_dir` with ModelOpt's simulated (fake) quantization as calibrated into
    `quantized_dir`: float32 tensors, quantize-dequantize at every quantizer, in eval mode."""
    path = state_path(quantized_dir)
    if not path.is_file():
        raise MissingArtifactError(
            f"no {STATE_FILE} in {quantized_dir}: it was not quantized by ModelOpt",
            hint="Run `llmpipe quantize CONFIG` with a ModelOpt mode (fp8, int8_sq, int4_awq, w4a8_awq, nvfp4).",
        )
    log = log or ModelOptLog()
    import_modelopt(log)
    import modelopt.torch.opt as mto

    model, _ = load_float_model(Path(hf_dir))
    with log.capture():
        restored: torch.nn.Module = mto.restore(model, path)
    return restored.eval()
