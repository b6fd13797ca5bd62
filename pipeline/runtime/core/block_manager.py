"""Paged-KV block accounting: free list, reference counts and prefix reuse. Ints and lists only.

The block manager is the only writer of `Request.block_table`. Block `b` holds the K/V of the tokens at
positions `[i * tokens_per_block, (i + 1) * tokens_per_block)` of every request whose `block_table[i] == b`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pipeline.runtime.core.request import Request

# A full block is identified by its parent's hash and its own token ids, so equal keys mean equal prefixes
# (the token tuple is compared exactly by the dict; only the parent link relies on a 64-bit hash).
BlockKey = tuple[int, tuple[int, ...]]


@dataclass
class _PrefixState:
    """Per-request prefix-reuse bookkeeping (only with reuse enabled)."""

    keys: list[BlockKey] = field(default_factory=list)  # keys of the full blocks of token_ids, built lazily
    num_published_blocks: int = 0  # leading blocks already in the hash table (found there or added)


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, enable_block_reuse: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: the KV cache needs at least one block")
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block={tokens_per_block} is invalid: must be >= 1")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.enable_block_reuse = enable_block_reuse
        self.ref_counts = [0] * num_blocks
        self._free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end
        # NOTE: freed blocks that still hold a published prefix stay reusable here, oldest first; allocation
        # evicts from this pool only when the plain free list is empty.
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._block_keys: list[BlockKey | None] = [None] * num_blocks
        self._key_to_block: dict[BlockKey, int] = {}
        self._prefix: dict[str, _PrefixState] = {}
        self.num_reuse_hits = 0  # allocations that found at least one cached block
        self.num_blocks_allocated = 0  # blocks taken from the free pools
        self.num_blocks_reused = 0  # blocks shared through prefix reuse

    # --- gauges ---

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: the plain free list plus evictable cached blocks."""
        return len(self._free_block_ids) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    # --- admission ---

    def get_num_cached_tokens(self, request: Request) -> int:
        """Leading tokens of `request.token_ids` whose K/V an allocation would reuse."""
        return len(self._find_prefix_hits(request)) * self.tokens_per_block

    def can_allocate(
        self, request: Request, num_tokens: int | None = None, num_reserved_blocks: int = 0
    ) -> bool:
        """True if blocks for `num_tokens` (default: all of request.token_ids) fit while leaving
        `num_reserved_blocks` free. Prefix hits on blocks in use cost nothing."""
        num_tokens = request.num_tokens if num_tokens is None else num_tokens
        hits = self._find_prefix_hits(request)
        num_hits_in_use = sum(1 for block_id in hits if self.ref_counts[block_id] > 0)
        return self.num_blocks_for(num_tokens) - num_hits_in_use <= self.num_free_blocks - num_reserved_blocks

    def allocate(self, request: Request) -> int:
        """Give a request without blocks the blocks for all of its token_ids; returns the number of leading
        tokens whose K/V came from reused blocks."""
        if request.block_table:
            raise RuntimeError(f"request {request.request_id!r} already holds blocks {request.block_table}")
        hits = self._find_prefix_hits(request)
        num_fresh = self.num_blocks_for(request.num_tokens) - len(hits)
        if num_fresh > self.num_free_blocks - sum(1 for b in hits if self.ref_counts[b] == 0):
            raise RuntimeError(f"no room for request {request.request_id!r}: call can_allocate first")
        for block_id in hits:
            if self.ref_counts[block_id] == 0:
                del self._cached_free[block_id]
            self.ref_counts[block_id] += 1
        request.block_table = hits + [self._take_free_block() for _ in range(num_fresh)]
        if hits:
            self._prefix[request.request_id].num_published_blocks = len(hits)
            self.num_reuse_hits += 1
        self.num_blocks_reused += len(hits)
        self.num_blocks_allocated += num_fresh
        request.stats.num_blocks_reused += len(hits)
        request.stats.num_blocks_allocated += num_fresh
        return len(hits) * self.tokens_per_block

    # --- growth and rollback ---

    def _num_missing_blocks(self, request: Request, num_new_tokens: int) -> int:
        return self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        """True if the next `num_new_tokens` tokens (draft tokens included) after the computed ones fit."""
        return self._num_missing_blocks(request, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, request: Request, num_new_tokens: int) -> None:
        """Grow the block table to hold `num_computed_tokens + num_new_tokens` tokens."""
        num_missing = self._num_missing_blocks(request, num_new_tokens)
        if num_missing <= 0:
            return
        if num_missing > self.num_free_blocks:
            raise RuntimeError(f"no room to grow request {request.request_id!r}: call can_append first")
        request.block_table.extend(self._take_free_block() for _ in range(num_missing))
        self.num_blocks_allocated += num_missing
        request.stats.num_blocks_allocated += num_missing

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens (the K/V of rejected draft tokens)."""
        num_kept = self.num_blocks_for(num_tokens)
        for block_id in reversed(request.block_table[num_kept:]):
            self._release(block_id)
        del request.block_table[num_kept:]
        state = self._prefix.get(request.request_id)
        if state is not None:
            state.num_published_blocks = min(state.num_published_blocks, num_kept)

    def free(self, request: Request) -> None:
        """Release all of a request's blocks (finish, abort or preemption)."""
        # Tail first, so that the LRU pool evicts a sequence's last blocks before its shared prefix.
        for block_id in reversed(request.block_table[request.num_released_blocks :]):
            self._release(block_id)
        request.block_table = []
        request.num_released_blocks = 0
        self._prefix.pop(request.request_id, None)

    def release_out_of_window(self, request: Request, window: int) -> None:
        """Release the leading blocks no query of the request reads again when every layer attends to the
        last `window` positions only: the next token (position num_computed_tokens) reads back to
        num_computed_tokens - window + 1. With reuse on, only published blocks go (they stay findable in
        the cached pool); the table keeps its length, so positions still map to entries."""
        first_read = request.num_computed_tokens - window + 1
        num_dead = min(max(first_read, 0) // self.tokens_per_block, len(request.block_table))
        if self.enable_block_reuse:
            state = self._prefix.get(request.request_id)
            num_dead = min(num_dead, state.num_published_blocks if state else 0)
        for i in range(request.num_released_blocks, num_dead):
            self._release(request.block_table[i])
        if num_dead > request.num_released_blocks:
            request.stats.num_blocks_released += num_dead - request.num_released_blocks
            request.num_released_blocks = num_dead

    # --- prefix reuse ---

    def publish_computed_blocks(self, request: Request) -> None:
        """Make the request's full, computed blocks findable by later requests with the same prefix.

        Called after a step wrote their K/V: a block is never shared before its K/V exist.
        """
        if not self.enable_block_reuse:
            return
        state = self._prefix.setdefault(request.request_id, _PrefixState())
        num_full = min(request.num_computed_tokens // self.tokens_per_block, len(request.block_table))
        if num_full <= state.num_published_blocks:
            return
        keys = self._prefix_keys(request, num_full)
        for i in range(state.num_published_blocks, num_full):
            block_id = request.block_table[i]
            # An equal prefix computed concurrently by another request keeps the first published copy.
            if keys[i] not in self._key_to_block and self._block_keys[block_id] is None:
                self._key_to_block[keys[i]] = block_id
                self._block_keys[block_id] = keys[i]
        state.num_published_blocks = num_full

    def _prefix_keys(self, request: Request, num_blocks: int) -> list[BlockKey]:
        keys = self._prefix.setdefault(request.request_id, _PrefixState()).keys
        size = self.tokens_per_block
        token_ids = request.token_ids
        for i in range(len(keys), num_blocks):
            parent = hash(keys[-1]) if keys else 0
            keys.append((parent, tuple(token_ids[i * size : (i + 1) * size])))
        return keys

    def _find_prefix_hits(self, request: Request) -> list[int]:
        if not self.enable_block_reuse:
            return []
        # NOTE: the block holding the last token is never reused: that token is always computed so the
        # first output can be sampled, and computing it must not write into a shared block.
        max_blocks = (request.num_tokens - 1) // self.tokens_per_block
        hits: list[int] = []
        for key in self._prefix_keys(request, max_blocks)[:max_blocks]:
            block_id = self._key_to_block.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # --- pools ---

    def _take_free_block(self) -> int:
        if self._free_block_ids:
            block_id = self._free_block_ids.pop()
        else:
            block_id, _ = self._cached_free.popitem(last=False)
            key = self._block_keys[block_id]
            assert key is not None
            del self._key_to_block[key]
            self._block_keys[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"KV block {block_id} freed twice")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self._block_keys[block_id] is not None:
                self._cached_free[block_id] = None
            else:
                self._free_block_ids.append(block_id)
