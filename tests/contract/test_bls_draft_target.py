"""The BLS's draft-target loop (backend trtllm, speculative.mode=draft_model) against stand-in draft and
target models that record every call (no TensorRT-LLM here): the calls follow TensorRT-LLM's external-draft
contract (draft: the sequence so far and num_draft_tokens to generate; target: the same sequence, the
drafts as draft_input_ids, drafts + 1 to generate), the text equals the target's own greedy continuation,
and the acceptance outputs count what the target accepted. The BLS is the one rendered for a draft-target
build config (its parameters name the draft model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import json_format

from tests import stub_pb_utils as pb

pb.install()

from pipeline.serving.repository.pbtxt import parse_model_config  # noqa: E402
from pipeline.serving.repository.render import DRAFT_MODEL, DraftEngine, render_configs, templates_dir  # noqa: E402
from pipeline.serving.triton_models.bls import BlsModel  # noqa: E402
from tests.serving_helpers import tiny_config  # noqa: E402

MAX_DRAFT_LEN = 3


def target_next(sequence: list[int]) -> int:
    """The target model's greedy token after `sequence`: ordinary (non-special) ids of the tiny vocabulary."""
    return 100 + (sequence[-1] * 31 + 7) % 500


class StandInEngines:
    """Draft and target models behind BLS calls. The draft agrees with the target except at every third
    token it drafts; the target accepts drafts while they equal its own tokens, then adds its own token,
    and stops at the end id, like TensorRT-LLM with external draft tokens."""

    def __init__(self, end_after: int | None = None) -> None:
        self.calls: list[tuple[str, dict[str, np.ndarray]]] = []
        self.num_drafted = 0
        self.end_after = end_after  # the target emits the end id as its token number `end_after`
        self.end_id = 2
        self.prompt_len = 0
        self.on_target_call: Any = None

    @staticmethod
    def _value(inputs: dict[str, np.ndarray], name: str) -> Any:
        return np.asarray(inputs[name]).reshape(-1)[0].item()

    def _target_token(self, sequence: list[int]) -> int:
        if self.end_after is not None and len(sequence) - self.prompt_len == self.end_after:
            return self.end_id
        return target_next(sequence)

    def draft(self, request: pb.InferenceRequest, decoupled: bool) -> Any:
        inputs = {k: t.as_numpy() for k, t in request.inputs.items()}
        self.calls.append((request.model_name, inputs))
        sequence = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
        tokens: list[int] = []
        for _ in range(self._value(inputs, "request_output_len")):
            token = target_next(sequence + tokens)
            self.num_drafted += 1
            tokens.append(token + 1 if self.num_drafted % 3 == 0 else token)
        return self._respond(tokens, decoupled)

    def target(self, request: pb.InferenceRequest, decoupled: bool) -> Any:
        inputs = {k: t.as_numpy() for k, t in request.inputs.items()}
        self.calls.append((request.model_name, inputs))
        if self.on_target_call is not None:
            self.on_target_call(len([c for c in self.calls if c[0] == "tensorrt_llm"]))
        sequence = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
        drafts = (
            np.asarray(inputs["draft_input_ids"]).reshape(-1).tolist() if "draft_input_ids" in inputs else []
        )
        tokens: list[int] = []
        for index in range(self._value(inputs, "request_output_len")):
            token = self._target_token(sequence + tokens)
            tokens.append(token)
            if token == self.end_id or index >= len(drafts) or drafts[index] != token:
                break
        return self._respond(tokens, decoupled)

    @staticmethod
    def _respond(tokens: list[int], decoupled: bool) -> Any:
        response = pb.InferenceResponse(
            [
                pb.Tensor("output_ids", np.array(tokens, np.int32).reshape(1, 1, -1)),
                pb.Tensor("sequence_length", np.array([[len(tokens)]], np.int32)),
                pb.Tensor("output_log_probs", np.full((1, 1, len(tokens)), -0.5, np.float32)),
            ]
        )
        return iter([response]) if decoupled else response


