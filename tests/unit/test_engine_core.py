"""LLMEngine (step, generate, error isolation) and EngineThread (streaming, cancel, overload), no model."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import ConfigError
from pipeline.runtime.core.outputs import RequestOutput, RunnerOutput, SchedulerOutput
from pipeline.runtime.core.request import RequestStatus
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.async_engine import EngineDeadError, EngineThread, QueueFullError, RequestStream
from pipeline.runtime.engine.engine_args import EngineArgs
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.runtime.engine.stream_interval import merged
from pipeline.runtime.engine_config import engine_config_from_dict, write_engine_config
from tests.helpers import FakeRunner, make_config, make_engine, make_prompt, reference_output

TIMEOUT_S = 10.0


class GatedRunner(FakeRunner):
    """A FakeRunner whose steps each wait for one `gate.release()`, so tests control the engine's pace."""

    def __init__(self, num_kv_blocks: int = 64, tokens_per_block: int = 4) -> None:
        super().__init__(num_kv_blocks, tokens_per_block)
        self.gate = threading.Semaphore(0)
        self.entered = threading.Semaphore(0)

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.entered.release()
        assert self.gate.acquire(timeout=TIMEOUT_S), "test never opened the gate"
        return super().execute(scheduler_output)


def _collect(stream: RequestStream) -> list[RequestOutput]:
    outputs = [stream.get(timeout=TIMEOUT_S)]
    while not outputs[-1].finished:
        outputs.append(stream.get(timeout=TIMEOUT_S))
    return outputs


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


# --- LLMEngine ---


def test_generate_returns_finished_requests_in_prompt_order() -> None:
    engine, _ = make_engine(max_batch_size=3)
    prompts = [make_prompt(i, 3 + 5 * i) for i in range(6)]
    params = [SamplingParams(max_tokens=2 + i) for i in range(6)]
    requests = engine.generate(prompts, params)
    assert [r.prompt_token_ids for r in requests] == prompts
    for request, p in zip(requests, params, strict=True):
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == reference_output(request.prompt_token_ids, p)
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        engine.generate([[1]], params[:2])


def test_a_failing_request_fails_alone_and_the_others_finish() -> None:
    engine, runner = make_engine(num_blocks=32)
    good = [engine.add_request(f"ok-{i}", make_prompt(i, 6), SamplingParams(max_tokens=5)) for i in range(3)]
    bad = engine.add_request("bad", make_prompt(9, 6), SamplingParams(max_tokens=5))
    runner.fail_request_ids = {"bad"}
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    (failed,) = [o for o in outputs if o.request_id == "bad"]
    assert failed.finished and failed.finish_reason == "error"
    assert "RuntimeError: fake failure for ['bad']" in str(failed.error)
    assert bad.status == RequestStatus.FINISHED_ERROR and bad.block_table == []
    for request in good:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, request.sampling_params)
    assert engine.scheduler.block_manager.num_free_blocks == 32
    assert "bad" in runner.seen_finished_ids  # told to the runner on the next step


def test_a_request_failing_alone_is_not_retried() -> None:
    engine, runner = make_engine()
    engine.add_request("bad", [1, 2, 3])
    runner.fail_request_ids = {"bad"}
    (output,) = engine.step()
    assert output.finish_reason == "error" and runner.num_calls == 1
    assert engine.step() == [] and not engine.has_unfinished()


def test_abort_returns_the_final_output() -> None:
    engine, _ = make_engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=10))
    engine.step()
    output = engine.abort("a")
    assert output is not None and output.finish_reason == "abort" and output.num_output_tokens == 1
    assert engine.abort("a") is None and not engine.has_unfinished()


