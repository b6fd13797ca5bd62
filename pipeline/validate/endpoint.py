"""A running Triton deployment as the validation target: greedy completions through its ensemble
(text_input, max_tokens, ... -> text_output), so a TensorRT-LLM deployment on a GPU is gated the same way
as the in-process engine. Only text metrics are possible here (measure.SKIP_REASON_ENDPOINT says why)."""

from __future__ import annotations

from pipeline.errors import ConfigError
from pipeline.serving.client import DEFAULT_MODEL, GenerationOptions, GrpcClient, HttpClient


class EndpointTarget:
    def __init__(self, url: str, model: str = DEFAULT_MODEL) -> None:
        """url: http[s]://host:port (Triton's HTTP generate extension) or grpc://host:port."""
        if url.startswith("grpc://"):
            self.client: GrpcClient | HttpClient = GrpcClient(url.removeprefix("grpc://"), model)
        elif url.startswith(("http://", "https://")):
            self.client = HttpClient(url, model)
        else:
            raise ConfigError(
                f"--endpoint {url!r}: give a scheme",
                hint="e.g. http://127.0.0.1:8000 or grpc://127.0.0.1:8001",
            )
        self.name = f"endpoint {url} ({model})"

    def generate_text(self, prompts: list[str], max_new_tokens: int, stop_ids: list[int]) -> list[str]:
        # top_k=1 is greedy under every convention (TensorRT-LLM's and llmpipe's); the end id is the
        # reference's, so both sides stop on the same token. One request at a time, like the reference.
        options = GenerationOptions(
            max_tokens=max_new_tokens,
            top_k=1,
            end_id=stop_ids[0] if stop_ids else None,
            exclude_input_in_output=True,
        )
        return [self.client.generate(prompt, options).text for prompt in prompts]
