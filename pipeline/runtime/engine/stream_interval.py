"""Fewer, larger streamed outputs: `stream_interval` (TensorRT-LLM's LLM API and vLLM use the name).

With an interval of N, a request's first output leaves at once (time to first token is unchanged), its final
one when it finishes, and in between one output for every N steps that gave it tokens, carrying all of them.
Served, each output is a response that crosses processes (the engine's Python model, tritonserver, the
detokenizer, the client's stream); at 16 streams on two cores that traffic, not the model, limits throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pipeline.runtime.core.outputs import RequestOutput


def merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output with the tokens (log-probs, generation logits) of `earlier` then `later`; the rest is
    `later`'s, except the prompt's logits, which only the first output of a request carries."""
    logits = [x for x in (earlier.new_generation_logits, later.new_generation_logits) if x is not None]
    return replace(
        later,
        new_token_ids=earlier.new_token_ids + later.new_token_ids,
        new_logprobs=earlier.new_logprobs + later.new_logprobs,
        context_logits=earlier.context_logits if earlier.context_logits is not None else later.context_logits,
        new_generation_logits=np.concatenate(logits) if len(logits) == 2 else (logits[0] if logits else None),
    )


@dataclass
class _Held:
    output: RequestOutput
    steps: int  # engine steps whose tokens it holds


class StreamInterval:
    """Holds each request's outputs back until the interval says they go; `interval` 1 passes all."""

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream_interval={interval} must be at least 1")
        self.interval = interval
        self._held: dict[str, _Held] = {}

    def release(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs due now, each with the tokens held for its request before it."""
        if self.interval == 1:
            return outputs
        due = []
        for output in outputs:
            held = self._held.pop(output.request_id, None)
            steps = 1
            if held is not None:
                output, steps = merged(held.output, output), held.steps + 1
            first = output.num_output_tokens == len(output.new_token_ids)
            if output.finished or first or steps >= self.interval:
                due.append(output)
            else:
                self._held[output.request_id] = _Held(output, steps)
        return due