def _outputs_by_request(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


@pytest.mark.parametrize("interval", [2, 3, 5])
def test_a_stream_interval_sends_the_same_tokens_in_fewer_outputs(interval: int) -> None:
    def run(stream_interval: int) -> dict[str, list[RequestOutput]]:
        engine = LLMEngine(FakeRunner(64, 4), make_config(max_batch_size=3), stream_interval=stream_interval)
        for i in range(4):
            engine.add_request(
                f"r{i}", make_prompt(i, 3 + i), SamplingParams(max_tokens=4 + 3 * i, logprobs=True)
            )
        return _outputs_by_request(engine)

    every_step, held = run(1), run(interval)
    for request_id, outputs in held.items():
        assert _tokens(outputs) == _tokens(every_step[request_id])
        assert [lp for o in outputs for lp in o.new_logprobs] == [
            lp for o in every_step[request_id] for lp in o.new_logprobs
        ]
        # The first token goes out alone, as it is sampled; then `interval` steps' tokens per output, and the
        # final output with whatever is left.
        assert [len(o.new_token_ids) for o in outputs[:-1]] == [1] + [interval] * (len(outputs) - 2)
        assert 1 <= len(outputs[-1].new_token_ids) <= interval and outputs[-1].finished
        assert not any(o.finished for o in outputs[:-1])
        assert [o.num_output_tokens for o in outputs] == list(
            itertools.accumulate(len(o.new_token_ids) for o in outputs)
        )


def test_a_stream_interval_keeps_the_first_token_timely_and_abort_brings_the_held_tokens() -> None:
    engine = LLMEngine(FakeRunner(64, 4), make_config(), stream_interval=4)
    prompt, params = make_prompt(0, 5), SamplingParams(max_tokens=20)
    engine.add_request("a", prompt, params)
    first = engine.step()
    assert [o.new_token_ids for o in first] == [reference_output(prompt, params)[:1]]
    assert engine.step() == [] and engine.step() == []
    output = engine.abort("a")
    assert output is not None and output.finish_reason == "abort"
    assert output.new_token_ids == reference_output(prompt, params)[1:3] and output.num_output_tokens == 3


def test_merged_outputs_join_generation_logits_and_keep_the_prompt_logits() -> None:
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    earlier = RequestOutput(
        "a", [5], [-0.5], False, None, 3, 1, context_logits=["prompt"], new_generation_logits=rows[:1]
    )
    later = RequestOutput("a", [6, 7], [-0.25, -1.0], True, "length", 3, 3, new_generation_logits=rows[1:])
    joined = merged(earlier, later)
    assert joined.new_token_ids == [5, 6, 7] and joined.new_logprobs == [-0.5, -0.25, -1.0]
    assert joined.context_logits == ["prompt"] and joined.finished and joined.finish_reason == "length"
    np.testing.assert_array_equal(joined.new_generation_logits, rows)
    aborted = RequestOutput("a", [], [], True, "abort", 3, 1)
    np.testing.assert_array_equal(merged(earlier, aborted).new_generation_logits, rows[:1])


def test_a_stream_interval_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="stream_interval=0"):
        LLMEngine(FakeRunner(64, 4), make_config(), stream_interval=0)


# --- EngineThread ---


def test_engine_thread_streams_deltas_that_add_up_to_the_reference() -> None:
    engine, _ = make_engine(max_batch_size=2)
    with EngineThread(engine, max_pending=8) as thread:
        params = SamplingParams(max_tokens=6, logprobs=True)
        streams = {f"r{i}": thread.submit(f"r{i}", make_prompt(i, 4 + i), params) for i in range(5)}
        for i, (request_id, stream) in enumerate(streams.items()):
            outputs = _collect(stream)
            assert all(o.request_id == request_id for o in outputs)
            assert _tokens(outputs) == reference_output(make_prompt(i, 4 + i), params)
            assert len(outputs) == 6 and outputs[-1].finish_reason == "length"
            assert outputs[-1].stats is not None and outputs[-1].stats.ttft is not None
            assert stream.finished
        stats = thread.stats()
        assert stats.num_requests_finished == {"length": 5} and stats.num_generated_tokens == 30
        assert stats.num_kv_blocks_used == 0 and thread.num_pending() == 0


def test_engine_thread_callback_mode_delivers_on_the_engine_thread() -> None:
    engine, _ = make_engine()
    received: list[RequestOutput] = []
    threads: set[str] = set()
    done = threading.Event()

    def on_output(output: RequestOutput) -> None:
        received.append(output)
        threads.add(threading.current_thread().name)
        if output.finished:
            done.set()

    with EngineThread(engine, name="engine-under-test") as thread:
        thread.submit("cb", [5, 6, 7], SamplingParams(max_tokens=4), callback=on_output)
        assert done.wait(TIMEOUT_S)
    assert _tokens(received) == reference_output([5, 6, 7], SamplingParams(max_tokens=4))
    assert threads == {"engine-under-test"}


def test_cancel_takes_effect_within_one_step() -> None:
    runner = GatedRunner()
    engine = LLMEngine(runner, make_config())
    with EngineThread(engine) as thread:
        stream = thread.submit("long", [1, 2, 3], SamplingParams(max_tokens=100))
        runner.gate.release()
        first = stream.get(timeout=TIMEOUT_S)
        assert first.new_token_ids and not first.finished
        assert runner.entered.acquire(timeout=TIMEOUT_S)  # step 1
        assert runner.entered.acquire(timeout=TIMEOUT_S)  # step 2 is running now
        stream.cancel()
        for _ in range(100):
            runner.gate.release()
        rest = _collect(stream)
    # The step already running delivers its token; the abort lands before the next one.
    assert [len(o.new_token_ids) for o in rest] == [1, 0]
    assert rest[-1].finish_reason == "abort" and rest[-1].num_output_tokens == 2


