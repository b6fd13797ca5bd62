"""ModelRunner.score: teacher-forced logits of a whole sequence, in prefill chunks of max_num_tokens, equal
Hugging Face's forward on both attention paths; validate's EngineTarget scores through it with blocks from
the engine's block manager and gives them back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.runtime.engine.engine_args import EngineArgs, RunnerArgs
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.worker.model_runner import ModelRunner
from pipeline.validate.engine_side import EngineTarget
from tests.serving_helpers import build_tiny_engine

LOGIT_TOLERANCE = 1e-4  # fp32 on both sides: summation-order noise only (test_parity's log-prob bound)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a 64-token step budget: a 300-token sequence scores in 5 chunks."""
    return build_tiny_engine(
        tiny_llama_dir,
        tmp_path_factory.mktemp("score"),
        engine={"max_batch_size": 4, "max_input_len": 512, "max_seq_len": 1024, "max_num_tokens": 64},
        kv_cache={"tokens_per_block": 8, "max_tokens": 2048},
        scheduler={"enable_chunked_context": True},
    )


@pytest.fixture(scope="module")
def sequence_and_reference(tiny_llama_dir: Path) -> tuple[list[int], torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    rng = random.Random(7)
    tokens = [rng.randrange(10, hf.config.vocab_size) for _ in range(300)]
    with torch.inference_mode():
        return tokens, hf(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("attention", ["kernel", "torch"])
def test_score_equals_hf_logits_across_chunks(
    engine_dir: Path, sequence_and_reference: tuple[list[int], torch.Tensor], attention: str
) -> None:
    tokens, reference = sequence_and_reference
    runner = ModelRunner.from_engine_dir(engine_dir, RunnerArgs(device="cpu", attention=attention))
    assert runner.config.build.max_num_tokens < len(tokens)
    # shuffled blocks: the runner must follow the table it is given, not assume 0, 1, 2, ...
    table = random.Random(1).sample(range(runner.num_kv_blocks), -(-len(tokens) // runner.tokens_per_block))
    logits = runner.score(tokens, table)
    assert logits.shape == reference.shape and logits.dtype == torch.float32
    assert float((logits - reference).abs().max()) < LOGIT_TOLERANCE


def test_score_refuses_a_table_too_small(engine_dir: Path) -> None:
    runner = ModelRunner.from_engine_dir(engine_dir, RunnerArgs(device="cpu"))
    with pytest.raises(ValueError, match="block table of 2 blocks cannot hold 17 tokens"):
        runner.score(list(range(10, 27)), [0, 1])
    with pytest.raises(ValueError, match="at least one token"):
        runner.score([], [0])


def test_engine_target_scores_with_blocks_from_the_block_manager(
    engine_dir: Path, sequence_and_reference: tuple[list[int], torch.Tensor]
) -> None:
    tokens, reference = sequence_and_reference
    engine = LLMEngine.from_engine_dir(engine_dir, EngineArgs(runner=RunnerArgs(device="cpu")))
    block_manager = engine.scheduler.block_manager
    target = EngineTarget(engine)
    logits = target.score(tokens)
    assert float((logits - reference).abs().max()) < LOGIT_TOLERANCE
    assert block_manager.num_free_blocks == block_manager.num_blocks  # the borrowed blocks went back
    # and the engine still serves requests: causal attention makes row 19 the next-token logits of 20 tokens
    (output,) = target.generate([tokens[:20]], max_new_tokens=5, stop_ids=[])
    assert len(output) == 5 and output[0] == int(reference[19].argmax())
