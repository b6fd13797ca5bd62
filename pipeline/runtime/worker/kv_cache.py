"""The paged KV cache: per layer a K and a V tensor of [num_blocks * tokens_per_block, kv_heads, head_dim]
(a [num_blocks, tokens_per_block, kv_heads, head_dim] block array, flattened over slots), in the compute
dtype or int8 with a [num_blocks * tokens_per_block, kv_heads] fp32 scale tensor beside each (kv_quant.py),
and how many blocks fit."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from pipeline.errors import ConfigError
from pipeline.runtime.model_config import ModelConfig
from pipeline.runtime.worker.kv_quant import SCALE_BYTES


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, int8: bool = False) -> int:
    """K and V of every layer for one block: D elements per token and head, plus its scale when int8."""
    per_head = config.head_dim + SCALE_BYTES if int8 else config.head_dim * dtype.itemsize
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * per_head


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
    int8: bool = False,
) -> int:
    """Blocks for `max_tokens` tokens if given, else for `free_memory_fraction` of the free memory, but no
    more than `max_useful_blocks` (what max_batch_size full-length sequences can use at once)."""
    if max_tokens is not None:
        blocks = max_tokens // block_size
        source = f"kv_max_tokens={max_tokens}"
    else:
        free = available_memory_bytes(device)
        blocks = min(
            int(free * free_memory_fraction) // bytes_per_block(config, block_size, dtype, int8),
            max_useful_blocks,
        )
        source = f"kv_free_memory_fraction={free_memory_fraction} of {free / 2**30:.1f} GiB free"
    if blocks < 1:
        raise ConfigError(
            f"{source} leaves no room for one KV block of {block_size} tokens",
            hint="raise kv_cache.max_tokens or kv_cache.free_memory_fraction",
        )
    return blocks


class KVCache:
    """`dtype` is the element dtype (the compute dtype, or bf16 under fp32 compute for a bf16 engine on
    CPU); with `int8` the values are int8 and `k_scales`/`v_scales` hold the scales (otherwise each layer's
    entry is None)."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        zero: bool,
        int8: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        layers = config.num_hidden_layers
        # NOTE: `zero` is needed by attention that reads whole blocks (padding included) and masks
        # afterwards: uninitialised memory could hold NaN, and 0 * NaN = NaN. The attention kernel reads only
        # written slots, so it skips the page-touching fill and memory is committed as blocks are used.
        allocate = torch.zeros if zero else torch.empty
        shape = (layers, 2, num_blocks * block_size, config.num_key_value_heads, config.head_dim)
        self.storage = allocate(shape, dtype=torch.int8 if int8 else dtype, device=device)
        self.scales = allocate(shape[:-1], dtype=torch.float32, device=device) if int8 else None
        self.k = [self.storage[i, 0] for i in range(layers)]
        self.v = [self.storage[i, 1] for i in range(layers)]
        scales = self.scales
        self.k_scales: list[torch.Tensor | None] = [
            None if scales is None else scales[i, 0] for i in range(layers)
        ]
        self.v_scales: list[torch.Tensor | None] = [
            None if scales is None else scales[i, 1] for i in range(layers)
        ]

    @property
    def int8(self) -> bool:
        return self.scales is not None

    @property
    def num_bytes(self) -> int:
        tensors = [self.storage] if self.scales is None else [self.storage, self.scales]
        return sum(t.numel() * t.element_size() for t in tensors)


def blocks_per_sequence(max_seq_len: int, block_size: int) -> int:
    return math.ceil(max_seq_len / block_size)
