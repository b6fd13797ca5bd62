# llmpipe for NVIDIA GPU hosts: the serving image of the pinned TensorRT-LLM release, with llmpipe in it.
#
# Engines are built INSIDE this image, by the same TensorRT-LLM/TensorRT that serves them: a TensorRT plan
# only loads in the version that wrote it. The base tag must stay equal to
# pipeline/backends/trtllm/versions.py PINNED_CONTAINER (a contract test checks it).
#
#   make image                      # docker build -t llmpipe:trtllm .
#   docker run --rm --gpus all llmpipe:trtllm doctor
#   docker run --rm --gpus all -v "$PWD/build:/opt/llmpipe/build" -v "$HOME/models:/models:ro" \
#       llmpipe:trtllm build build_configs/<config>.yaml     # convert, quantize, trtllm-build, package
#   docker run --rm --gpus all --shm-size=2g -p 127.0.0.1:8000-8002:8000-8002 \
#       -v "$PWD/build:/opt/llmpipe/build" llmpipe:trtllm serve build_configs/<config>.yaml
ARG BASE_IMAGE=nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3
FROM ${BASE_IMAGE}

WORKDIR /opt/llmpipe
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY build_configs ./build_configs

# NOTE: llmpipe installs with its dependencies, constrained to every version the image already holds, so
# TensorRT-LLM, torch and transformers stay exactly as NVIDIA built them and pip only adds what is missing.
# TensorRT-LLM 1.1.0 pins transformers==4.56.0 (hence huggingface-hub<1, tokenizers 0.22), all inside
# pyproject.toml's ranges; tests/integration/test_trtllm_dependencies.py runs llmpipe on that stack. An image
# version outside a range stops this build with pip's conflict report instead of being replaced.
RUN python3 -m pip list --format=freeze > /tmp/image-versions.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/image-versions.txt -e . \
 && python3 -c "import tensorrt_llm, transformers, pipeline.cli.main; \
print('tensorrt_llm', tensorrt_llm.__version__, 'transformers', transformers.__version__)"

ENTRYPOINT ["llmpipe"]
CMD ["doctor"]
