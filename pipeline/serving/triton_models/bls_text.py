"""The BLS's text responses from the engine's: tokens detokenized incrementally (streamed) or whole, with
the log-probs, token ids and logits a request asked for, each token's sent with the text it completes."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from pipeline.serving.triton_models import triton_utils as tu
from pipeline.serving.triton_models.detokenizer import IncrementalDetokenizer
from pipeline.serving.triton_models.io import SPEC_OUTPUTS


class AssemblyPlan(Protocol):
    """What of a BLS request (bls.BlsPlan) decides its responses."""

    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def streaming(self) -> bool: ...
    @property
    def exclude_input_in_output(self) -> bool: ...
    @property
    def return_perf_metrics(self) -> bool: ...
    @property
    def return_log_probs(self) -> bool: ...
    @property
    def return_generation_logits(self) -> bool: ...


class TextAssembler:
    """Engine responses (numpy dicts) -> the BLS's text responses, streamed or whole."""

    def __init__(self, tokenizer: Any, plan: AssemblyPlan, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.plan = plan
        self.skip_special_tokens = skip_special_tokens
        self.detok = IncrementalDetokenizer(tokenizer, plan.prompt_ids, skip_special_tokens)
        self.token_ids: list[int] = []
        self.log_probs: list[np.ndarray] = []
        self.num_streamed_log_probs = 0  # streaming: log-probs already sent with earlier text
        self.cum_log_probs = np.zeros((1, 1), dtype=np.float32)
        self.speculative: dict[str, np.ndarray] = {}  # SPEC_OUTPUTS, sent with the final text
        self.context_logits: np.ndarray | None = None  # [1, prompt, vocab], sent once
        self.generation_logits: list[np.ndarray] = []  # one [vocab] row per generated token not yet sent
        self.num_sent_tokens = 0  # streaming: tokens whose ids and logits went out with earlier text

    def add(self, engine: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Fold in one engine response; for streaming, the text delta it completes (None: no text yet)."""
        count = int(np.asarray(engine["sequence_length"]).reshape(-1)[0])
        tokens = np.asarray(engine["output_ids"]).reshape(-1)[:count].tolist()
        self.token_ids += tokens
        if "cum_log_probs" in engine:
            self.cum_log_probs = np.asarray(engine["cum_log_probs"], dtype=np.float32).reshape(1, 1)
        log_probs = np.asarray(engine.get("output_log_probs", np.zeros(0)), dtype=np.float32).reshape(-1)
        self.log_probs.append(log_probs)
        if "context_logits" in engine:
            self.context_logits = np.asarray(engine["context_logits"], dtype=np.float32)
        if "generation_logits" in engine:  # [1, beam=1, tokens, vocab]
            rows = np.asarray(engine["generation_logits"], dtype=np.float32)
            self.generation_logits += list(rows.reshape(-1, rows.shape[-1]))
        if self.plan.return_perf_metrics:
            self.speculative.update({k: v for k, v in engine.items() if k in SPEC_OUTPUTS})
        if not self.plan.streaming:
            return None
        text = self.detok.add(tokens)
        return self._outputs(text) if text else None

    def finish(self) -> dict[str, np.ndarray]:
        """The last response: the held-back rest of a stream, or the whole text of a non-streaming request."""
        if self.plan.streaming:
            text = self.detok.flush()
        elif self.plan.exclude_input_in_output:
            text = self.detok.add(self.token_ids) + self.detok.flush()
        else:  # the engine returned prompt + output tokens: decode them like postprocessing does
            text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        outputs = self._outputs(text)
        if self.plan.return_perf_metrics:
            outputs.update(self.speculative)
        return outputs

    def _unsent_log_probs(self) -> np.ndarray:
        """Log-probs of the tokens whose text goes out now (held-back tokens' ones wait with them)."""
        every = np.concatenate(self.log_probs) if self.log_probs else np.zeros(0, np.float32)
        unsent, self.num_streamed_log_probs = every[self.num_streamed_log_probs :], every.size
        return unsent

    def _outputs(self, text: str) -> dict[str, np.ndarray]:
        # text_output is flat, [batch * beam] = [1], as upstream's postprocessing and BLS return it.
        outputs = {"text_output": tu.string_array([text], (1,))}
        start, self.num_sent_tokens = self.num_sent_tokens, len(self.token_ids)
        if self.plan.return_log_probs:  # only then are the log-probs gathered
            outputs["cum_log_probs"] = self.cum_log_probs
            outputs["output_log_probs"] = self._unsent_log_probs().reshape(1, 1, -1)
            outputs["output_ids"] = np.array([self.token_ids[start:]], dtype=np.int32).reshape(1, 1, -1)
        if self.context_logits is not None:
            outputs["context_logits"], self.context_logits = self.context_logits, None
        if self.plan.return_generation_logits:
            rows, self.generation_logits = self.generation_logits or [np.zeros(0, np.float32)], []
            outputs["generation_logits"] = np.stack(rows)[None, None]
        return outputs
