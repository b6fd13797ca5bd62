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


# --- log-probs and echo ---


@pytest.fixture(scope="module")
def scored(
    tiny_engine_dir: Path, encoder: PromptEncoder, greedy: dict
) -> dict[str, tuple[list[int], list[float]]]:
    """'completion' / 'chat' -> the engine's greedy output ids and their log-probs."""
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, end_id=encoder.end_id, logprobs=True)
    done = engine.generate([greedy[key][0] for key in ("completion", "chat")], params)
    return {
        key: (r.output_token_ids, r.output_logprobs)
        for key, r in zip(("completion", "chat"), done, strict=True)
    }


@pytest.fixture(scope="module")
def hf_log_softmax(tiny_llama_dir: Path) -> Any:
    """ids -> Hugging Face's log-probs at every position ([len, vocab]; row i predicts token i + 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> Any:
        with torch.inference_mode():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()

    return run


LOGPROB_TOLERANCE = 1e-4


def test_completion_logprobs_equal_the_engine(front: BackgroundFrontEnd, model: str, scored: dict) -> None:
    ids, expected = scored["completion"]
    api = client(front)
    reply = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=3
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(ids) == reply.usage.completion_tokens
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs, expected, strict=True)) < LOGPROB_TOLERANCE
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and max(top.values()) == value and top[token] == value  # greedy: the best
    assert lp.text_offset[0] == len(PROMPT) and lp.text_offset == sorted(lp.text_offset)
    # streamed: the same tokens and values, spread over the chunks; no alternatives without logprobs > 0
    stream = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0, stream=True
    )
    chunks = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    streamed = [v for c in chunks for v in c.token_logprobs]
    assert max(abs(a - b) for a, b in zip(streamed, expected, strict=True)) < LOGPROB_TOLERANCE
    assert all(top == {} for c in chunks for top in c.top_logprobs)


def test_chat_logprobs_equal_the_engine(front: BackgroundFrontEnd, model: str, scored: dict) -> None:
    ids, expected = scored["chat"]
    api = client(front)
    for stream in (False, True):
        reply = api.chat.completions.create(
            model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=2,
            stream=stream,
        )  # fmt: skip
        if stream:
            content = [
                e for c in reply if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
            ]
        else:
            content = reply.choices[0].logprobs.content
        assert len(content) == len(ids)
        assert max(abs(e.logprob - v) for e, v in zip(content, expected, strict=True)) < LOGPROB_TOLERANCE
        for entry in content:
            assert [t.logprob for t in entry.top_logprobs] == sorted(
                (t.logprob for t in entry.top_logprobs), reverse=True
            )
            assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
            assert bytes(entry.bytes).decode("utf-8") == entry.token
    plain = api.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_scores_the_prompt_like_hf(
    front: BackgroundFrontEnd, model: str, greedy: dict, encoder: PromptEncoder, hf_log_softmax: Any
) -> None:
    ids, text, _ = greedy["completion"]
    reference = hf_log_softmax(ids)
    expected = [float(reference[i - 1, t]) for i, t in enumerate(ids) if i]
    api = client(front)
    for prompt in (PROMPT, ids):
        for max_tokens in (0, 1):
            reply = api.completions.create(
                model=model, prompt=prompt, echo=True, max_tokens=max_tokens, logprobs=1, temperature=0
            )
            choice = reply.choices[0]
            lp = choice.logprobs
            assert len(lp.tokens) == len(ids) + max_tokens and lp.token_logprobs[0] is None
            got = lp.token_logprobs[1 : len(ids)]
            assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < LOGPROB_TOLERANCE
            assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == max_tokens
            shown = PROMPT if isinstance(prompt, str) else encoder.tokenizer.decode(ids)
            assert choice.text.startswith(shown) and (max_tokens or choice.text == shown)
    # streamed: the prompt first, then the generated text
    chunks = list(
        api.completions.create(
            model=model, prompt=PROMPT, echo=True, max_tokens=4, temperature=0, stream=True
        )
    )
    generated = "".join(c.choices[0].text for c in chunks[1:] if c.choices)
    assert chunks[0].choices[0].text == PROMPT and generated and text.startswith(generated)


def test_lm_eval_loglikelihood_request(
    front: BackgroundFrontEnd, model: str, encoder: PromptEncoder, hf_log_softmax: Any
) -> None:
    """The body lm-eval's local-completions sends for a loglikelihood request, parsed as it parses it."""
    import httpx

    context = encoder.tokenizer.encode("The capital of France is", add_special_tokens=False)
    continuation = encoder.tokenizer.encode(" Paris", add_special_tokens=False)
    tokens = context + continuation
    body = {
        "model": model,
        "prompt": [tokens],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(f"{front.url}/v1/completions", json=body, headers=headers, timeout=60).json()
    choice = reply["choices"][0]
    ctxlen = len(context)
    got = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
    reference = hf_log_softmax(tokens)
    expected = sum(float(reference[i - 1, tokens[i]]) for i in range(ctxlen, len(tokens)))
    assert abs(got - expected) < LOGPROB_TOLERANCE
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(
        v == max(top.values())
        for v, top in zip(choice["logprobs"]["token_logprobs"][ctxlen:-1], tops, strict=True)
    )
    assert is_greedy == all(int(reference[i - 1].argmax()) == tokens[i] for i in range(ctxlen, len(tokens)))


def test_logprobs_errors_name_the_field(front: BackgroundFrontEnd, model: str) -> None:
    api = client(front)
    cases = [
        (
            "top_logprobs",
            lambda: api.chat.completions.create(model=model, messages=CHAT, logprobs=True, top_logprobs=21),
        ),
        ("top_logprobs", lambda: api.chat.completions.create(model=model, messages=CHAT, top_logprobs=2)),
        ("logprobs", lambda: api.completions.create(model=model, prompt="hi", logprobs=21)),
        ("max_tokens", lambda: api.completions.create(model=model, prompt="hi", max_tokens=0)),
        ("prompt", lambda: api.completions.create(model=model, prompt=[10**9])),
    ]
    for param, call in cases:
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.body["param"] == param, err.value.message


@pytest.mark.parametrize("model_name", ["ensemble", "tensorrt_llm_bls"])
def test_triton_returns_context_and_generation_logits(
    tiny_server: TritonServer, greedy: dict, hf_log_softmax: Any, model_name: str
) -> None:
    """tensorrtllm_backend's return_context_logits / return_generation_logits through both client models."""
    import json

    import numpy as np

    from tests.serving_helpers import post_generate

    ids, _, _ = greedy["completion"]
    body = {
        "text_input": PROMPT, "max_tokens": 4, "top_k": 1, "exclude_input_in_output": True,
        "return_log_probs": True, "return_context_logits": True, "return_generation_logits": True,
    }  # fmt: skip
    status, text = post_generate(tiny_server.http_url, model_name, body)
    assert status == 200, text
    reply = json.loads(text)
    vocab = hf_log_softmax(ids).shape[1]
    context = np.asarray(reply["context_logits"], dtype=np.float64).reshape(len(ids), vocab)
    generation = np.asarray(reply["generation_logits"], dtype=np.float64).reshape(-1, vocab)

    def log_softmax(rows: np.ndarray) -> np.ndarray:
        shifted = rows - rows.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

    assert np.abs(log_softmax(context) - hf_log_softmax(ids)).max() < LOGPROB_TOLERANCE
    assert generation.shape[0] == 4 == np.asarray(reply["output_log_probs"]).size
    # greedy: each step's token is its logits' argmax, whose log-prob the engine reports
    best = log_softmax(generation).max(-1)
    assert np.allclose(best, np.asarray(reply["output_log_probs"]).reshape(-1), atol=LOGPROB_TOLERANCE)
