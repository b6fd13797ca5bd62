"""LLMEngine: a step is schedule -> runner.execute -> update. Synchronous; see async_engine for the thread."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from pipeline.errors import ConfigError
from pipeline.runtime.core.metrics import MetricsSnapshot
from pipeline.runtime.core.outputs import RequestOutput, RunnerOutput, ScheduledRequest, SchedulerOutput
from pipeline.runtime.core.request import Request, RequestStatus
from pipeline.runtime.core.runner import Runner
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.core.scheduler import Scheduler, SchedulerConfig
from pipeline.runtime.engine.engine_args import EngineArgs
from pipeline.runtime.engine.stream_interval import StreamInterval
from pipeline.runtime.spec_decode.proposer import Proposer

logger = logging.getLogger(__name__)
T = TypeVar("T")


class LLMEngine:
    def __init__(
        self,
        runner: Runner,
        config: SchedulerConfig,
        proposer: Proposer | None = None,
        vocab_size: int | None = None,
        stream_interval: int = 1,
    ) -> None:
        self.runner = runner
        self.config = config
        self.proposer = proposer  # speculative decoding: drafts for the running requests before each step
        self.vocab_size = vocab_size  # token ids in sampling params are checked against it when known
        self.scheduler = Scheduler(config, runner.num_kv_blocks, runner.tokens_per_block)
        self.stream_interval = StreamInterval(stream_interval)
        self._generate_ids = itertools.count()

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError if such a request can never run. Safe from any thread."""
        self.scheduler.check_request(num_prompt_tokens, params)
        if self.vocab_size is not None:
            params.check_vocab(self.vocab_size)

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams | None = None
    ) -> Request:
        request = Request(request_id, list(prompt_token_ids), sampling_params or SamplingParams())
        if self.vocab_size is not None:
            request.sampling_params.check_vocab(self.vocab_size)
        self.scheduler.add_request(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request in any state; its final output (finish_reason "abort", with any tokens the stream
        interval held back), or None if unknown."""
        output = self.scheduler.abort(request_id)
        return None if output is None else self.stream_interval.release([output])[0]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> MetricsSnapshot:
        return self.scheduler.stats()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; the outputs of requests that got tokens or finished, as far as the stream
        interval lets them out (a held output's tokens come with the request's next one)."""
        return self.stream_interval.release(self._step())

    def _step(self) -> list[RequestOutput]:
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with unfinished requests (engine bug)")
            return []
        try:
            runner_output = self.runner.execute(scheduler_output)
        except Exception as exc:
            logger.exception("runner failed a step of %d requests", len(scheduler_output.scheduled))
            return self._step_isolating_errors(scheduler_output, exc)
        return self.scheduler.update(scheduler_output, runner_output)

    def _step_isolating_errors(
        self, scheduler_output: SchedulerOutput, exc: Exception
    ) -> list[RequestOutput]:
        """Re-run each scheduled request alone: only the requests that still fail end with an error."""
        scheduled = scheduler_output.scheduled
        if len(scheduled) == 1:
            return self._fail(scheduled[0], exc)
        outputs: list[RequestOutput] = []
        ok: list[ScheduledRequest] = []
        results: list[RunnerOutput] = []
        for i, sched in enumerate(scheduled):
            # The first retry repeats the step's finished/preempted ids in case the failed call never read them.
            single = SchedulerOutput(
                scheduled=[sched],
                preempted_request_ids=scheduler_output.preempted_request_ids if i == 0 else [],
                finished_request_ids=scheduler_output.finished_request_ids if i == 0 else [],
            )
            try:
                results.append(self.runner.execute(single))
            except Exception as single_exc:
                outputs += self._fail(sched, single_exc)
                continue
            ok.append(sched)
        if ok:
            outputs += self.scheduler.update(SchedulerOutput(scheduled=ok), RunnerOutput.concat(results))
        return outputs

    def _fail(self, sched: ScheduledRequest, exc: Exception) -> list[RequestOutput]:
        error = f"runner failed: {type(exc).__name__}: {exc}"
        output = self.scheduler.finish_request(sched.request.request_id, RequestStatus.FINISHED_ERROR, error)
        return [output] if output is not None else []

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Request]:
        """Run prompts to completion (stepping any other queued requests too); finished requests in order."""
        if params is None or isinstance(params, SamplingParams):
            params_list: Sequence[SamplingParams] = [params or SamplingParams()] * len(prompts)
        else:
            params_list = params
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        requests = [
            self.add_request(f"generate-{next(self._generate_ids)}", prompt, p)
            for prompt, p in zip(prompts, params_list, strict=True)
        ]
        while any(not r.status.finished for r in requests):
            self.step()
        return requests

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, args: EngineArgs | None = None) -> LLMEngine:
        """Load an engine directory: the model runner plus a scheduler set from its build limits and
        runtime defaults, each overridable by `args` (limits no higher than the engine was built for)."""
        from pipeline.runtime.engine_config import load_engine_config
        from pipeline.runtime.spec_decode.factory import make_proposer
        from pipeline.runtime.worker.model_runner import ModelRunner

        args = args or EngineArgs()
        _verify_engine_files(Path(engine_dir))
        engine_config = load_engine_config(engine_dir)
        build, runtime = engine_config.build, engine_config.runtime
        built_limits = {
            "max_batch_size": build.max_batch_size,
            "max_num_tokens": build.max_num_tokens,
            "max_input_len": build.max_input_len,
            "max_seq_len": build.max_seq_len,
        }
        limits = {}
        for name, built in built_limits.items():
            asked = getattr(args, name)
            if asked is not None and asked > built:
                raise ConfigError(
                    f"{name}={asked} exceeds the {built} the engine in {engine_dir} was built for",
                    hint=f"rebuild with a larger engine.{name} or lower the override",
                )
            limits[name] = built if asked is None else asked
        try:
            config = SchedulerConfig(
                **limits,
                policy=_either(args.policy, runtime.scheduler_policy),
                enable_chunked_context=_either(args.enable_chunked_context, runtime.enable_chunked_context),
                enable_block_reuse=_either(args.enable_block_reuse, runtime.enable_block_reuse),
                attention_window=engine_config.model.uniform_window,
            )
        except ValueError as err:
            raise ConfigError(f"{engine_dir}: {err}") from None
        runner = ModelRunner(engine_config, args.runner)
        proposer = make_proposer(engine_config, runner, args.speculation)
        return cls(
            runner,
            config,
            proposer,
            vocab_size=engine_config.model.vocab_size,
            stream_interval=args.stream_interval,
        )


def _either(override: T | None, built: T) -> T:
    return built if override is None else override


def _verify_engine_files(engine_dir: Path) -> None:
    """An engine stage's output carries a manifest: refuse truncated or altered weights before loading them
    (IntegrityError naming the file). Engine folders made outside the stages have none and load as they are."""
    from pipeline.artifacts import read_manifest, verify_files

    manifest = read_manifest(engine_dir)
    if manifest is not None:
        verify_files(engine_dir, manifest)
