"""Tensor parallelism (Megatron-LM) and sequence parallelism, applied to the plain model.

`apply_tensor_parallel(model, tp, sequence_parallel)` shards the model in place and returns
it. The linear layers stay `nn.Linear` (so later conversions such as FP8 still find them); only
their weights shrink, and the communication is attached with module hooks:

- the architecture's column-parallel linears (Llama: q/k/v, gate/up) and the LM head are
  *column parallel* (output features split; whole heads per rank, KV heads split the same way
  so grouped-query attention stays local);
- its row-parallel linears (Llama: the attention output and down projections) split input
  features and their partial outputs are summed: all-reduce (``g``), or with sequence
  parallelism a reduce-scatter along the sequence;
- each norm's output enters the column-parallel layers through ``f`` (identity forward,
  all-reduce of the input gradient backward), or with sequence parallelism through an
  all-gather along the sequence (reduce-scatter backward);
- the embedding is vocab parallel (out-of-shard ids contribute zeros, then a sum), and the
  loss is a vocab-parallel cross-entropy: full logits never exist on one rank.

With sequence parallelism the norms run on sequence shards, so each rank's norm-weight
gradient covers only its tokens; a gradient hook sums it over the TP group (the bug class of
Megatron #1446). Replicated parameters are marked `tp_replicated=True` so gradient-norm
clipping counts them once; sharded ones carry `tp_dim`. Which module is which comes from the
model's `ModelSpec` (`llmopt.models.spec`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.models.experts import MoE
from llmopt.models.llama import Transformer
from llmopt.models.spec import spec_for
from llmopt.parallel.comm import Group
from llmopt.parallel.grid import tp_split_sizes

SEQ_DIM = 1  # activations are [batch, seq, hidden]


# ---- the conjugate communication operators ----
class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.group.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        x = x.contiguous().clone()
        group.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return group.all_gather(x, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.reduce_scatter(grad, dim=SEQ_DIM), None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return group.reduce_scatter(x, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.all_gather(grad, dim=SEQ_DIM), None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if group.size > 1 else x


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if group.size > 1 else x


def gather_from_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _GatherFromSP.apply(x, group) if group.size > 1 else x


def reduce_scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _ReduceScatterToSP.apply(x, group) if group.size > 1 else x


# ---- vocab-parallel embedding and loss ----
class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + rows) of the embedding; others' ids give zeros."""

    def __init__(self, weight_shard: torch.Tensor, start: int, group: Group, sp: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight_shard)
        self.weight.tp_dim = 0
        self.start = start
        self.group = group
        self.sequence_parallel = sp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.start
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.group)
        return reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits [N, V/tp] (3 small all-reduces)."""

    @staticmethod
    def forward(ctx, logits, targets, group: Group, start: int):
        logits = logits.float()
        rows = logits.shape[-1]
        max_logit = logits.max(dim=-1).values
        group.all_reduce(max_logit, op="max")
        shifted = logits - max_logit.unsqueeze(-1)
        local = targets - start
        inside = (local >= 0) & (local < rows)
        local = local.clamp(0, rows - 1)
        predicted = shifted.gather(1, local.unsqueeze(1)).squeeze(1) * inside
        group.all_reduce(predicted)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        group.all_reduce(sum_exp)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, inside)
        return sum_exp.log() - predicted

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, inside = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= inside.to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: Group, start: int
) -> torch.Tensor:
    """Mean cross-entropy over tokens of vocab-sharded logits [..., V/tp]."""
    flat = logits.reshape(-1, logits.shape[-1])
    per_token = _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), group, start)
    return per_token.mean()


# ---- the model transformation ----
def _shard(t: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return t.chunk(group.size, dim=dim)[group.rank].contiguous().clone()


def _shard_linear(linear: nn.Linear, dim: int, group: Group) -> None:
    weight = nn.Parameter(_shard(linear.weight.data, dim, group))
    weight.tp_dim = dim
    linear.weight = weight
    linear.in_features, linear.out_features = weight.shape[1], weight.shape[0]
    if linear.bias is not None:
        if dim == 0:
            linear.bias = nn.Parameter(_shard(linear.bias.data, 0, group))
            linear.bias.tp_dim = 0
        else:
            raise ValueError("row-parallel linear layers with a bias are not supported")


def _norm_output_hook(group: Group, sp: bool):
    def hook(module, args, output):
        return gather_from_sp(output, group) if sp else copy_to_tp(output, group)

    return hook


def _row_output_hook(group: Group, sp: bool):
    def hook(module, args, output):
        return reduce_scatter_to_sp(output, group) if sp else reduce_from_tp(output, group)

    return hook


def _sum_grad_over_tp(group: Group):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        group.all_reduce(grad)
        return grad

    return hook


def apply_tensor_parallel(
    model: Transformer, group: Group, sequence_parallel: bool = False, expert_tp: bool = True
) -> Transformer:
    """Shard `model` in place over `group` (Megatron TP, optionally with SP); returns it.
    `expert_tp=False` leaves the routed experts whole (expert parallelism then splits the
    tokens over TP: `llmopt.parallel.expert_parallel`)."""
    cfg = model.config
    tp = group.size
    for name, value in tp_split_sizes(cfg):
        if value % tp and (expert_tp or name != "expert_ffn_hidden"):
            raise ValueError(f"tp={tp} does not divide {name}={value}")
    if tp > 1 and cfg.mla is not None:
        raise ValueError(
            f"tp={tp} with latent attention (MLA) is not supported: its low-rank projections "
            "would need their partial gradients summed over TP; use tp=1 (ep, pp, dp work)"
        )
    model.tp_group = group
    model.sequence_parallel = sequence_parallel and tp > 1
    if tp == 1:
        for p in model.parameters():
            p.tp_replicated = True
        return model
    sp = model.sequence_parallel
    spec = spec_for(model)
    norms, branch_norms = [], []
    whole = spec.experts + "." if spec.experts and not expert_tp else None
    for _, block in spec.named_blocks(model):
        moe = _moe_of(block, spec)
        for name, linear in spec.named_block_modules(block, spec.column_parallel):
            if whole is None or not name.startswith(whole):
                _shard_linear(linear, 0, group)
        for name, linear in spec.named_block_modules(block, spec.row_parallel):
            if whole is not None and name.startswith(whole):
                continue
            _shard_linear(linear, 1, group)
            if moe is None or not name.startswith(spec.feed_forward + "."):
                linear.register_forward_hook(_row_output_hook(group, sp))
        if moe is not None:
            _shard_moe(moe, group, sp, expert_tp)
        attention = spec.block_module(block, spec.attention)
        attention.num_heads //= tp
        attention.num_kv_heads //= tp
        for name, norm in spec.named_block_modules(block, spec.block_norms):
            # a token-split MoE reads its sequence shard as it is (no SP gather)
            local = moe is not None and sp and not expert_tp and name == spec.feed_forward_norm
            (branch_norms if name in spec.branch_norms or local else norms).append(norm)
        for _, norm in spec.named_block_modules(block, spec.head_norms):
            norm.weight.tp_replicated = True  # each rank sees its own heads: sum the grads
            norm.weight.register_hook(_sum_grad_over_tp(group))
    final_norm = spec.top_module(model, "final_norm")
    if final_norm is not None:
        norms.append(final_norm)
    for norm in norms:
        norm.register_forward_hook(_norm_output_hook(group, sp))
        norm.weight.tp_replicated = True
        if sp:
            norm.weight.register_hook(_sum_grad_over_tp(group))
    for norm in branch_norms:  # on the residual's layout already: no gather / copy hook
        norm.weight.tp_replicated = True
        if sp:  # each rank normalised its own tokens
            norm.weight.register_hook(_sum_grad_over_tp(group))
    rows = cfg.vocab_size // tp
    embedding = spec.top_module(model, "embedding")
    if embedding is not None:
        embedding = VocabParallelEmbedding(
            _shard(embedding.weight.data, 0, group), group.rank * rows, group, sp
        )
        setattr(model, spec.embedding, embedding)
    head = spec.top_module(model, "head")
    if head is not None and cfg.tie_embeddings and embedding is not None:
        head.weight = embedding.weight
        head.out_features = rows
    elif head is not None:
        _shard_linear(head, 0, group)
    model.vocab_start = group.rank * rows
    return model


def _moe_of(block: nn.Module, spec) -> MoE | None:
    ff = spec.block_module(block, spec.feed_forward)
    return ff if isinstance(ff, MoE) else None


def _shard_moe(moe: MoE, group: Group, sp: bool, expert_tp: bool) -> None:
    """A MoE block's experts are split like the dense MLP (Megatron's expert TP = tp): each
    rank's experts and shared experts give partial outputs, summed once at the block's output
    (not per expert). The replicated router (and Qwen2-MoE's shared-expert gate) then see
    partial gradients through those partial outputs: summed over TP like the head norms. The
    auxiliary losses, computed alike on every rank, enter each rank's backward at 1/tp, so
    the input-gradient all-reduce sums them to one. Whole experts (`expert_tp=False`): the
    TP ranks route disjoint tokens, so the router's gradients are partial sums over tokens
    (summed the same way) and the block reduces its own shared-expert output."""
    if expert_tp:
        moe.register_forward_hook(_row_output_hook(group, sp))
        moe.aux_replicas = group.size
    replicated = [moe.gate.weight]
    if hasattr(moe, "shared_expert_gate"):
        replicated.append(moe.shared_expert_gate.weight)
    for weight in replicated:
        weight.tp_replicated = True
        weight.register_hook(_sum_grad_over_tp(group))


def lm_loss_from_hidden(
    model: Transformer, hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross-entropy from final hidden states, TP-aware (fp32 softmax)."""
    logits = spec_for(model).top_module(model, "head")(hidden)
    group: Group | None = getattr(model, "tp_group", None)
    if group is not None and group.size > 1:
        return vocab_parallel_cross_entropy(logits, targets, group, model.vocab_start)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lm_loss(model: Transformer, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of `model` on tokens [B, T] against targets [B, T]."""
    return lm_loss_from_hidden(model, model.hidden_states(tokens), targets)


@torch.no_grad()
def gather_tp_tensor(param: torch.Tensor, group: Group) -> torch.Tensor:
    """The full tensor of a TP-sharded parameter (itself if replicated)."""
    dim = getattr(param, "tp_dim", None)
    if dim is None or group.size == 1:
        return param.detach()
    return group.all_gather(param.detach(), dim=dim)
