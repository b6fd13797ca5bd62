"""The OpenAI-compatible front-end (pipeline/serving/openai) in-process, in front of a REAL tritonserver serving
the tiny model, driven by the official `openai` SDK: texts equal the in-process engine's greedy output for the
same prompt ids, usage counts, stop strings, seeds, errors in OpenAI's shape, and a streaming client that goes
away frees the engine's KV blocks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.engine.llm_engine import LLMEngine
from pipeline.serving.openai import BackgroundFrontEnd, OpenAIServerOptions
from pipeline.serving.server.launcher import TritonServer, free_port
from pipeline.serving.triton_models.tokenization import PromptEncoder
from tests.serving_helpers import metric, scrape_metrics

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.triton
PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about foxes"}]
MAX_TOKENS = 20
API_KEY = "test-key"


@pytest.fixture(scope="module")
def front(tiny_server: TritonServer) -> Iterator[BackgroundFrontEnd]:
    options = OpenAIServerOptions(
        tiny_server.options.model_repository, tiny_server.grpc_url, port=free_port(), api_key=API_KEY
    )
    with BackgroundFrontEnd(options) as front:
        yield front


@pytest.fixture(scope="module")
def model(front: BackgroundFrontEnd) -> str:
    return _model_id(front)


def _model_id(front: BackgroundFrontEnd) -> str:
    return client(front).models.list().data[0].id


def client(front: BackgroundFrontEnd, api_key: str = API_KEY) -> Any:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def encoder(tiny_engine_dir: Path) -> PromptEncoder:
    return PromptEncoder.from_dir(tiny_engine_dir / "tokenizer")


@pytest.fixture(scope="module")
def greedy(tiny_engine_dir: Path, encoder: PromptEncoder) -> dict[str, tuple[list[int], str, int]]:
    """'completion' / 'chat' -> (prompt ids, the engine's greedy text, tokens generated)."""
    # The template writes BOS itself: these ids are what a chat model was trained on.
    chat_text = encoder.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    chat_ids = list(encoder.tokenizer.encode(chat_text, add_special_tokens=False))
    prompts = {"completion": encoder.encode_prompt(PROMPT), "chat": chat_ids}
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, end_id=encoder.end_id) for _ in prompts]
    done = engine.generate(list(prompts.values()), params)
    return {
        key: (
            ids,
            encoder.tokenizer.decode(r.output_token_ids, skip_special_tokens=True),
            len(r.output_token_ids),
        )
        for (key, ids), r in zip(prompts.items(), done, strict=True)
    }


def test_models_list_and_health(front: BackgroundFrontEnd, model: str) -> None:
    import urllib.request

    assert [m.id for m in client(front).models.list().data] == [model]
    with urllib.request.urlopen(f"{front.url}/health", timeout=10) as reply:
        assert reply.status == 200


def test_completions_equal_the_engine(front: BackgroundFrontEnd, model: str, greedy: dict) -> None:
    ids, text, generated = greedy["completion"]
    reply = client(front).completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].text == text
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == generated
    assert reply.choices[0].finish_reason == ("length" if generated == MAX_TOKENS else "stop")
    stream = client(front).completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == generated and chunks[-1].usage.prompt_tokens == len(ids)


def test_chat_equals_the_engine(front: BackgroundFrontEnd, model: str, greedy: dict) -> None:
    ids, text, generated = greedy["chat"]
    reply = client(front).chat.completions.create(
        model=model, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.choices[0].message.content == text and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == generated
    stream = client(front).chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.total_tokens == len(ids) + generated


def test_max_tokens_stop_strings_and_seeds(front: BackgroundFrontEnd, model: str, greedy: dict) -> None:
    _, text, _ = greedy["completion"]
    short = client(front).completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    stop = text.strip()[3:6]
    assert stop and stop in text
    for stream in (False, True):
        reply = client(front).completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop], stream=stream
        )
        got = "".join(c.choices[0].text for c in reply if c.choices) if stream else reply.choices[0].text
        assert got == text[: text.index(stop)]
    sampled = [
        client(front).completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed
        ).choices[0].text
        for seed in (7, 7, 8)
    ]  # fmt: skip
    assert sampled[0] == sampled[1]
    # min_tokens (an extension): the end id is banned until then, so the whole budget is generated
    forced = client(front).completions.create(
        model=model, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"min_tokens": 40}
    )
    assert forced.usage.completion_tokens == 40 and forced.choices[0].finish_reason == "length"


def test_errors_are_openai_errors_and_the_server_stays_healthy(front: BackgroundFrontEnd, model: str) -> None:
    import httpx

    api = client(front)
    with pytest.raises(openai.NotFoundError) as err:
        api.completions.create(model="no-such-model", prompt="hi")
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="n=1 only"):
        api.completions.create(model=model, prompt="hi", n=2)
    with pytest.raises(openai.BadRequestError, match="'tools' is not supported"):
        api.chat.completions.create(
            model=model, messages=CHAT, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=model, prompt="hi", temperature="hot")  # type: ignore[arg-type]
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=model, prompt="hi", extra_body={"bogus": 1})
    assert err.value.body["param"] == "bogus"
    with pytest.raises(openai.APIStatusError) as err:
        api.completions.create(model=model, prompt="word " * 400)
    assert err.value.status_code == 413 and "256" in err.value.message
    with pytest.raises(openai.AuthenticationError):
        client(front, api_key="wrong").models.list()
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    bad_json = httpx.post(f"{front.url}/v1/completions", content=b"{nope", headers=headers)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    unknown = httpx.get(f"{front.url}/v1/nothing", headers=headers)
    assert unknown.status_code == 404 and "error" in unknown.json()
    deep = httpx.post(f"{front.url}/v1/completions", content=b"[" * 100_000, headers=headers)
    assert deep.status_code == 400 and deep.json()["error"]["code"] == "invalid_json"
    # a lone surrogate, which JSON can carry as an escape, in a prompt, a message and a stop string
    for field, body in (
        ("prompt", b'{"model": "%s", "prompt": "a\\ud800b"}'),
        ("messages", b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("stop", b'{"model": "%s", "prompt": "hi", "stop": "\\udfff"}'),
    ):
        route = "chat/completions" if field == "messages" else "completions"
        reply = httpx.post(f"{front.url}/v1/{route}", content=body % model.encode(), headers=headers)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=model, prompt="hi", stream_options={"include_usage": True})
    assert err.value.body["param"] == "stream_options"
    nulls = api.completions.create(
        model=model, prompt="still", max_tokens=2, extra_body={"n": None, "stream": None}
    )
    assert nulls.usage is not None and nulls.usage.completion_tokens == 2


def test_a_streaming_client_that_leaves_frees_the_kv_blocks(
    front: BackgroundFrontEnd, model: str, tiny_server: TritonServer
) -> None:
    def used_blocks() -> float:
        values = scrape_metrics(tiny_server.metrics_url)
        return metric(values, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used")

    stream = client(front).completions.create(
        model=model, prompt="Tell me a long story", max_tokens=900, temperature=0, stream=True
    )
    for seen, _ in enumerate(stream, start=1):
        if seen >= 3 and used_blocks() > 0:
            break
    assert used_blocks() > 0
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while used_blocks() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert used_blocks() == 0
