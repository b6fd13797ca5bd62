"""NVIDIA ModelOpt (`nvidia-modelopt`, pure Python, runs on the CPU torch): llmpipe's one home of its use.

The trtllm backend's calibrated formats (fp8, int8_sq, int4_awq, w4a8_awq, nvfp4, and a quantized KV
cache) are produced here, on the Hugging Face checkpoint, the way TensorRT-LLM's
examples/quantization/quantize.py produces them, without TensorRT-LLM installed:

  library   imports ModelOpt quietly, or says what to install
  formats   quantization.mode / kv_cache_dtype / group_size -> the ModelOpt quantize config
  shapes    the group/block-size divisibility check, from the HF config.json alone (before any load)
  loop      the float32 HF model and the calibration forward loop over llmpipe's calibration data
  export    the TensorRT-LLM checkpoint (config.json + rank{r}.safetensors) and the unified HF checkpoint
  state     the calibrated ModelOpt state saved beside the export; the fake-quantized model rebuilt from it
  run       the quantize step: check, load, calibrate, save the state, export
"""