def _bls_args(tiny_llama_dir: Path, *, drafting: bool) -> dict[str, str]:
    trtllm = tiny_config(tiny_llama_dir, backend="trtllm")
    spec = {"mode": "draft_model", "max_draft_len": MAX_DRAFT_LEN, "draft_config": "draft.yaml"}
    reuse = {"enable_block_reuse": True}  # TensorRT-LLM's draft-target flow needs it
    cfg = (
        tiny_config(tiny_llama_dir, backend="trtllm", speculative=spec, kv_cache=reuse)
        if drafting
        else trtllm
    )
    draft = DraftEngine(trtllm, Path("draft-engine"))
    text = render_configs(cfg, templates_dir(), Path("engine"), draft if drafting else None)[
        "tensorrt_llm_bls"
    ]
    data = json_format.MessageToDict(
        parse_model_config("tensorrt_llm_bls", text), preserving_proto_field_name=True
    )
    data["parameters"]["tokenizer_dir"] = {"string_value": str(tiny_llama_dir)}
    return {
        "model_config": json.dumps(data),
        "model_name": "tensorrt_llm_bls",
        "model_version": "1",
        "model_repository": str(tiny_llama_dir),
    }


@pytest.fixture
def engines() -> Iterator[StandInEngines]:
    stand_in = StandInEngines()
    pb.route(DRAFT_MODEL, stand_in.draft)
    pb.route("tensorrt_llm", stand_in.target)
    yield stand_in


@pytest.fixture
def bls(tiny_llama_dir: Path, engines: StandInEngines) -> BlsModel:
    model = BlsModel()
    model.initialize(_bls_args(tiny_llama_dir, drafting=True))
    assert (model.draft_model, model.num_draft_tokens) == (DRAFT_MODEL, MAX_DRAFT_LEN)
    engines.prompt_len = len(model.encoder.encode_prompt(PROMPT))
    return model


PROMPT = "def add(a, b):"


def _request(max_tokens: int, **extra: Any) -> pb.InferenceRequest:
    inputs = {
        "text_input": np.array([[PROMPT.encode()]], dtype=object),
        "max_tokens": np.array([[max_tokens]]),
        "exclude_input_in_output": np.array([[True]]),  # the texts compared are the generated ones
    }
    inputs.update({k: np.array([[v]]) for k, v in extra.items()})
    return pb.make_request(inputs)


def _run(model: BlsModel, request: pb.InferenceRequest) -> list[dict[str, np.ndarray]]:
    model.execute([request])
    assert request.sender.done.wait(30), "no final response"
    return [r.as_dict() for r in request.sender.responses()]


def _greedy(prompt_ids: list[int], count: int) -> list[int]:
    tokens: list[int] = []
    for _ in range(count):
        tokens.append(target_next(prompt_ids + tokens))
    return tokens


def _text(responses: list[dict[str, np.ndarray]]) -> str:
    return "".join(r["text_output"].reshape(-1)[0].decode() for r in responses)


