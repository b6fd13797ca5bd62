"""Per-step attention metadata: where each flattened token sits (position, cache slot, sequence) and
each sequence's block table, built once per step and shared by every layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceChunk:
    """One scheduled sequence's tokens this step: positions start .. start + num_tokens - 1."""

    start: int
    num_tokens: int
    block_table: list[int]


@dataclass
class PaddedBatch:
    """The torch attention path's view: queries padded to [S, max_query_len] and a boolean mask."""

    block_tables: torch.Tensor  # [S, max_blocks] int64 (index tensor)
    token_seq: torch.Tensor  # [T] int64: sequence of each token
    token_row: torch.Tensor  # [T] int64: index of each token within its sequence's chunk
    max_query_len: int
    # Per attention window (None = full causal): [S, 1, max_query_len, max_blocks * block_size] bool,
    # True = attend
    masks: dict[int | None, torch.Tensor]


@dataclass
class AttentionMetadata:
    num_tokens: int
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block_table[pos // block_size] * block_size + pos % block_size
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with block 0 (never read past the context)
    token_seq: torch.Tensor  # [T] int32
    max_context_len: int  # longest start + num_tokens in the step
    padded: PaddedBatch | None = None


def build_attention_metadata(
    chunks: list[SequenceChunk],
    block_size: int,
    device: torch.device,
    padded: bool = False,
    windows: Sequence[int | None] = (None,),
    num_blocks: int | None = None,
) -> AttentionMetadata:
    """Metadata for `chunks` in order; with `padded`, a mask for each of the model's attention `windows`;
    `num_blocks` (the cache size) turns on a bounds check of the block tables, which the attention kernel does
    not check."""
    positions: list[int] = []
    slots: list[int] = []
    token_seq: list[int] = []
    for seq, chunk in enumerate(chunks):
        table = chunk.block_table
        span = range(chunk.start, chunk.start + chunk.num_tokens)
        positions.extend(span)
        slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in span)
        token_seq.extend([seq] * chunk.num_tokens)
    max_context = max(c.start + c.num_tokens for c in chunks)
    max_blocks = -(-max_context // block_size)
    tables = [
        c.block_table[:max_blocks] + [0] * (max_blocks - min(len(c.block_table), max_blocks)) for c in chunks
    ]
    block_tables = torch.tensor(tables, dtype=torch.int32)
    if (
        num_blocks is not None
        and block_tables.numel()
        and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < num_blocks
    ):
        raise ValueError(f"block table names a block outside 0..{num_blocks - 1}")
    meta = AttentionMetadata(
        num_tokens=len(positions),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        token_seq=torch.tensor(token_seq, dtype=torch.int32, device=device),
        max_context_len=max_context,
    )
    if padded:
        meta.padded = _padded_batch(chunks, meta, block_tables, block_size, windows, device)
    return meta


def _padded_batch(
    chunks: list[SequenceChunk],
    meta: AttentionMetadata,
    block_tables: torch.Tensor,
    block_size: int,
    windows: Sequence[int | None],
    device: torch.device,
) -> PaddedBatch:
    max_query = max(c.num_tokens for c in chunks)
    rows = [row for c in chunks for row in range(c.num_tokens)]
    token_seq = meta.token_seq.to(torch.int64)
    token_row = torch.tensor(rows, dtype=torch.int64, device=device)
    # Position of every padded query row; padding rows get position 0 so they attend to one key (no NaN).
    query_pos = torch.zeros(len(chunks), max_query, dtype=torch.int64, device=device)
    query_pos[token_seq, token_row] = meta.positions
    key_pos = torch.arange(block_tables.shape[1] * block_size, device=device)
    causal = key_pos[None, None, :] <= query_pos[:, :, None]
    masks = {
        window: (causal & (key_pos[None, None, :] > query_pos[:, :, None] - window) if window else causal)[
            :, None
        ]
        for window in windows
    }
    return PaddedBatch(
        block_tables=block_tables.to(device=device, dtype=torch.int64),
        token_seq=token_seq,
        token_row=token_row,
        max_query_len=max_query,
        masks=masks,
    )
