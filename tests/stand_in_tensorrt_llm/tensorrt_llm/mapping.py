"""Stand-in `tensorrt_llm.mapping.Mapping` with the 1.x constructor keywords llmpipe passes."""

from __future__ import annotations


class Mapping:
    def __init__(
        self,
        world_size: int = 1,
        rank: int = 0,
        gpus_per_node: int = 8,
        *,
        cp_size: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        moe_tp_size: int = -1,
        moe_ep_size: int = -1,
    ) -> None:
        if world_size != tp_size * pp_size * cp_size:
            raise ValueError(f"world_size {world_size} != tp {tp_size} * pp {pp_size} * cp {cp_size}")
        self.world_size, self.rank, self.tp_size, self.pp_size, self.cp_size = (
            world_size,
            rank,
            tp_size,
            pp_size,
            cp_size,
        )

    def __repr__(self) -> str:
        return f"Mapping(world_size={self.world_size}, rank={self.rank}, tp_size={self.tp_size}, pp_size={self.pp_size})"
