"""The paged KV cache: per layer a K and a V tensor of [num_blocks * tokens_per_block, kv_heads, head_dim]
(a [num_blocks, tokens_per_block, kv_heads, head_dim] block array, flattened over slots), and how many
blocks fit."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from pipeline.errors import ConfigError
from pipeline.runtime.engine_config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element


def available_memory_bytes(device: torch.device) -> int:
    """Free device memory: CUDA's free bytes, or MemAvailable from /proc/meminfo on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise ConfigError(
        "cannot read free memory (/proc/meminfo) to size the KV cache",
        hint="set kv_cache.max_tokens (kv_max_tokens) explicitly",
    )


def num_kv_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_tokens: int | None,
    free_memory_fraction: float,
    max_useful_blocks: int,
) -> int:
    """Blocks for `max_tokens` tokens if given, else for `free_memory_fraction` of the free memory, but no
    more than `max_useful_blocks` (what max_batch_size full-length sequences can use at once)."""
    if max_tokens is not None:
        blocks = max_tokens // block_size
        source = f"kv_max_tokens={max_tokens}"
    else:
        free = available_memory_bytes(device)
        blocks = min(
            int(free * free_memory_fraction) // bytes_per_block(config, block_size, dtype), max_useful_blocks
        )
        source = f"kv_free_memory_fraction={free_memory_fraction} of {free / 2**30:.1f} GiB free"
    if blocks < 1:
        raise ConfigError(
            f"{source} leaves no room for one KV block of {block_size} tokens",
            hint="raise kv_cache.max_tokens or kv_cache.free_memory_fraction",
        )
    return blocks


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        zero: bool,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (
            config.num_hidden_layers,
            2,
            num_blocks * block_size,
            config.num_key_value_heads,
            config.head_dim,
        )
        # NOTE: `zero` is needed by attention that reads whole blocks (padding included) and masks
        # afterwards: uninitialised memory could hold NaN, and 0 * NaN = NaN. The C kernel reads only
        # written slots, so it skips the page-touching fill and memory is committed as blocks are used.
        self.storage = (
            torch.zeros(shape, dtype=dtype, device=device)
            if zero
            else torch.empty(shape, dtype=dtype, device=device)
        )
        self.k = [self.storage[i, 0] for i in range(config.num_hidden_layers)]
        self.v = [self.storage[i, 1] for i in range(config.num_hidden_layers)]

    @property
    def num_bytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()


def blocks_per_sequence(max_seq_len: int, block_size: int) -> int:
    return math.ceil(max_seq_len / block_size)
