"""Expert parallelism: each rank holds num_experts / ep of every MoE block's routed experts and
tokens travel to them by all-to-all (dispatch) and back (combine), over the grid's EP group.

    x_sorted [M, H] by global expert  --all-to-all-->  rows for my experts, by source rank
    regroup by local expert -> grouped GEMM -> back to source order --all-to-all--> x_sorted

Before the token rows, the per-expert counts go round (an all-to-all of E integers per rank:
routing metadata, not counted, as the planner's prediction has no such term); the row splits
follow from them, so the dispatch is dropless (or carries only what the capacity kept). The
all-to-all is differentiable: its backward is the reverse all-to-all of the gradients.

With expert TP = tp (Megatron's default) a rank's experts are additionally TP-sharded and every
TP rank routes the same tokens: each rank exchanges its micro-batch's top_k copies with the
ranks of its EP group (same TP index), the experts give partial outputs and the MoE block's
output is reduced over TP once, as a dense MLP's (`tensor_parallel`). With expert TP = 1 the
experts are whole and the TP ranks split the tokens instead (their sequence-parallel shards,
or without SP 1/tp of the rows each): each rank routes and dispatches only its share, the EP
group spans the TP ranks, and the routed output is gathered over TP afterwards; the shared
experts stay TP-sharded like a dense MLP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from llmopt.models.experts import MoE
from llmopt.parallel.comm import Group
from llmopt.parallel.grid import RankGrid
from llmopt.parallel.tensor_parallel import reduce_from_tp


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, out_splits, in_splits) -> torch.Tensor:
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        group.all_to_all(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        ctx.group.all_to_all(back, grad.contiguous(), in_splits, out_splits)
        return back, None, None, None


def all_to_all(x: torch.Tensor, group: Group, out_splits, in_splits) -> torch.Tensor:
    """Differentiable all-to-all of rows (see `Group.all_to_all`)."""
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits))


class AllToAllExchange:
    """The MoE block's `exchange` under expert parallelism (`MoE.exchange`)."""

    def __init__(self, group: Group, num_experts: int) -> None:
        self.group = group
        self.per_rank = num_experts // group.size

    def dispatch(
        self, x: torch.Tensor, counts: Sequence[int]
    ) -> tuple[torch.Tensor, list[int], Any]:
        ep, per = self.group.size, self.per_rank
        counts_t = torch.tensor(counts, dtype=torch.int64, device=x.device)
        received = torch.empty_like(counts_t)  # [source rank, my local expert] after the swap
        with self.group.counter.paused():  # routing metadata
            self.group.all_to_all(received, counts_t, [per] * ep, [per] * ep)
        table = received.view(ep, per)
        send = counts_t.view(ep, per).sum(dim=1).tolist()
        recv = table.sum(dim=1).tolist()
        rows = all_to_all(x, self.group, recv, send)
        # rows arrive by source rank, each source's by my local expert: regroup by expert
        expert_of_row = torch.repeat_interleave(
            torch.arange(per, device=x.device).repeat(ep), table.reshape(-1)
        )
        order = torch.argsort(expert_of_row, stable=True)
        return rows[order], table.sum(dim=0).tolist(), (order, send, recv)

    def combine(self, y: torch.Tensor, state: Any) -> torch.Tensor:
        order, send, recv = state
        back = torch.empty_like(y).index_copy(0, order, y)  # undo the regrouping
        return all_to_all(back, self.group, send, recv)


# ---- token layouts of expert TP = 1 under tensor parallelism (module docstring) ----
class _ScatterRows(torch.autograd.Function):
    """This TP rank's 1/tp of the (replicated) rows; backward pads with zeros (the norm's f
    all-reduce then assembles every rank's rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.rows = group, x.shape[0]
        return x.chunk(group.size)[group.rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        full.chunk(ctx.group.size)[ctx.group.rank].copy_(grad)
        return full, None


class _GatherRows(torch.autograd.Function):
    """All-gather of rows over TP; backward: this rank's rows of the gradient (`sum`: the
    reduce-scatter, when the gathered rows feed partial sums) ."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, reduce: bool) -> torch.Tensor:
        ctx.group, ctx.reduce = group, reduce
        return group.all_gather(x, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce:
            return ctx.group.reduce_scatter(grad, dim=0), None, None
        return grad.chunk(ctx.group.size)[ctx.group.rank].contiguous(), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return group.reduce_scatter(x, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.all_gather(grad, dim=0), None


class ShardedTokens:
    """`MoE.tokens` when expert TP = 1 and tp > 1: each TP rank routes its share of rows."""

    def __init__(self, group: Group, sequence_parallel: bool) -> None:
        self.group, self.sp = group, sequence_parallel

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        if self.sp:  # the block's input is already this rank's sequence shard
            return x
        if x.shape[0] % self.group.size:
            raise ValueError(
                f"{x.shape[0]} tokens do not split over tp={self.group.size} ranks for the "
                "experts; use a batch x sequence divisible by tp"
            )
        return _ScatterRows.apply(x, self.group)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.sp else _GatherRows.apply(y, self.group, False)

    def shared(self, x: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
        """The TP-sharded shared experts on every token, in the block's output layout."""
        if self.sp:
            full = _GatherRows.apply(x, self.group, True)
            return _ReduceScatterRows.apply(mlp(full), self.group)
        return reduce_from_tp(mlp(x), self.group)


def _sum_group(group: Group):
    def reduce(t: torch.Tensor) -> None:
        with group.counter.paused():  # routing statistics of the micro-batch's tokens
            group.all_reduce(t)

    return reduce


def apply_expert_parallel(model: nn.Module, grid: RankGrid, sequence_parallel: bool) -> None:
    """Give each MoE block of `model` (tensor parallelism already applied) this rank's
    experts, the all-to-all exchange and the token layout of the grid (module docstring);
    marks every routed-expert parameter `expert=True` (reduced over the EDP group)."""
    ep, etp, tp = grid.ep, grid.dims.expert_tp, grid.tp
    sharded = tp.size > 1 and etp == 1
    token_group = grid.tp_cp if sharded else grid.cp
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        if module.num_experts % ep.size:
            raise ValueError(f"ep={ep.size} does not divide num_experts={module.num_experts}")
        per = module.num_experts // ep.size
        mine = range(ep.rank * per, (ep.rank + 1) * per)
        for key in list(module.experts.keys()):
            if int(key) not in mine:
                del module.experts[key]
        if ep.size > 1:
            module.exchange = AllToAllExchange(ep, module.num_experts)
        if sharded:
            module.tokens = ShardedTokens(tp, sequence_parallel)
            module.aux_replicas = 1
        if token_group.size > 1:
            module.token_group = _sum_group(token_group)
        for p in module.experts.parameters():
            p.expert = True
