"""BlockManager: free list, ref counts, growth, draft rollback and prefix reuse, without a model."""

from __future__ import annotations

import pytest

from pipeline.runtime.core.block_manager import BlockManager
from pipeline.runtime.core.request import Request
from pipeline.runtime.core.sampling_params import SamplingParams


def _request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=4))


def _compute_all(bm: BlockManager, request: Request) -> None:
    """What the scheduler does after a step computed the whole prompt."""
    request.num_computed_tokens = request.num_tokens
    bm.publish_computed_blocks(request)


def test_allocate_and_free_round_trip() -> None:
    bm = BlockManager(num_blocks=8, tokens_per_block=4)
    request = _request("a", list(range(10)))
    assert bm.can_allocate(request)
    assert bm.allocate(request) == 0
    assert len(request.block_table) == 3  # ceil(10 / 4)
    assert len(set(request.block_table)) == 3
    assert all(bm.ref_counts[b] == 1 for b in request.block_table)
    assert (bm.num_used_blocks, bm.num_free_blocks) == (3, 5)
    assert request.stats.num_blocks_allocated == 3
    bm.free(request)
    assert request.block_table == []
    assert (bm.num_used_blocks, bm.num_free_blocks) == (0, 8)
    assert bm.ref_counts == [0] * 8


def test_cannot_allocate_past_capacity_or_reserved_blocks() -> None:
    bm = BlockManager(num_blocks=4, tokens_per_block=4)
    assert not bm.can_allocate(_request("big", list(range(17))))  # 5 blocks
    request = _request("a", list(range(8)))
    assert bm.can_allocate(request, num_reserved_blocks=2)
    assert not bm.can_allocate(request, num_reserved_blocks=3)
    # Reserving the whole sequence (prompt + outputs) rather than the prompt alone:
    assert bm.can_allocate(request, num_tokens=16)
    assert not bm.can_allocate(request, num_tokens=17)
    assert not bm.can_allocate(request, num_tokens=13, num_reserved_blocks=1)


def test_allocate_twice_and_double_free_raise() -> None:
    bm = BlockManager(num_blocks=4, tokens_per_block=4)
    request = _request("a", [1, 2, 3])
    bm.allocate(request)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        bm.allocate(request)
    table = list(request.block_table)
    bm.free(request)
    request.block_table = table
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(request)


def test_append_slots_grows_at_block_boundaries_and_counts_drafts() -> None:
    bm = BlockManager(num_blocks=4, tokens_per_block=4)
    request = _request("a", [1, 2, 3, 4])
    bm.allocate(request)
    request.num_computed_tokens = 4  # prompt computed; one sampled token pending
    request.token_ids.append(9)
    assert bm.can_append(request, 1)
    bm.append_slots(request, 1)
    assert len(request.block_table) == 2
    bm.append_slots(request, 1)  # still inside block 2
    assert len(request.block_table) == 2
    bm.append_slots(request, 1 + 6)  # 1 token + 6 drafts -> positions up to 10 -> 3 blocks
    assert len(request.block_table) == 3
    assert not bm.can_append(request, 1 + 12)  # 17 tokens > 4 blocks
    with pytest.raises(RuntimeError, match="can_append"):
        bm.append_slots(request, 1 + 12)


def test_trim_releases_blocks_of_rejected_drafts() -> None:
    bm = BlockManager(num_blocks=6, tokens_per_block=4)
    request = _request("a", list(range(5)))
    bm.allocate(request)
    request.num_computed_tokens = 4
    bm.append_slots(request, 1 + 7)  # up to position 11: 3 blocks
    assert len(request.block_table) == 3
    kept = request.block_table[:2]
    bm.trim(request, 6)  # only 6 tokens kept
    assert request.block_table == kept
    assert bm.num_used_blocks == 2
    bm.trim(request, 8)  # nothing past the kept length
    assert request.block_table == kept
    bm.free(request)
    assert bm.num_free_blocks == 6


def test_reuse_shares_leading_full_blocks_and_counts_hits() -> None:
    bm = BlockManager(num_blocks=16, tokens_per_block=4, enable_block_reuse=True)
    prefix = list(range(100, 108))  # two full blocks
    first = _request("a", [*prefix, 1, 2])
    assert bm.allocate(first) == 0
    _compute_all(bm, first)
    second = _request("b", [*prefix, 7, 8, 9])
    assert bm.get_num_cached_tokens(second) == 8
    assert bm.allocate(second) == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] not in first.block_table
    assert [bm.ref_counts[b] for b in first.block_table[:2]] == [2, 2]
    assert (bm.num_reuse_hits, bm.num_blocks_reused, bm.num_blocks_allocated) == (1, 2, 4)
    assert (second.stats.num_blocks_reused, second.stats.num_blocks_allocated) == (2, 1)


def test_block_holding_the_last_prompt_token_is_never_reused() -> None:
    bm = BlockManager(num_blocks=16, tokens_per_block=4, enable_block_reuse=True)
    prompt = list(range(8))  # exactly two blocks
    first = _request("a", prompt)
    bm.allocate(first)
    _compute_all(bm, first)
    again = _request("b", prompt)
    assert bm.allocate(again) == 4  # the last token (and its block) is computed again
    assert again.block_table[0] == first.block_table[0]
    assert again.block_table[1] != first.block_table[1]


