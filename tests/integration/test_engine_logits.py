"""The engine's context and generation logits (TensorRT-LLM's return_context_logits /
return_generation_logits) equal Hugging Face's forward at every position: across chunked prefill, after a
prefix cache hit (the cached positions are recomputed for such a request), and for each generated step."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.runtime.core.outputs import RequestOutput
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.engine_args import EngineArgs, RunnerArgs
from pipeline.runtime.engine.llm_engine import LLMEngine
from tests.serving_helpers import build_tiny_engine

LOGIT_TOLERANCE = 1e-4  # fp32 on both sides: summation-order noise only

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 64-token step budget (a 150-token prompt runs in 3 chunks) and KV block reuse."""
    return build_tiny_engine(
        tiny_llama_dir,
        tmp_path_factory.mktemp("logits"),
        engine={"max_batch_size": 4, "max_input_len": 512, "max_seq_len": 1024, "max_num_tokens": 64},
        kv_cache={"tokens_per_block": 8, "max_tokens": 2048, "enable_block_reuse": True},
        scheduler={"enable_chunked_context": True},
    )


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _hf_logits(hf: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].numpy()


def _run(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    engine.add_request(request_id, prompt, params)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_context_and_generation_logits_equal_hf(engine_dir: Path, hf: torch.nn.Module) -> None:
    engine = LLMEngine.from_engine_dir(engine_dir, EngineArgs(runner=RunnerArgs(device="cpu")))
    assert engine.config.enable_block_reuse and engine.config.max_num_tokens == 64
    rng = random.Random(3)
    prompt = [rng.randrange(10, hf.config.vocab_size) for _ in range(150)]
    params = SamplingParams(
        max_tokens=5, temperature=0.0, logprobs=True, context_logits=True, generation_logits=True
    )
    # A first request fills the prefix cache with the prompt's blocks; the second would hit all but the
    # last partial block, yet must still return logits for every prompt position.
    for request_id in ("first", "second"):
        outputs = _run(engine, request_id, prompt, params)
        (with_context,) = [o for o in outputs if o.context_logits is not None]
        assert with_context is outputs[0]
        context = np.concatenate(with_context.context_logits)
        tokens = [t for o in outputs for t in o.new_token_ids]
        generation = np.concatenate([o.new_generation_logits for o in outputs])
        reference = _hf_logits(hf, prompt + tokens)
        assert context.shape == (len(prompt), hf.config.vocab_size)
        assert np.abs(context - reference[: len(prompt)]).max() < LOGIT_TOLERANCE
        # generation step i is the row that predicted output token i (the first is the last prompt row)
        assert generation.shape == (len(tokens), hf.config.vocab_size)
        assert np.abs(generation - reference[len(prompt) - 1 : -1]).max() < LOGIT_TOLERANCE
        assert tokens == [int(np.argmax(row)) for row in generation]
        logprobs = [lp for o in outputs for lp in o.new_logprobs]
        expected = torch.log_softmax(torch.from_numpy(generation), -1)[range(len(tokens)), tokens]
        assert np.allclose(logprobs, expected.numpy(), atol=1e-5)
    assert engine.scheduler.block_manager.num_reuse_hits >= 1  # the second request did hit the cache


def test_requests_without_logits_get_none(engine_dir: Path) -> None:
    engine = LLMEngine.from_engine_dir(engine_dir, EngineArgs(runner=RunnerArgs(device="cpu")))
    outputs = _run(engine, "plain", list(range(10, 90)), SamplingParams(max_tokens=3, temperature=0.0))
    assert all(o.context_logits is None and o.new_generation_logits is None for o in outputs)
