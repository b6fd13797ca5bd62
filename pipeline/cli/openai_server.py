"""`llmpipe openai-server`: an OpenAI-compatible HTTP API in front of a running tritonserver."""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.cli.options import CONTEXT


@click.command("openai-server", context_settings=CONTEXT)
@click.argument("model_repo", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--triton-grpc", default="127.0.0.1:8001", show_default=True, help="Triton's gRPC address.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=9000, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--api-key", envvar="LLMPIPE_API_KEY", default=None, help="Require `Authorization: Bearer KEY`."
)
@click.option(
    "--served-model-name", default=None, help="The model id clients send (default: the build's name)."
)
def openai_server(
    model_repo: Path,
    triton_grpc: str,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
) -> None:
    """Serve /v1/models, /v1/completions and /v1/chat/completions over MODEL_REPO's tensorrt_llm_bls model.

    \b
    Example (with `llmpipe serve` running):
      llmpipe openai-server build/smollm2-135m/package/model_repo --port 9000
      curl localhost:9000/v1/chat/completions -d '{"model": "smollm2-135m", "messages": [...]}'
    """
    from pipeline.serving.openai import OpenAIServerOptions, run_openai_server

    run_openai_server(
        OpenAIServerOptions(model_repo, triton_grpc, host, port, api_key or None, served_model_name)
    )