def test_shared_blocks_survive_their_first_owner_and_then_stay_cached() -> None:
    bm = BlockManager(num_blocks=8, tokens_per_block=4, enable_block_reuse=True)
    first = _request("a", list(range(9)))
    bm.allocate(first)
    _compute_all(bm, first)
    second = _request("b", list(range(9)))
    bm.allocate(second)
    shared = first.block_table[:2]
    bm.free(first)
    assert [bm.ref_counts[b] for b in shared] == [1, 1]
    assert not set(shared) & (set(bm._free_block_ids) | set(bm._cached_free))
    bm.free(second)
    assert set(shared) <= set(bm._cached_free)
    assert bm.num_free_blocks == 8 and bm.num_cached_free_blocks == 2
    # A later request reuses them from the cached-free pool.
    third = _request("c", list(range(9)))
    assert bm.can_allocate(third, num_reserved_blocks=5)
    assert not bm.can_allocate(third, num_reserved_blocks=6)
    assert bm.allocate(third) == 8
    assert third.block_table[:2] == shared
    assert bm.num_cached_free_blocks == 0


def test_cached_blocks_are_evicted_only_when_the_free_list_is_empty_oldest_first() -> None:
    bm = BlockManager(num_blocks=4, tokens_per_block=2, enable_block_reuse=True)
    old = _request("old", [1, 2, 3])  # block [1, 2] gets published
    bm.allocate(old)
    _compute_all(bm, old)
    newer = _request("newer", [5, 6, 7])
    bm.allocate(newer)
    _compute_all(bm, newer)
    bm.free(old)
    bm.free(newer)
    assert bm.num_cached_free_blocks == 2
    filler = _request("filler", [9, 9, 9])  # two blocks: exactly what the plain free list holds
    bm.allocate(filler)
    assert bm.num_cached_free_blocks == 2
    bm.append_slots(filler, 5)  # a third block: evicts the oldest cached one
    assert bm.num_cached_free_blocks == 1
    assert bm.get_num_cached_tokens(_request("x", [1, 2, 3])) == 0
    assert bm.get_num_cached_tokens(_request("y", [5, 6, 7])) == 2


def test_equal_prefix_published_twice_keeps_one_copy() -> None:
    bm = BlockManager(num_blocks=8, tokens_per_block=2, enable_block_reuse=True)
    a = _request("a", [1, 2, 3])
    b = _request("b", [1, 2, 4])
    bm.allocate(a)
    bm.allocate(b)  # admitted before a's K/V existed: no hit
    assert b.block_table[0] != a.block_table[0]
    _compute_all(bm, a)
    _compute_all(bm, b)
    bm.free(a)
    bm.free(b)
    # a's copy is published and cached; b's duplicate went back to the plain free list.
    assert bm.num_cached_free_blocks == 1
    assert bm.allocate(_request("c", [1, 2, 5])) == 2


def test_reuse_disabled_never_shares() -> None:
    bm = BlockManager(num_blocks=8, tokens_per_block=2)
    a = _request("a", [1, 2, 3])
    bm.allocate(a)
    _compute_all(bm, a)
    b = _request("b", [1, 2, 3])
    assert bm.allocate(b) == 0
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_reuse_hits == 0


def test_blocks_outside_the_window_are_released_once_and_the_table_keeps_its_length() -> None:
    bm = BlockManager(num_blocks=8, tokens_per_block=4)
    request = _request("a", list(range(1, 15)))  # 14 tokens: 4 blocks
    bm.allocate(request)
    table = list(request.block_table)
    request.num_computed_tokens = 14
    bm.release_out_of_window(request, window=6)  # the next token (position 14) reads 9..14: blocks 0, 1 dead
    assert request.num_released_blocks == 2 and request.block_table == table
    assert bm.num_free_blocks == 6 and request.stats.num_blocks_released == 2
    bm.release_out_of_window(request, window=6)  # nothing new
    assert bm.num_free_blocks == 6
    bm.free(request)  # releases only the live blocks: no double free
    assert bm.num_free_blocks == 8 and request.num_released_blocks == 0


def test_with_reuse_only_published_blocks_leave_the_window_and_stay_findable() -> None:
    bm = BlockManager(num_blocks=8, tokens_per_block=4, enable_block_reuse=True)
    a = _request("a", list(range(1, 15)))
    bm.allocate(a)
    a.num_computed_tokens = 14
    bm.release_out_of_window(a, window=2)  # nothing published yet: nothing released
    assert a.num_released_blocks == 0
    bm.publish_computed_blocks(a)
    bm.release_out_of_window(a, window=2)
    assert a.num_released_blocks == 3 and bm.num_cached_free_blocks == 3
    b = _request("b", list(range(1, 15)))
    assert bm.allocate(b) == 12  # a's released blocks still serve the same prefix
    assert b.block_table[:3] == a.block_table[:3]
