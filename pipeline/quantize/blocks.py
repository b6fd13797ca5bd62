"""What the block-by-block quantizers share: a decoder block's shape, per-block facts, the progress bar."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.runtime.model.weight_names import LAYER_LINEARS


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @classmethod
    def of(cls, pretrained: dict[str, Any]) -> Shape:
        return cls(
            pretrained["num_attention_heads"],
            pretrained["num_key_value_heads"],
            pretrained["head_dim"],
            pretrained["intermediate_size"],
        )

    @property
    def v_rows(self) -> slice:
        """The v projection's rows inside attention.qkv (q, then k, then v)."""
        d = self.head_dim
        return slice((self.heads + self.kv_heads) * d, (self.heads + 2 * self.kv_heads) * d)

    def per_kv_column(self, per_head_column: torch.Tensor) -> torch.Tensor:
        """[heads * d] -> [kv_heads, heads / kv_heads, d]: the columns that one v row feeds, side by side."""
        return per_head_column.view(self.kv_heads, self.heads // self.kv_heads, self.head_dim)

    def tie_heads(self, per_head_column: torch.Tensor) -> torch.Tensor:
        """Average over the heads of each KV group, so every column fed by one v row gets one value."""
        grouped = self.per_kv_column(per_head_column)
        return grouped.mean(1, keepdim=True).expand_as(grouped).reshape(-1)


def progress_bar(items: Iterable[Any], pretrained: dict[str, Any], desc: str, progress: bool) -> Any:
    """A tqdm bar over the blocks of the model, on stderr like the other stages' bars."""
    from tqdm import tqdm

    return tqdm(
        items,
        total=pretrained["num_hidden_layers"],
        desc=desc,
        unit="layer",
        file=sys.stderr,
        disable=not progress,
    )


class BlockFacts:
    """Per linear layer, facts gathered block by block: the error of the result relative to
    round-to-nearest (reported as the geometric mean over blocks) and any per-block values."""

    def __init__(self) -> None:
        self.log_ratios: dict[str, list[float]] = {name: [] for name in LAYER_LINEARS}
        self.values: dict[str, dict[str, list[float]]] = {}

    def add(self, bar: Any, error_ratios: dict[str, float], **values: dict[str, float]) -> None:
        for name, ratio in error_ratios.items():
            self.log_ratios[name].append(math.log(ratio))
        for key, per_layer in values.items():
            for name, value in per_layer.items():
                self.values.setdefault(key, {n: [] for n in LAYER_LINEARS})[name].append(value)
        bar.set_postfix_str(
            "error vs RTN " + " ".join(f"{error_ratios[n]:.2f}" for n in LAYER_LINEARS), refresh=False
        )

    def summary(self) -> dict[str, Any]:
        return {
            **self.values,
            "error_vs_round_to_nearest": {
                name: round(math.exp(sum(v) / len(v)), 4) if v else None
                for name, v in self.log_ratios.items()
            },
        }
