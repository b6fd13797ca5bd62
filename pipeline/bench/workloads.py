"""Benchmark workloads: what to send, as a list of requests with a prompt and an intended output length.

Three sources, all deterministic for a given seed:
- synthetic lengths (trtllm-bench `token-norm-dist`: input/output lengths from normal distributions, or
  uniform ranges), filled with windows of real text tokens when a tokenizer is given;
- a JSONL dataset, one `{"prompt" | "input_ids", "output_tokens"}` object per line (trtllm-bench's format);
- named built-in workloads: `builtin` (the small prompt set shipped with llmpipe,
  `pipeline/data/bench_prompts.jsonl`), and `code-edit` / `summarize` (spec_workloads.py: answers that
  copy their prompt, where speculative decoding's prompt lookup pays off).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.bench.requests import BenchRequest
from pipeline.errors import ConfigError, MissingArtifactError
from pipeline.util.files import read_jsonl
from pipeline.util.package_data import DATA_DIR

SHIPPED_PROMPTS = DATA_DIR / "bench_prompts.jsonl"
# Without a tokenizer, synthetic ids avoid the low ids where special tokens usually live.
_RANDOM_ID_FLOOR = 100


# An HF tokenizer (encode(text, add_special_tokens=...) / decode(ids, skip_special_tokens=...)); typed
# loosely because transformers' own signatures do not fit a Protocol.
Tokenizer = Any


@dataclass(frozen=True)
class LengthSpec:
    """How synthetic lengths are drawn: normal(mean, stdev) clipped to [low, high] (stdev 0 = fixed), or
    uniform integers in [low, high]."""

    mean: float
    stdev: float = 0.0
    low: int = 1
    high: int | None = None
    uniform: bool = False

    @classmethod
    def between(cls, low: int, high: int) -> LengthSpec:
        return cls(mean=(low + high) / 2, low=low, high=high, uniform=True)

    def draw(self, rng: random.Random) -> int:
        if self.uniform:
            assert self.high is not None
            return rng.randint(self.low, self.high)
        value = round(rng.gauss(self.mean, self.stdev)) if self.stdev > 0 else round(self.mean)
        value = max(self.low, value)
        return min(self.high, value) if self.high is not None else value


def synthetic(
    num_requests: int,
    input_len: LengthSpec,
    output_len: LengthSpec,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    vocab_size: int = 32000,
) -> list[BenchRequest]:
    """Requests with drawn lengths. With a tokenizer the prompt ids are windows of the shipped prompt text
    (real text, so a server that re-tokenizes sees about the same length); without one they are random ids."""
    if num_requests < 1:
        raise ConfigError(f"number of requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    lengths = [(input_len.draw(rng), output_len.draw(rng)) for _ in range(num_requests)]
    corpus = _corpus_ids(tokenizer) if tokenizer is not None else None
    requests = []
    for index, (num_in, num_out) in enumerate(lengths):
        if corpus is not None:
            ids = _window(corpus, num_in, rng)
        else:
            ids = [rng.randrange(_RANDOM_ID_FLOOR, vocab_size) for _ in range(num_in)]
        requests.append(BenchRequest(index=index, output_tokens=num_out, input_ids=tuple(ids)))
    return requests


def _corpus_ids(tokenizer: Tokenizer) -> list[int]:
    text = "\n\n".join(str(row["prompt"]) for _, row in read_jsonl(SHIPPED_PROMPTS))
    return tokenizer.encode(text, add_special_tokens=False)


def _window(corpus: list[int], length: int, rng: random.Random) -> list[int]:
    if length >= len(corpus):
        repeats = length // len(corpus) + 1
        return (corpus * repeats)[:length]
    start = rng.randrange(0, len(corpus) - length + 1)
    return corpus[start : start + length]


def load_jsonl(path: str | Path, default_output_tokens: int | None = None) -> list[BenchRequest]:
    """A trtllm-bench style dataset: one JSON object per line with "prompt" or "input_ids", and "output_tokens"."""
    path = Path(path)
    if not path.is_file():
        raise MissingArtifactError(f"dataset not found: {path}", hint="pass a JSONL file to --dataset")
    requests = []
    for index, (where, row) in enumerate(read_jsonl(path)):
        output_tokens = row.get("output_tokens", default_output_tokens)
        if not isinstance(output_tokens, int) or output_tokens < 1:
            raise ConfigError(
                f"{where}: output_tokens must be an integer >= 1, got {output_tokens!r}",
                hint='each line needs "output_tokens" (or pass --output-mean to supply one)',
            )
        prompt, ids = row.get("prompt"), row.get("input_ids")
        if prompt is None and ids is None:
            raise ConfigError(f'{where}: a line needs "prompt" (text) or "input_ids" (token ids)')
        if ids is not None and not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
            raise ConfigError(f"{where}: input_ids must be a non-empty list of integers")
        if prompt is not None and not isinstance(prompt, str):
            raise ConfigError(f"{where}: prompt must be a string, got {type(prompt).__name__}")
        requests.append(
            BenchRequest(
                index=index,
                output_tokens=output_tokens,
                input_ids=tuple(ids) if ids is not None else None,
                prompt=prompt,
            )
        )
    if not requests:
        raise ConfigError(f"{path} holds no requests")
    return requests


def shipped_prompts(output_tokens: int | None = None) -> list[BenchRequest]:
    """The real prompt set that ships with llmpipe; `output_tokens` overrides each line's own length."""
    requests = load_jsonl(SHIPPED_PROMPTS)
    if output_tokens is not None:
        requests = [replace(r, output_tokens=output_tokens) for r in requests]
    return requests


