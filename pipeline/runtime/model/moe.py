"""Sparse MoE block (Mixtral, Qwen3-MoE): a softmax router picks each token's top-k experts; their SwiGLU
outputs, weighted by the router's probabilities, are summed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.runtime.model.weights import MoEWeights


def moe_forward(x: torch.Tensor, moe: MoEWeights) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden], in transformers' order: probabilities in fp32, top-k, optionally
    renormalized; experts in ascending order, each adding its weighted rows."""
    probs = torch.softmax(F.linear(x, moe.router), dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = torch.topk(probs, moe.num_experts_per_tok, dim=-1)  # [T, k]
    if moe.normalize_top_k:
        weights /= weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    if x.shape[0] == 1:  # one token (decode off the fused path): its k experts, without regrouping
        return _one_row(x, moe, weights, experts)
    out = torch.zeros_like(x)
    # One pass over the (token, slot) pairs sorted by expert, instead of a mask per expert.
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(moe.gate_up)).tolist()
    tokens = order // moe.num_experts_per_tok
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        picked = order[start : start + count]
        start += count
        y = _expert(moe, expert, x.index_select(0, rows))
        out.index_add_(0, rows, y * weights.flatten()[picked, None])
    return out


def _expert(moe: MoEWeights, expert: int, x: torch.Tensor) -> torch.Tensor:
    gate_up = moe.gate_up[expert](x)  # [n, 2 * inter]
    inter = gate_up.shape[1] // 2
    return moe.proj[expert](F.silu(gate_up[:, :inter]) * gate_up[:, inter:])  # [n, hidden]


def _one_row(x: torch.Tensor, moe: MoEWeights, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The grouped pass's result for x [1, hidden], bit for bit, without its index arithmetic: index_add_ of
    the lone row is add_."""
    out = torch.zeros_like(x)
    for expert, slot in sorted((e, slot) for slot, e in enumerate(experts[0].tolist())):
        out.add_(_expert(moe, expert, x) * weights[:, slot : slot + 1])
    return out
