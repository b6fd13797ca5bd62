"""check_stop: end_id, stop sequences, min_tokens, max_tokens and max_seq_len."""

from __future__ import annotations

from pipeline.runtime.core.request import RequestStatus
from pipeline.runtime.core.sampling_params import SamplingParams
from pipeline.runtime.core.stop_checker import check_stop


def test_check_stop() -> None:
    params = SamplingParams(max_tokens=5, min_tokens=2, end_id=9, stop_token_ids=((4, 5),))
    prompt = [9, 4]
    assert check_stop([*prompt, 9], 2, params, 100) is None  # end_id before min_tokens
    assert check_stop([*prompt, 1, 9], 2, params, 100) == RequestStatus.FINISHED_STOPPED
    assert (
        check_stop([*prompt, 5], 2, SamplingParams(stop_token_ids=((4, 5),)), 100) is None
    )  # not in outputs
    assert check_stop([*prompt, 1, 4, 5], 2, params, 100) == RequestStatus.FINISHED_STOPPED
    assert check_stop([*prompt, 1, 2, 3, 4, 6], 2, params, 100) == RequestStatus.FINISHED_LENGTH
    assert check_stop([*prompt, 1, 2], 2, params, 4) == RequestStatus.FINISHED_LENGTH  # max_seq_len
    assert check_stop([*prompt, 1, 2, 3, 4, 9], 2, params, 100) == RequestStatus.FINISHED_STOPPED
