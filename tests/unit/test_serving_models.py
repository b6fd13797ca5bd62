"""The Triton Python models of a rendered repository, run in-process with tests/stub_pb_utils.py: the torch
engine model (streaming, cancellation, `stop`, errors, metrics, load-time validation), the BLS routed to
it, and pre/postprocessing. Token-exact against the in-process engine."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import json_format

from tests import stub_pb_utils as pb

pb.install()

from pipeline.runtime.core.sampling_params import SamplingParams  # noqa: E402
from pipeline.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from pipeline.serving.repository.pbtxt import parse_model_config  # noqa: E402
from pipeline.serving.repository.render import render_model_repository  # noqa: E402
from pipeline.serving.triton_models.bls import BlsModel  # noqa: E402
from pipeline.serving.triton_models.engine_model import TorchEngineModel  # noqa: E402
from pipeline.serving.triton_models.metrics import CountedHistogram  # noqa: E402
from pipeline.serving.triton_models.postprocessing import PostprocessingModel  # noqa: E402
from pipeline.serving.triton_models.preprocessing import PreprocessingModel  # noqa: E402
from pipeline.serving.triton_models.tokenization import load_tokenizer  # noqa: E402
from pipeline.serving.triton_models.triton_utils import ParameterError  # noqa: E402
from tests.serving_helpers import MULTIBYTE_PROMPT, tiny_config  # noqa: E402


def _repo(tiny_llama_dir: Path, engine_dir: Path, root: Path, decoupled: bool) -> Path:
    repo = root / ("decoupled" if decoupled else "unary")
    cfg = tiny_config(tiny_llama_dir, decoupled=decoupled)
    render_model_repository(cfg, engine_dir, repo)
    return repo


def _args(repo: Path, model: str, **parameters: str) -> dict[str, str]:
    """What Triton hands `initialize`: the config.pbtxt as JSON with proto field names."""
    config = parse_model_config(model, (repo / model / "config.pbtxt").read_text())
    data = json_format.MessageToDict(config, preserving_proto_field_name=True)
    for key, value in parameters.items():
        data.setdefault("parameters", {})[key] = {"string_value": value}
    return {
        "model_config": json.dumps(data),
        "model_name": model,
        "model_version": "1",
        "model_repository": str(repo / model),
    }


def _load(model_cls: type, repo: Path, name: str, **parameters: str) -> Any:
    model = model_cls()
    model.initialize(_args(repo, name, **parameters))
    return model


@pytest.fixture(scope="module")
def repos(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("serving-repos")
    return {d: _repo(tiny_llama_dir, tiny_engine_dir, root, d) for d in (True, False)}


@pytest.fixture(scope="module")
def engine_model(repos: dict[bool, Path]) -> Iterator[TorchEngineModel]:
    model = _load(TorchEngineModel, repos[True], "tensorrt_llm")
    yield model
    model.finalize()


@pytest.fixture(scope="module")
def reference(tiny_engine_dir: Path) -> LLMEngine:
    return LLMEngine.from_engine_dir(tiny_engine_dir)


def _engine_request(
    prompt: list[int], max_tokens: int, request_id: str = "", **extra: Any
) -> pb.InferenceRequest:
    inputs = {
        "input_ids": np.array([prompt], np.int32),
        "input_lengths": np.array([len(prompt)], np.int32),
        "request_output_len": np.array([max_tokens], np.int32),
    }
    inputs.update({k: np.asarray([v]) for k, v in extra.items()})
    return pb.make_request(inputs, request_id)


def _wait(sender: pb.ResponseSender, timeout: float = 30.0) -> list[dict[str, np.ndarray]]:
    assert sender.done.wait(timeout), "no final response"
    return [r.as_dict() for r in sender.responses()]


def _tokens(responses: list[dict[str, np.ndarray]]) -> list[int]:
    return [t for r in responses for t in r["output_ids"].reshape(-1).tolist()]


def _kv_used(model: TorchEngineModel) -> int:
    deadline = time.monotonic() + 5
    while model.engine.stats().num_kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.01)
    return model.engine.stats().num_kv_blocks_used


def test_streamed_and_whole_outputs_equal_the_engine(
    engine_model: TorchEngineModel, reference: LLMEngine
) -> None:
    prompt = [1, 57, 300, 12, 999, 4]
    expected = reference.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[
        0
    ].output_token_ids
    whole, streamed = _engine_request(prompt, 24), _engine_request(prompt, 24, streaming=True)
    engine_model.execute([whole, streamed])
    assert _tokens(_wait(whole.sender)) == prompt + expected  # upstream's default echoes the prompt
    chunks = _wait(streamed.sender)
    assert _tokens(chunks) == expected and len(chunks) > 1
    assert streamed.sender.sent[-1][1] == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert all(flags == 0 for _, flags in streamed.sender.sent[:-1])


def test_invalid_request_gets_an_invalid_argument_error(engine_model: TorchEngineModel) -> None:
    request = _engine_request([1, 2], 5000)
    engine_model.execute([request])
    assert request.sender.done.wait(5)
    response, flags = request.sender.sent[0]
    assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and response is not None and response.has_error()
    assert response.error().code() == pb.TritonError.INVALID_ARG
    assert (
        "request_output_len" in response.error().message()
        and "max_seq_len=1024" in response.error().message()
    )


def test_cancelled_and_stopped_requests_free_their_kv_blocks(engine_model: TorchEngineModel) -> None:
    cancelled = _engine_request([3, 4, 5], 900, streaming=True)
    stopped = _engine_request([6, 7, 8], 900, request_id="client-7", streaming=True)
    engine_model.execute([cancelled, stopped])
    cancelled.sender.cancel()
    stop = _engine_request([0], 1, request_id="client-7", stop=True)
    engine_model.execute([stop])
    for request in (cancelled, stopped, stop):
        assert request.sender.done.wait(10)
    assert len(_tokens(_wait(stopped.sender))) < 900 and len(_tokens(_wait(cancelled.sender))) < 900
    assert _kv_used(engine_model) == 0
    finished = {
        m.labels["finish_reason"]: m.value()
        for m in pb.MetricFamily.families["llmpipe_requests_finished_total"].metrics
    }
    assert finished["abort"] >= 2


def test_metrics_follow_the_engine(engine_model: TorchEngineModel) -> None:
    def series(name: str, le: str | None = None) -> float:
        family = pb.MetricFamily.families[name]
        assert family.kind == family.COUNTER
        (found,) = [m for m in family.metrics if le is None or m.labels["le"] == le]
        return found.value()

    latency_series = (
        ("llmpipe_time_to_first_token_seconds_count", None),
        ("llmpipe_time_to_first_token_seconds_bucket", "+Inf"),
        ("llmpipe_inter_token_latency_seconds_count", None),
        ("llmpipe_inter_token_latency_seconds_bucket", "+Inf"),
        ("llmpipe_inter_token_latency_seconds_sum", None),
    )
    time.sleep(
        0.3
    )  # earlier tests' latencies reach the families at the first stats period with nothing running
    before = [series(name, le) for name, le in latency_series]
    request = _engine_request([9, 10], 8)
    engine_model.execute([request])
    _wait(request.sender)
    time.sleep(0.3)  # one stats period
    kv = {
        m.labels["kv_cache_block_type"]: m.value()
        for m in pb.MetricFamily.families["nv_trt_llm_kv_cache_block_metrics"].metrics
    }
    assert kv["max"] == engine_model.engine.stats().num_kv_blocks_total and kv["tokens_per"] == 16
    assert kv["used"] == 0 and kv["free"] == kv["max"]
    # Flushed at the stats period after the engine went idle: 8 tokens, one TTFT and 7 gaps between them.
    added = [series(name, le) - old for (name, le), old in zip(latency_series, before, strict=True)]
    assert added[:4] == [1, 1, 7, 7]
    assert 0 < added[4] < 60


def test_counted_histogram_adds_cumulative_buckets_once_per_flush() -> None:
    histogram = CountedHistogram(pb, "h_seconds", "test", {"model": "m"}, (0.1, 1.0))
    buckets = {m.labels["le"]: m for m in pb.MetricFamily.families["h_seconds_bucket"].metrics}
    assert set(buckets) == {"0.1", "1.0", "+Inf"}
    for value in (0.05, 0.1, 0.5, 7.0):
        histogram.observe(value)
    assert all(m.value() == 0 for m in buckets.values())  # nothing reaches Triton before a flush
    histogram.flush()
    histogram.flush()  # a second flush adds nothing
    histogram.observe(0.2)
    histogram.flush()
    assert [buckets[le].value() for le in ("0.1", "1.0", "+Inf")] == [2, 4, 5]
    assert pb.MetricFamily.families["h_seconds_count"].metrics[0].value() == 5
    assert pb.MetricFamily.families["h_seconds_sum"].metrics[0].value() == pytest.approx(7.85)


def test_a_stream_interval_sends_the_stream_in_fewer_responses(
    tiny_llama_dir: Path, tiny_engine_dir: Path, tmp_path: Path, reference: LLMEngine
) -> None:
    prompt = [1, 57, 300, 12, 999, 4]
    expected = reference.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[
        0
    ].output_token_ids
    # The build config's serving.stream_interval, through the rendered config.pbtxt, to the engine.
    cfg = tiny_config(tiny_llama_dir, serving={"stream_interval": 3})
    render_model_repository(cfg, tiny_engine_dir, tmp_path / "repo")
    model = _load(TorchEngineModel, tmp_path / "repo", "tensorrt_llm")
    try:
        streamed = _engine_request(prompt, 24, streaming=True)
        model.execute([streamed])
        chunks = _wait(streamed.sender)
    finally:
        model.finalize()
    assert _tokens(chunks) == expected
    assert [r["output_ids"].size for r in chunks] == [1] + [3] * 7 + [2]


def test_non_decoupled_model_answers_once_and_refuses_streaming(repos: dict[bool, Path]) -> None:
    model = _load(TorchEngineModel, repos[False], "tensorrt_llm")
    try:
        whole, streamed = _engine_request([1, 2, 3], 6), _engine_request([1, 2, 3], 6, streaming=True)
        model.execute([whole, streamed])
        assert len(_wait(whole.sender)) == 1 and len(_tokens(_wait(whole.sender))) == 3 + 6
        assert (
            streamed.sender.done.wait(5) and "not decoupled" in streamed.sender.sent[0][0].error().message()
        )
    finally:
        model.finalize()


def test_finalize_answers_unfinished_requests(repos: dict[bool, Path]) -> None:
    model = _load(TorchEngineModel, repos[True], "tensorrt_llm")
    request = _engine_request([1, 2, 3], 900, streaming=True)
    model.execute([request])
    model.finalize()
    assert request.sender.done.wait(10)


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        ({"batch_scheduler_policy": "fifo"}, "batch_scheduler_policy='fifo' is invalid: choose one of"),
        (
            {"enable_kv_cache_reuse": "maybe"},
            "enable_kv_cache_reuse='maybe' is invalid: expected true or false",
        ),
        ({"gpt_model_path": "missing"}, "gpt_model_path="),
        ({"max_beam_width": "4"}, "max_beam_width='4' is invalid"),
        ({"stream_interval": "0"}, "stream_interval=0 is invalid: must be >= 1"),
        ({"kv_cache_free_gpu_mem_fraction": "1.5"}, "kv_cache_free_gpu_mem_fraction=1.5 is invalid"),
    ],
)
def test_bad_parameters_fail_at_load(repos: dict[bool, Path], parameters: dict, fragment: str) -> None:
    with pytest.raises(ParameterError, match="model 'tensorrt_llm'") as err:
        _load(TorchEngineModel, repos[True], "tensorrt_llm", **parameters)
    assert fragment in str(err.value)


# --- BLS, routed to the engine model in-process ---


@pytest.fixture
def bls(repos: dict[bool, Path], engine_model: TorchEngineModel) -> Iterator[tuple[BlsModel, list]]:
    issued: list[pb.InferenceRequest] = []

    def to_engine(request: pb.InferenceRequest, decoupled: bool) -> Any:
        issued.append(request)
        engine_request = pb.InferenceRequest(inputs=request.inputs.values(), request_id=request.request_id())
        engine_model.execute([engine_request])
        responses = [r for r, _ in engine_request.sender.sent] if engine_request.sender.done.wait(30) else []
        return iter(responses) if decoupled else responses[0]

    pb.route("tensorrt_llm", to_engine)
    yield _load(BlsModel, repos[True], "tensorrt_llm_bls"), issued


def _bls_request(prompt: str, max_tokens: int, **extra: Any) -> pb.InferenceRequest:
    inputs = {
        "text_input": np.array([[prompt.encode()]], dtype=object),
        "max_tokens": np.array([[max_tokens]]),
    }
    inputs.update({k: np.array([[v]]) for k, v in extra.items()})
    return pb.make_request(inputs)


def test_bls_stream_equals_whole_text_equals_engine(
    bls: tuple, tiny_engine_dir: Path, reference: LLMEngine
) -> None:
    model, _ = bls
    tokenizer = load_tokenizer(tiny_engine_dir / "tokenizer")
    prompt_ids = tokenizer.encode(MULTIBYTE_PROMPT)
    expected_ids = reference.generate([prompt_ids], SamplingParams(max_tokens=30, temperature=0.0))[0]
    expected = tokenizer.decode(expected_ids.output_token_ids, skip_special_tokens=True)
    whole, streamed = _bls_request(MULTIBYTE_PROMPT, 30), _bls_request(MULTIBYTE_PROMPT, 30, stream=True)
    model.execute([whole, streamed])
    texts = [r["text_output"].reshape(-1)[0].decode() for r in _wait(streamed.sender)]
    assert "".join(texts) == expected and len(texts) > 2
    # not streamed: the prompt echoed before the answer, as tensorrtllm_backend's BLS returns it
    echoed = tokenizer.decode(prompt_ids + expected_ids.output_token_ids, skip_special_tokens=True)
    assert [r["text_output"].reshape(-1)[0].decode() for r in _wait(whole.sender)] == [echoed]


def test_bls_reports_bad_input_and_stops_engine_when_cancelled(
    bls: tuple, engine_model: TorchEngineModel
) -> None:
    model, issued = bls
    bad = _bls_request("", 5)
    model.execute([bad])
    assert bad.sender.done.wait(5) and "text_input" in bad.sender.sent[0][0].error().message()
    request = _bls_request("hello", 900, stream=True)
    request.sender.cancel()
    model.execute([request])
    assert request.sender.done.wait(30)
    assert any("stop" in r.inputs for r in issued)
    assert _kv_used(engine_model) == 0


def test_ensemble_model_answers_each_row_and_only_its_declared_outputs(
    bls: tuple, tiny_llama_dir: Path, tiny_engine_dir: Path, reference: LLMEngine, tmp_path: Path
) -> None:
    """serving.ensemble=bls: the `ensemble` model is this code with the ensemble's tensors. A request of two
    rows is two sequences, each streamed with its batch_index; the final flag comes once, after both; the
    BLS's extension output_ids is not sent where the model does not declare it."""
    cfg = tiny_config(tiny_llama_dir, serving={"ensemble": "bls"})
    render_model_repository(cfg, tiny_engine_dir, tmp_path / "repo")
    model = _load(BlsModel, tmp_path / "repo", "ensemble")
    assert "output_ids" not in model.declared_outputs
    tokenizer = load_tokenizer(tiny_engine_dir / "tokenizer")
    prompts = ["The quick brown fox", MULTIBYTE_PROMPT]
    lengths = [12, 20]
    done = reference.generate(
        [tokenizer.encode(p) for p in prompts],
        [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths],
    )
    expected = [tokenizer.decode(d.output_token_ids, skip_special_tokens=True) for d in done]
    request = pb.make_request(
        {
            "text_input": np.array([[p.encode()] for p in prompts], dtype=object),
            "max_tokens": np.array([[n] for n in lengths], np.int32),
            "stream": np.array([[True], [True]]),
            "return_log_probs": np.array([[True], [True]]),
        }
    )
    model.execute([request])
    responses = _wait(request.sender)
    finals = [flags for _, flags in request.sender.sent if flags & pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL]
    assert len(finals) == 1
    texts = {0: "", 1: ""}
    for response in responses:
        assert "output_ids" not in response and "output_log_probs" in response
        texts[int(response["batch_index"].reshape(-1)[0])] += response["text_output"].reshape(-1)[0].decode()
    assert [texts[0], texts[1]] == expected


