"""`llmpipe generate`: send one prompt to a running server and print the answer."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import click

from pipeline.cli.options import CONTEXT
from pipeline.serving.client import (
    DEFAULT_MODEL,
    Chunk,
    Completion,
    GenerationOptions,
    GrpcClient,
    HttpClient,
    collect,
)


@click.command("generate", context_settings=CONTEXT)
@click.argument("prompt")
@click.option("--url", help="Server address [127.0.0.1:8001 for gRPC, 127.0.0.1:8000 with --http].")
@click.option(
    "--http", "use_http", is_flag=True, help="Use HTTP (Triton's generate endpoints) instead of gRPC."
)
@click.option(
    "--model",
    default=DEFAULT_MODEL,
    show_default=True,
    help="Model to call: ensemble or tensorrt_llm_bls (same inputs and outputs).",
)
@click.option(
    "--stream", is_flag=True, help="Print the answer as it is generated (needs a decoupled deployment)."
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Tokens to generate at most.",
)
@click.option(
    "--temperature", type=click.FloatRange(min=0), help="Sampling temperature (needs --top-k or --top-p)."
)
@click.option(
    "--top-k", type=click.IntRange(min=0), help="Sample from the k most likely tokens (1 = greedy)."
)
@click.option("--top-p", type=click.FloatRange(0, 1), help="Nucleus sampling probability mass.")
@click.option("--seed", type=click.IntRange(min=0), help="Seed of this request's sampling.")
@click.option(
    "--repetition-penalty", type=click.FloatRange(min=0, min_open=True), help="> 1 discourages repeats."
)
@click.option("--presence-penalty", type=float, help="Subtracted once from every generated token's logit.")
@click.option("--frequency-penalty", type=float, help="Subtracted per occurrence of a generated token.")
@click.option("--min-tokens", type=click.IntRange(min=0), help="Never stop before this many tokens.")
@click.option(
    "--stop", "stop_words", multiple=True, metavar="TEXT", help="Stop after this text (repeatable)."
)
@click.option(
    "--bad-word", "bad_words", multiple=True, metavar="TEXT", help="Never generate this text (repeatable)."
)
@click.option("--end-id", type=int, help="End-of-sequence token id [the tokenizer's].")
@click.option(
    "--return-log-probs", is_flag=True, help="Also return each token's log-probability (see --json)."
)
@click.option(
    "--include-input", is_flag=True, help="Return the prompt followed by the answer (non-streaming)."
)
@click.option(
    "--chat",
    is_flag=True,
    help="Send PROMPT as one user turn of the model's chat template (for instruct models); without it the "
    "text goes to the model as written, as tensorrtllm_backend does.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object: text, chunks, log-probs, timings."
)
@click.option(
    "--timeout", type=click.FloatRange(min=1), default=600.0, show_default=True, help="Seconds to wait."
)
def generate(
    prompt: str,
    url: str | None,
    use_http: bool,
    model: str,
    stream: bool,
    max_tokens: int,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    repetition_penalty: float | None,
    presence_penalty: float | None,
    frequency_penalty: float | None,
    min_tokens: int | None,
    stop_words: tuple[str, ...],
    bad_words: tuple[str, ...],
    end_id: int | None,
    return_log_probs: bool,
    include_input: bool,
    chat: bool,
    as_json: bool,
    timeout: float,
) -> None:
    """Send PROMPT to a served model (`llmpipe serve`) and print the answer; PROMPT - reads stdin.

    Greedy unless --top-k or --top-p asks for sampling (TensorRT-LLM's convention; --temperature alone
    stays greedy). gRPC by default; --http uses POST /v2/models/<model>/generate[_stream].

    \b
    Examples:
      llmpipe generate "Write a haiku about GPUs" --stream --chat
      llmpipe generate "Write a haiku about GPUs" --top-k 40 --temperature 0.8 --seed 7
      llmpipe generate "List three colors:" --stop "4." --max-tokens 40 --json
      echo "Hello" | llmpipe generate - --http --model tensorrt_llm_bls
    """
    if prompt == "-":
        prompt = sys.stdin.read()
    if temperature is not None and top_k is None and top_p is None:
        click.echo("note: --temperature alone is greedy; add --top-k or --top-p to sample", err=True)
    options = GenerationOptions(
        max_tokens=max_tokens,
        stream=stream,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        min_tokens=min_tokens,
        end_id=end_id,
        stop_words=stop_words,
        bad_words=bad_words,
        return_log_probs=True if return_log_probs else None,
        exclude_input_in_output=not include_input,  # upstream's default would echo the prompt
        apply_chat_template=True if chat else None,
    )
    echo = not as_json
    if use_http:
        http = HttpClient(url or "127.0.0.1:8000", model, timeout)
        chunks = http.stream(prompt, options) if stream else iter([_single(http.generate(prompt, options))])
        completion = _consume(chunks, echo)
    else:
        with GrpcClient(url or "127.0.0.1:8001", model, timeout) as client:
            completion = _consume(client.stream(prompt, options), echo)
    if as_json:
        click.echo(json.dumps({"model": model, **completion.to_dict()}, ensure_ascii=False, indent=2))
    else:
        click.echo("")


def _single(completion: Completion) -> Chunk:
    return Chunk(completion.text, completion.cum_log_prob, completion.log_probs)


def _consume(chunks: Iterator[Chunk], echo: bool) -> Completion:
    """Collect the answer, printing each piece as it arrives when `echo`."""

    def printed() -> Iterator[Chunk]:
        for chunk in chunks:
            if echo:
                click.echo(chunk.text, nl=False)
                sys.stdout.flush()
            yield chunk

    return collect(printed())
