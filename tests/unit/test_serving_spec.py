"""Speculative decoding through the Triton models, in-process with tests/stub_pb_utils.py: the torch engine
model built with a draft model returns TensorRT-LLM's acceptance outputs when a request sets
return_perf_metrics (and the same tokens as without speculation), counts them in its metrics, refuses
external draft tokens, and the BLS passes the outputs on. Plus the trtllm draft-target repository.

The draft model is the tiny model itself (a self-draft): the random tiny model seldom copies its prompt, so
prompt lookup would rarely get a draft accepted, while a self-draft's greedy drafts always are."""

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

from pipeline.errors import MissingArtifactError  # noqa: E402
from pipeline.runtime.core.sampling_params import SamplingParams  # noqa: E402
from pipeline.runtime.engine.engine_args import EngineArgs, SpeculationArgs  # noqa: E402
from pipeline.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from pipeline.serving.repository.pbtxt import parse_model_config  # noqa: E402
from pipeline.serving.repository.render import DRAFT_MODEL, render_model_repository  # noqa: E402
from pipeline.serving.triton_models.bls import BlsModel  # noqa: E402
from pipeline.serving.triton_models.engine_model import TorchEngineModel  # noqa: E402
from pipeline.serving.triton_models.io import SPEC_OUTPUTS  # noqa: E402
from tests.serving_helpers import build_tiny_engine, tiny_config  # noqa: E402

SELF_DRAFT = {"mode": "draft_model", "max_draft_len": 3, "draft_config": "draft.yaml"}
PROMPT = [5, 6, 7, 8, 9] * 6


@pytest.fixture(scope="module")
def repo(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("spec-serving")
    (root / "draft.yaml").write_text(f"name: tiny-draft\nsource: {{kind: local, path: {tiny_llama_dir}}}\n")
    build_tiny_engine(tiny_llama_dir, root / "build" / "tiny-draft")  # where draft.yaml's engine lands
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)  # speculative.draft_config is read from the current directory
        engine = build_tiny_engine(tiny_llama_dir, root / "target", speculative=SELF_DRAFT)
    out = root / "model_repo"
    cfg = tiny_config(tiny_llama_dir, speculative=SELF_DRAFT)
    render_model_repository(cfg, engine, out)
    yield out


def _args(repo: Path, model: str) -> dict[str, str]:
    config = parse_model_config(model, (repo / model / "config.pbtxt").read_text())
    return {
        "model_config": json.dumps(json_format.MessageToDict(config, preserving_proto_field_name=True)),
        "model_name": model,
        "model_version": "1",
        "model_repository": str(repo / model),
    }


@pytest.fixture(scope="module")
def engine_model(repo: Path) -> Iterator[TorchEngineModel]:
    model = TorchEngineModel()
    model.initialize(_args(repo, "tensorrt_llm"))
    assert model.engine.engine.proposer is not None  # the build's speculation is on
    yield model
    model.finalize()


def _request(prompt: list[int], max_tokens: int, **extra: Any) -> pb.InferenceRequest:
    inputs = {
        "input_ids": np.array([prompt], np.int32),
        "input_lengths": np.array([len(prompt)], np.int32),
        "request_output_len": np.array([max_tokens], np.int32),
    }
    inputs.update({k: np.asarray([v]) for k, v in extra.items()})
    return pb.make_request(inputs)


def _wait(sender: pb.ResponseSender) -> list[dict[str, np.ndarray]]:
    assert sender.done.wait(60), "no final response"
    return [r.as_dict() for r in sender.responses()]


def _stats(response: dict[str, np.ndarray]) -> tuple[float, int, int]:
    return (
        response["acceptance_rate"].item(),
        response["total_accepted_draft_tokens"].item(),
        response["total_draft_tokens"].item(),
    )


def test_acceptance_outputs_come_with_the_tokens_of_plain_decoding(
    engine_model: TorchEngineModel, repo: Path
) -> None:
    plain = LLMEngine.from_engine_dir(
        repo / "tensorrt_llm" / "1" / "engine", EngineArgs(speculation=SpeculationArgs(mode="none"))
    )
    expected = plain.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0.0))[0].output_token_ids
    whole = _request(PROMPT, 40, return_perf_metrics=True, exclude_input_in_output=True)
    streamed = _request(PROMPT, 40, return_perf_metrics=True, streaming=True)
    silent = _request(PROMPT, 40, streaming=True)
    before = engine_model.metrics.spec_tokens["draft"].value()
    engine_model.execute([whole, streamed, silent])
    whole_out, streamed_out, silent_out = (_wait(r.sender) for r in (whole, streamed, silent))

    assert whole_out[0]["output_ids"].reshape(-1).tolist() == expected
    assert [t for r in streamed_out for t in r["output_ids"].reshape(-1).tolist()] == expected
    rate, accepted, drafted = _stats(whole_out[0])
    assert drafted > 0 and 0 < accepted <= drafted and rate == pytest.approx(accepted / drafted)
    assert all(k not in r for r in streamed_out[:-1] for k in SPEC_OUTPUTS)  # only the final response
    stream_rate, stream_accepted, stream_drafted = _stats(streamed_out[-1])
    assert 0 <= stream_accepted <= stream_drafted and 0.0 <= stream_rate <= 1.0
    assert not any(k in r for r in silent_out for k in SPEC_OUTPUTS)  # not asked for
    # Every finished request is counted on the metrics endpoint, asked or not.
    counted = engine_model.metrics.spec_tokens["draft"].value() - before
    assert counted >= drafted + stream_drafted
    assert engine_model.metrics.spec_steps.value() > 0
    assert 0 < engine_model.metrics.spec_rate.value() <= 1