def chat_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text` as one user turn of the tokenizer's chat template, ready for the assistant's answer: the ids
    the serving preprocessing sends the engine for a request with apply_chat_template."""
    from pipeline.serving.triton_models.tokenization import PromptEncoder

    return PromptEncoder(tokenizer, end_ids=[]).encode_prompt(text, chat=True)


def tokenize(
    requests: list[BenchRequest], tokenizer: Tokenizer | None, chat_template: bool = False
) -> list[BenchRequest]:
    """Give every request both forms: ids for engines that take ids, text for endpoints that take text.
    With `chat_template`, text prompts become ids through the tokenizer's chat template, as the serving
    preprocessing turns them for a request with apply_chat_template; the text stays as written."""
    out = []
    for r in requests:
        ids, prompt, chat = r.input_ids, r.prompt, r.chat
        if ids is None:
            if tokenizer is None:
                raise ConfigError(
                    f"request {r.index} has only text and no tokenizer is available",
                    hint="pass --tokenizer DIR (an HF tokenizer folder) or a dataset with input_ids",
                )
            if chat_template and getattr(tokenizer, "chat_template", None):
                from pipeline.serving.triton_models.io import InvalidInputError

                try:
                    ids, chat = tuple(chat_ids(tokenizer, prompt or "")), True
                except InvalidInputError as err:  # an empty prompt, which the server would refuse too
                    raise ConfigError(f"request {r.index}: {err}") from None
            else:
                ids = tuple(tokenizer.encode(prompt or "", add_special_tokens=False))
        if prompt is None and tokenizer is not None:
            prompt = tokenizer.decode(list(ids), skip_special_tokens=False)
        out.append(replace(r, input_ids=ids, prompt=prompt, chat=chat))
    return out


def cycle_to(requests: list[BenchRequest], count: int) -> list[BenchRequest]:
    """Exactly `count` requests, repeating the workload in order when it is shorter."""
    if not requests:
        raise ConfigError("the workload is empty")
    return [replace(requests[i % len(requests)], index=i) for i in range(count)]


BUILTIN_WORKLOADS = ("builtin", "code-edit", "summarize")


def builtin_workload(name: str) -> list[BenchRequest]:
    from pipeline.bench import spec_workloads

    if name == "code-edit":
        return spec_workloads.code_edit_requests()
    if name == "summarize":
        return spec_workloads.summarize_requests()
    return shipped_prompts()


def make_workload(
    dataset: str | None,
    num_requests: int,
    num_warmup: int,
    input_len: LengthSpec | None,
    output_len: LengthSpec | None,
    seed: int,
    tokenizer: Tokenizer,
    chat_template: bool = False,
) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(measured, warm-up) requests, tokenized (text prompts through the chat template when
    `chat_template`). `dataset` is a JSONL path, a BUILTIN_WORKLOADS name or None (synthetic lengths, by
    default 128 in / 64 out); with a dataset, `output_len` replaces each line's output length. Warm-up
    prompts come from another seed, so no measured prompt is already in a prefix cache when its run starts."""
    if dataset is None:
        base = synthetic(
            num_requests, input_len or LengthSpec(128), output_len or LengthSpec(64), seed, tokenizer
        )
    else:
        if input_len is not None:
            raise ConfigError("--input-mean shapes synthetic prompts; a --dataset brings its own prompts")
        base = builtin_workload(dataset) if dataset in BUILTIN_WORKLOADS else load_jsonl(dataset)
        if output_len is not None:
            rng = random.Random(seed)
            base = [replace(r, output_tokens=output_len.draw(rng)) for r in base]
    warmup = synthetic(num_warmup, LengthSpec(64), LengthSpec(8), seed + 1, tokenizer) if num_warmup else []
    return tokenize(cycle_to(base, num_requests), tokenizer, chat_template), tokenize(warmup, tokenizer)
