"""The router of a MoE block: scores every token against every expert and picks `top_k`.

Scoring is softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3) of fp32 logits (Megatron's
fp32 router: the choice must not flip with the compute dtype). DeepSeek's group-limited routing
first keeps the `topk_groups` best groups (a group scored by the sum of its two best experts)
and picks the experts among them. The aux-loss-free balancing bias is added to the scores for
the *choice* only; the weights that scale the expert outputs are the unbiased scores (then
renormalised over the chosen k if `norm_topk`, then times `route_scale`), as in HF's
DeepseekV3TopkRouter and Megatron's `moe_router_enable_expert_bias`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.models.moe import MoEConfig

BIAS = "e_score_correction_bias"  # HF's name for the balancing bias (a buffer)


@dataclass
class Routing:
    """One forward's routing of N tokens: experts `ids` [N, k] with `weights` [N, k] (fp32),
    the fp32 `logits` and `scores` [N, E] (what the losses read) and `kept` [N, k]: the
    assignments within capacity (all of them when dropless)."""

    ids: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor
    scores: torch.Tensor
    kept: torch.Tensor


class Router(nn.Module):
    """Linear scores [N, E] of the tokens' hidden states (no bias), then top-k."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        if moe.expert_bias:
            self.register_buffer(BIAS, torch.zeros(moe.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Routing:
        m = self.moe
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if m.score == "softmax" else logits.sigmoid()
        choice = scores.detach()
        if m.expert_bias:
            choice = choice + getattr(self, BIAS)
        if m.num_groups > 1:
            choice = _limit_groups(choice, m.num_groups, m.topk_groups)
        if m.force_balance:  # round robin over the experts, whatever the scores (benchmarks)
            n = x.shape[0]
            slots = torch.arange(n, device=x.device)[:, None] * m.top_k
            ids = (slots + torch.arange(m.top_k, device=x.device)) % m.num_experts
        else:
            ids = torch.topk(choice, m.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if m.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if m.route_scale != 1.0:
            weights = weights * m.route_scale
        kept = torch.ones_like(ids, dtype=torch.bool)
        if m.capacity_factor is not None:
            kept = within_capacity(ids, weights.detach(), m.num_experts, m.capacity_factor)
        return Routing(ids, weights, logits, scores, kept)


def _limit_groups(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """-inf for the experts outside each token's `keep` best groups (a group's score: the
    sum of its two best experts)."""
    n, e = choice.shape
    grouped = choice.view(n, groups, e // groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(keep, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(n, e)


def capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Assignments one expert accepts per forward (Megatron's get_capacity):
    ceil(tokens * top_k / experts * factor), at most the tokens there are."""
    return min(num_tokens, math.ceil(num_tokens * top_k / num_experts * factor))


def within_capacity(
    ids: torch.Tensor, weights: torch.Tensor, num_experts: int, factor: float
) -> torch.Tensor:
    """[N, k] bool: the assignments each expert keeps, its `capacity` highest-weighted ones
    (Megatron's drop policy "probs")."""
    n, k = ids.shape
    cap = capacity(n, k, num_experts, factor)
    table = torch.full((n, num_experts), float("-inf"), device=ids.device)
    table.scatter_(1, ids, weights.float())
    top = table.topk(cap, dim=0).indices  # [cap, E]: each expert's best assignments
    keep = torch.zeros_like(table, dtype=torch.bool).scatter_(0, top, True)
    return (keep & torch.isfinite(table)).gather(1, ids)