def test_external_draft_tokens_are_refused_naming_the_input(engine_model: TorchEngineModel) -> None:
    drafted = _request(PROMPT, 4, draft_input_ids=np.array([5, 6], np.int32))
    threshold = _request(PROMPT, 4, draft_acceptance_threshold=np.float32(0.5))
    empty = _request(PROMPT, 4, draft_input_ids=np.zeros(0, np.int32))
    engine_model.execute([drafted, threshold, empty])
    for request, name in ((drafted, "draft_input_ids"), (threshold, "draft_acceptance_threshold")):
        assert request.sender.done.wait(10)
        error = request.sender.sent[0][0].error()
        assert error.code() == pb.TritonError.INVALID_ARG
        assert f"input '{name}'" in error.message() and "backend trtllm" in error.message()
    assert _wait(empty.sender)[0]["output_ids"].size == len(PROMPT) + 4  # "no drafts" is a plain request


def test_bls_passes_the_acceptance_outputs_on(repo: Path, engine_model: TorchEngineModel) -> None:
    def to_engine(request: pb.InferenceRequest, decoupled: bool) -> Any:
        engine_request = pb.InferenceRequest(inputs=request.inputs.values(), request_id=request.request_id())
        engine_model.execute([engine_request])
        assert engine_request.sender.done.wait(60)
        return iter([r for r, _ in engine_request.sender.sent])

    pb.route("tensorrt_llm", to_engine)
    bls = BlsModel()
    bls.initialize(_args(repo, "tensorrt_llm_bls"))
    assert bls.draft_model == "" and bls.num_draft_tokens == 0  # the torch engine drafts for itself
    text = {
        "text_input": np.array([[b"a b c a b c a b c a b c"]], dtype=object),
        "max_tokens": np.array([[24]]),
    }
    for stream in (False, True):
        request = pb.make_request(
            {**text, "stream": np.array([[stream]]), "return_perf_metrics": np.array([[True]])}
        )
        bls.execute([request])
        final = _wait(request.sender)[-1]
        rate, accepted, drafted = _stats(final)
        assert 0 <= accepted <= drafted and 0.0 <= rate <= 1.0


def test_trtllm_draft_target_repository_serves_the_draft_engine(
    tiny_llama_dir: Path, in_tmp_workdir: Path
) -> None:
    engine = in_tmp_workdir / "target-engine"
    (engine / "tokenizer").mkdir(parents=True)
    (engine / "config.json").write_text("{}")
    draft_yaml = in_tmp_workdir / "draft.yaml"
    draft_yaml.write_text(
        f"name: tiny-draft\nbackend: trtllm\nsource: {{kind: local, path: {tiny_llama_dir}}}\n"
    )
    spec = {"mode": "draft_model", "max_draft_len": 5, "draft_config": "draft.yaml"}
    cfg = tiny_config(
        tiny_llama_dir, backend="trtllm", speculative=spec, kv_cache={"enable_block_reuse": True}
    )
    with pytest.raises(
        MissingArtifactError, match=r"speculative.draft_config=draft.yaml has no engine at .*tiny-draft"
    ):
        render_model_repository(cfg, engine, in_tmp_workdir / "repo")
    draft_engine = in_tmp_workdir / "build" / "tiny-draft" / "engine"
    draft_engine.mkdir(parents=True)
    (draft_engine / "config.json").write_text("{}")
    facts = render_model_repository(cfg, engine, in_tmp_workdir / "repo")
    assert DRAFT_MODEL in facts["models"] and facts["draft_engine"] == str(draft_engine.resolve())
    draft = parse_model_config(
        DRAFT_MODEL, (in_tmp_workdir / "repo" / DRAFT_MODEL / "config.pbtxt").read_text()
    )
    assert (
        draft.backend == "tensorrtllm"
        and not (in_tmp_workdir / "repo" / DRAFT_MODEL / "1" / "model.py").exists()
    )
    assert draft.parameters["gpt_model_path"].string_value == str(draft_engine.resolve())
    bls = parse_model_config(
        "tensorrt_llm_bls", (in_tmp_workdir / "repo" / "tensorrt_llm_bls" / "config.pbtxt").read_text()
    )
    assert bls.parameters["tensorrt_llm_draft_model_name"].string_value == DRAFT_MODEL
    assert bls.parameters["num_draft_tokens"].string_value == "5"