def test_models_send_only_the_outputs_a_request_asked_for(
    repos: dict[bool, Path], bls: tuple, engine_model: TorchEngineModel
) -> None:
    """What Triton 2.51's stub would otherwise drop itself, freeing the arrays without the GIL."""
    model, _ = bls

    def asking_for(names: list[str], inputs: dict[str, np.ndarray]) -> pb.InferenceRequest:
        tensors = [pb.Tensor(k, v) for k, v in inputs.items()]
        return pb.InferenceRequest(inputs=tensors, requested_output_names=names)

    engine_request = asking_for(
        ["output_ids"],
        {
            "input_ids": np.array([[1, 57, 300]], np.int32),
            "input_lengths": np.array([[3]], np.int32),
            "request_output_len": np.array([[8]], np.int32),
            "streaming": np.array([[True]]),
            "return_log_probs": np.array([[True]]),
        },
    )
    bls_request = asking_for(
        ["text_output"],
        {
            "text_input": np.array([[b"hello"]], dtype=object),
            "max_tokens": np.array([[8]], np.int32),
            "stream": np.array([[True]]),
            "return_log_probs": np.array([[True]]),
        },
    )
    engine_model.execute([engine_request])
    model.execute([bls_request])
    assert {name for r in _wait(engine_request.sender) for name in r} == {"output_ids"}
    assert {name for r in _wait(bls_request.sender) for name in r} == {"text_output"}


def test_pre_and_postprocessing_models_round_trip(repos: dict[bool, Path], tiny_engine_dir: Path) -> None:
    pre, post = (
        _load(PreprocessingModel, repos[True], "preprocessing"),
        _load(PostprocessingModel, repos[True], "postprocessing"),
    )
    request = pb.make_request(
        {
            "QUERY": np.array([[MULTIBYTE_PROMPT.encode()]], dtype=object),
            "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32),
        }
    )
    ids = pre.execute([request])[0].as_dict()
    tokens = ids["INPUT_ID"][:, None, :]
    text = post.execute(
        [pb.make_request({"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": ids["REQUEST_INPUT_LEN"]})]
    )
    assert text[0].as_dict()["OUTPUT"].reshape(-1)[0].decode() == MULTIBYTE_PROMPT  # BOS is a special token
    missing = pre.execute([pb.make_request({"QUERY": np.array([[b"x"]], dtype=object)})])[0]
    assert missing.has_error() and "max_tokens" in missing.error().message()
