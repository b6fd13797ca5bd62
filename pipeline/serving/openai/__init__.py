"""An OpenAI-compatible HTTP front-end over a running tritonserver: /v1/models, /v1/completions,
/v1/chat/completions and /health, answered by the `tensorrt_llm_bls` model over a gRPC stream.

    llmpipe openai-server build/tiny/package/model_repo --triton-grpc 127.0.0.1:8001 --port 9000

Modules: errors (OpenAI's error object), schemas (request bodies), model_info (what the repository says:
name, tokenizer, limits), prompts (chat template, token counts), triton (the async gRPC stream),
generation (stop strings, finish reasons), responses (response and chunk objects), routes (handlers),
app (the aiohttp app, auth and error middleware, run_openai_server).
"""

from pipeline.serving.openai.app import BackgroundFrontEnd, OpenAIServerOptions, make_app, run_openai_server

__all__ = ["BackgroundFrontEnd", "OpenAIServerOptions", "make_app", "run_openai_server"]
