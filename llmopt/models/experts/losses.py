"""The router's auxiliary losses and how their gradients enter backward.

- Load balancing (Switch Transformer / GShard form): coef * E * sum_e f_e * P_e, where f_e is
  the fraction of the forward's token-expert assignments routed to expert e (top_k per token,
  before capacity drops) and P_e the mean router probability of e over the tokens (sigmoid
  scores are first normalised per token, as Megatron does for DeepSeek-V3's router).
- Router z-loss (ST-MoE): coef * mean_t logsumexp(logits_t)^2.

Both are means over the forward's tokens. When those tokens are split over ranks (sequence
or context parallelism, expert-parallel token shards) each rank computes its *share*: the
counts f_e and the token total are global (summed over `group`, outside autograd: f_e is not
differentiable anyway), the probability sums local, so the shares add up to the loss of the
whole forward and no collective enters backward.

The losses never touch the language-model loss tensor: `inject` attaches them to the MoE
block's output (Megatron's MoEAuxLossAutoScaler), whose backward hands each loss the gradient
`scale`. That works on every pipeline stage (the loss tensor lives on the last one) and under
activation recomputation. The trainer sets `scale` to 1/micro-batches so the step minimises
the mean over micro-batches (and data-parallel averaging makes it the mean over replicas).
"""

from __future__ import annotations

import torch

from llmopt.models.experts.router import Routing


def expert_counts(routing: Routing, num_experts: int) -> torch.Tensor:
    """Assignments per expert [E] (int64) of one forward, before capacity drops."""
    return torch.bincount(routing.ids.reshape(-1), minlength=num_experts)


def balance_loss_share(
    routing: Routing, counts: torch.Tensor, tokens: int, top_k: int, softmax: bool
) -> torch.Tensor:
    """This rank's share of the load-balancing loss (without its coefficient): `counts` and
    `tokens` are the forward's global assignments per expert and token count."""
    probs = routing.scores if softmax else routing.scores / routing.scores.sum(-1, keepdim=True)
    f = counts.to(probs.dtype) / (tokens * top_k)
    return probs.shape[-1] * (f * probs.sum(dim=0)).sum() / tokens


def z_loss_share(routing: Routing, tokens: int) -> torch.Tensor:
    """This rank's share of the router z-loss (without its coefficient)."""
    return torch.logsumexp(routing.logits, dim=-1).square().sum() / tokens


class _Inject(torch.autograd.Function):
    """Identity on the block output; backward gives `loss` the gradient `scale`."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def inject(out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """`out`, with `loss` (a scalar) added to what backward differentiates, times `scale`."""
    if not (torch.is_grad_enabled() and loss.requires_grad and scale):
        return out
    return _Inject.apply(out, loss, scale)
