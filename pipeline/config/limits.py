"""The length invariants of an engine, checked by the build config, the engine directory's loader and the
scheduler alike: one definition, each caller naming the fields its own way."""

from __future__ import annotations

from collections.abc import Callable


def length_limit_errors(
    *,
    max_input_len: int,
    max_seq_len: int,
    max_num_tokens: int,
    max_batch_size: int,
    enable_chunked_context: bool,
    name: Callable[[str], str] = lambda field: field,
) -> list[str]:
    """What is wrong with these limits, one message per broken invariant, fields shown as `name(field)`."""
    errors = []
    if max_input_len > max_seq_len:
        errors.append(
            f"{name('max_input_len')}={max_input_len} exceeds {name('max_seq_len')}={max_seq_len}: "
            "a prompt must leave room for output; raise max_seq_len or lower max_input_len"
        )
    if max_num_tokens < max_batch_size:
        errors.append(
            f"{name('max_num_tokens')}={max_num_tokens} < {name('max_batch_size')}={max_batch_size}: every "
            "running sequence needs at least one token per step; raise max_num_tokens"
        )
    if not enable_chunked_context and max_num_tokens < max_input_len:
        errors.append(
            f"{name('max_num_tokens')}={max_num_tokens} < {name('max_input_len')}={max_input_len} with "
            f"{name('enable_chunked_context')}=false: the longest prompt can never be scheduled; "
            "enable chunked context or raise max_num_tokens"
        )
    return errors