def test_is_cancelled_is_polled_before_every_step() -> None:
    runner = GatedRunner()
    engine = LLMEngine(runner, make_config())
    cancelled = threading.Event()
    with EngineThread(engine) as thread:
        stream = thread.submit("a", [1, 2, 3], SamplingParams(max_tokens=100), is_cancelled=cancelled.is_set)
        assert runner.entered.acquire(timeout=TIMEOUT_S)  # step 1 is running
        cancelled.set()
        for _ in range(100):
            runner.gate.release()
        outputs = _collect(stream)
    assert [len(o.new_token_ids) for o in outputs] == [1, 0] and outputs[-1].finish_reason == "abort"


def test_overload_is_rejected_fast_with_queue_full() -> None:
    runner = GatedRunner()
    engine = LLMEngine(runner, make_config())
    with EngineThread(engine, max_pending=2) as thread:
        streams = [thread.submit(f"r{i}", [1, 2, i], SamplingParams(max_tokens=2)) for i in range(2)]
        assert runner.entered.acquire(timeout=TIMEOUT_S)  # the engine is busy in a step
        start = time.monotonic()
        with pytest.raises(QueueFullError, match=r"queue is full \(2 unfinished requests, max_pending=2\)"):
            thread.submit("r2", [1, 2, 3])
        assert time.monotonic() - start < 0.5
        for _ in range(100):
            runner.gate.release()
        for stream in streams:
            assert _collect(stream)[-1].finish_reason == "length"
        assert _collect(thread.submit("r3", [1, 2, 3], SamplingParams(max_tokens=1)))[-1].finished


def test_submit_rejects_impossible_and_duplicate_requests_synchronously() -> None:
    runner = GatedRunner()
    engine = LLMEngine(runner, make_config(max_input_len=8))
    with EngineThread(engine) as thread:
        with pytest.raises(ValueError, match=r"Prompt length \(9\) exceeds maximum input length \(8\)"):
            thread.submit("long", list(range(9)))
        stream = thread.submit("a", [1, 2])
        with pytest.raises(ValueError, match="already in use"):
            thread.submit("a", [1, 2])
        stream.cancel()
        for _ in range(100):
            runner.gate.release()
        assert _collect(stream)[-1].finish_reason == "abort"


def test_shutdown_ends_open_streams_and_refuses_new_work() -> None:
    runner = GatedRunner()
    engine = LLMEngine(runner, make_config())
    thread = EngineThread(engine)
    stream = thread.submit("a", [1, 2, 3], SamplingParams(max_tokens=50))
    assert runner.entered.acquire(timeout=TIMEOUT_S)
    stopper = threading.Thread(target=thread.shutdown)
    stopper.start()
    runner.gate.release()
    stopper.join(TIMEOUT_S)
    outputs = _collect(stream)
    assert outputs[-1].finish_reason == "abort"
    with pytest.raises(EngineDeadError, match="engine shut down"):
        thread.submit("b", [1])


def test_an_engine_bug_fails_every_stream_instead_of_hanging() -> None:
    class BrokenRunner(FakeRunner):
        def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
            return RunnerOutput(sampled_token_ids=[])  # wrong length: update() raises

    engine = LLMEngine(BrokenRunner(64, 4), make_config())
    with EngineThread(engine) as thread:
        outputs = _collect(thread.submit("a", [1, 2, 3]))
        assert outputs[-1].finish_reason == "error" and "runner returned 0 token lists" in str(
            outputs[-1].error
        )
        with pytest.raises(EngineDeadError, match="engine failed"):
            thread.submit("b", [1])


def test_idle_engine_thread_does_not_step() -> None:
    engine, runner = make_engine()
    with EngineThread(engine) as thread:
        _collect(thread.submit("a", [1, 2], SamplingParams(max_tokens=2)))
        calls = runner.num_calls
        time.sleep(0.2)
        assert runner.num_calls == calls and thread._thread.is_alive()


# --- from_engine_dir (the override checks run before any weights load) ---


def _write_engine_config(engine_dir: Path) -> None:
    model = {
        "architecture": "LlamaForCausalLM",
        "dtype": "float32",
        "vocab_size": 64,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "intermediate_size": 32,
        "max_position_embeddings": 256,
        "norm_epsilon": 1e-5,
        "hidden_act": "silu",
    }
    limits = {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 64, "max_num_tokens": 64}
    config = engine_config_from_dict({"version": "0", "pretrained_config": model, "build_config": limits})
    write_engine_config(engine_dir, config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_batch_size": 8}, "max_batch_size=8 exceeds the 4 the engine in .* was built for"),
        ({"max_num_tokens": 16}, "max_num_tokens=16 < max_input_len=32"),
    ],
)
def test_from_engine_dir_rejects_bad_overrides(tmp_path: Path, overrides: dict, message: str) -> None:
    _write_engine_config(tmp_path)
    with pytest.raises(ConfigError, match=message):
        LLMEngine.from_engine_dir(tmp_path, EngineArgs(**overrides))
