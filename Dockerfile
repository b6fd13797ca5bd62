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
COPY scripts/image_requirements.py ./scripts/
COPY pipeline ./pipeline
COPY build_configs ./build_configs

# NOTE: --no-deps keeps the image's torch, transformers and tensorrt_llm exactly as NVIDIA built them
# (TensorRT-LLM pins its own transformers): pyproject.toml's dependencies that the image already has stay at
# the image's version, and only the ones it lacks are installed, within pyproject's ranges.
RUN python3 -m pip install --no-cache-dir --no-deps -e . \
 && python3 scripts/image_requirements.py > /tmp/llmpipe-requirements.txt \
 && python3 -m pip install --no-cache-dir -r /tmp/llmpipe-requirements.txt \
 && python3 -c "import tensorrt_llm, pipeline.cli.main; print('tensorrt_llm', tensorrt_llm.__version__)"

ENTRYPOINT ["llmpipe"]
CMD ["doctor"]