def test_rounds_follow_the_external_draft_contract_and_text_is_the_targets(
    bls: BlsModel, engines: StandInEngines
) -> None:
    prompt_ids = bls.encoder.encode_prompt(PROMPT)
    responses = _run(bls, _request(20, return_perf_metrics=True, return_log_probs=True))
    expected = _greedy(prompt_ids, 20)
    assert _text(responses) == bls.encoder.tokenizer.decode(expected, skip_special_tokens=True)

    generated: list[int] = []
    num_drafts = num_accepted = 0
    calls = list(engines.calls)
    assert [name for name, _ in calls[:2]] == [DRAFT_MODEL, "tensorrt_llm"]
    while calls:
        (draft_name, draft_in), (target_name, target_in) = calls[0], calls[1]
        if draft_name != DRAFT_MODEL:  # the last round may have no room left to draft
            (target_name, target_in), calls = calls[0], calls[1:]
            drafts: list[int] = []
        else:
            calls = calls[2:]
            remaining = 20 - len(generated)
            assert draft_in["request_output_len"].item() == min(MAX_DRAFT_LEN, remaining - 1)
            assert draft_in["input_ids"].reshape(-1).tolist() == prompt_ids + generated
            drafts = target_in["draft_input_ids"].reshape(-1).tolist()
            assert len(drafts) == draft_in["request_output_len"].item()
        assert target_name == "tensorrt_llm"
        assert target_in["input_ids"].reshape(-1).tolist() == prompt_ids + generated
        assert target_in["request_output_len"].item() == len(drafts) + 1
        for inputs in (draft_in, target_in):
            assert inputs["exclude_input_in_output"].item() and not inputs["streaming"].item()
            assert "return_perf_metrics" not in inputs and "stop_words_list" in inputs
        new = expected[len(generated) :][: len(drafts) + 1]
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, new, strict=False)) if d != t), len(drafts))
        new = new[: accepted + 1]
        num_drafts, num_accepted = num_drafts + len(drafts), num_accepted + accepted
        generated += new
    assert generated == expected
    final = responses[-1]
    assert final["total_draft_tokens"].item() == num_drafts > 0
    assert final["total_accepted_draft_tokens"].item() == num_accepted
    assert 0 < num_accepted < num_drafts  # the stand-in draft errs at every third token
    assert final["acceptance_rate"].item() == pytest.approx(num_accepted / num_drafts)
    # the target's log-probs of its 20 tokens, summed over the rounds
    assert final["output_log_probs"].reshape(-1).tolist() == [-0.5] * 20
    assert final["cum_log_probs"].item() == pytest.approx(-10.0)


def test_streaming_sends_each_rounds_text_and_no_stats_unless_asked(
    bls: BlsModel, engines: StandInEngines
) -> None:
    whole = _text(_run(bls, _request(16)))
    streamed = _run(bls, _request(16, stream=True))
    assert _text(streamed) == whole and len(streamed) > 2
    assert not any("acceptance_rate" in r for r in streamed)


def test_the_target_ending_early_ends_the_loop(bls: BlsModel, engines: StandInEngines) -> None:
    engines.end_after = 5  # the target's sixth token is the end id
    responses = _run(bls, _request(40))
    expected = _greedy(bls.encoder.encode_prompt(PROMPT), 5)
    assert _text(responses) == bls.encoder.tokenizer.decode(expected, skip_special_tokens=True)
    assert len([c for c in engines.calls if c[0] == "tensorrt_llm"]) <= 3  # nothing after the end id


def test_num_draft_tokens_zero_is_one_plain_engine_request(bls: BlsModel, engines: StandInEngines) -> None:
    responses = _run(bls, _request(8, num_draft_tokens=0))
    assert [name for name, _ in engines.calls] == ["tensorrt_llm"]
    assert "draft_input_ids" not in engines.calls[0][1] and _text(responses)


def test_cancelled_client_ends_between_rounds(bls: BlsModel, engines: StandInEngines) -> None:
    request = _request(60)
    engines.on_target_call = lambda count: request.sender.cancel() if count == 2 else None
    bls.execute([request])
    assert request.sender.done.wait(30)
    assert len([c for c in engines.calls if c[0] == "tensorrt_llm"]) == 2


def test_engine_errors_and_misuse_reach_the_client(
    tiny_llama_dir: Path, bls: BlsModel, engines: StandInEngines
) -> None:
    pb.route(
        DRAFT_MODEL, lambda request, decoupled: iter([pb.InferenceResponse(error=pb.TritonError("boom"))])
    )
    assert request_error(bls, _request(8)) == f"{DRAFT_MODEL}: boom"
    assert "num_draft_tokens" in request_error(bls, _request(8, num_draft_tokens=-1))

    plain = BlsModel()
    plain.initialize(_bls_args(tiny_llama_dir, drafting=False))
    message = request_error(plain, _request(8, num_draft_tokens=2))
    assert "has no draft model" in message and "tensorrt_llm_draft_model_name" in message


def request_error(model: BlsModel, request: pb.InferenceRequest) -> str:
    model.execute([request])
    assert request.sender.done.wait(30)
    response = request.sender.sent[-1][0]
    assert response is not None and response.has_error()
    return response.error().message()
