"""The MoE block: the feed-forward of the blocks a config makes sparse.

    routing = gate(x)                          # top_k experts and weights per token (fp32)
    x_sorted = x[tokens sorted by expert]      # permute (assignments beyond capacity dropped)
    y_sorted = experts(exchange(x_sorted))     # grouped GEMM over the held experts
    y = sum_k weight_k * y_sorted[...]         # exchange back, unpermute, combine
    y += shared_experts(x) [* sigmoid(shared_expert_gate(x))]

Parameter names are HF's layout for Qwen-MoE / DeepSeek (`mlp.gate.weight`,
`mlp.experts.N.gate_proj.weight`, `mlp.shared_experts.*`; the spec's `hf_renames` map
Mixtral's `block_sparse_moe.experts.N.w1` and Qwen2-MoE's `shared_expert`), so checkpoints map
one-to-one. Nothing here knows about parallelism: expert parallelism replaces `exchange` (an
all-to-all over the expert-parallel ranks) and keeps only the local experts, and sets
`token_group` when a forward's tokens are spread over ranks, so the routing statistics the
losses need are global (`llmopt.models.experts.losses`).

Routing statistics (assignments per expert before drops, dropped assignments, the losses)
of training forwards (grad enabled) accumulate until `take_stats()`; evaluation, inference
and recomputation in backward are not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from llmopt.models.config import ConfigError, ModelConfig
from llmopt.models.experts.grouped import Experts
from llmopt.models.experts.losses import (
    balance_loss_share,
    expert_counts,
    inject,
    z_loss_share,
)
from llmopt.models.experts.router import BIAS, Router, Routing
from llmopt.models.layers import MLP
from llmopt.models.moe import is_moe_layer
from llmopt.models.spec import get_spec, registered_architectures


class LocalExchange:
    """Tokens stay on this rank: every expert is held here (no expert parallelism)."""

    def dispatch(
        self, x: torch.Tensor, counts: Sequence[int]
    ) -> tuple[torch.Tensor, Sequence[int], Any]:
        """x sorted by global expert with counts[e] rows each -> (the rows for the held
        experts sorted by held expert, their counts, state for `combine`)."""
        return x, counts, None

    def combine(self, y: torch.Tensor, state: Any) -> torch.Tensor:
        """The held experts' outputs back in `dispatch`'s input order."""
        return y


class AllTokens:
    """Every token of the forward is routed here (no rank splits the tokens)."""

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> the rows this rank routes."""
        return x

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """The routed rows' outputs -> the block's output layout."""
        return y

    def shared(self, x: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
        """The shared experts on x, in the block's output layout."""
        return mlp(x)


def _recomputing() -> bool:
    """Inside backward (activation recomputation): the forward already counted."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ConfigError(f"{config.name}: a MoE block needs config.moe")
        if config.mlp != "swiglu":
            raise ConfigError(f"mlp={config.mlp!r}: llmopt's experts are gated (swiglu) MLPs")
        self.moe = moe
        self.layer_idx = layer_idx
        self.num_experts = moe.num_experts
        self.gate = Router(config.hidden_size, moe)
        self.experts = Experts(config, moe.expert_ffn_hidden, range(moe.num_experts))
        if moe.shared_experts:
            width = moe.shared_experts * moe.shared_hidden
            self.shared_experts = MLP(config.replace(intermediate_size=width))
        if moe.shared_gate:
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        # set by the parallelisms (llmopt.parallel), defaults for one process
        self.exchange = LocalExchange()
        self.tokens = AllTokens()
        self.token_group: Callable[[torch.Tensor], None] | None = None  # in-place sum
        self.aux_scale = 1.0  # the losses' gradient (the trainer: 1 / micro-batches)
        self.aux_replicas = 1  # ranks computing the same losses (TP): each enters 1/this
        self.reset_stats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        local = self.tokens.scatter(flat)
        routing = self.gate(local)
        out = self.tokens.gather(self._routed(local, routing))
        if hasattr(self, "shared_experts"):
            out = out + self.tokens.shared(flat, self._shared)
        return self._with_losses(out.view(shape), routing)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts(x)
        if hasattr(self, "shared_expert_gate"):
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return shared

    def _routed(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        e, k = self.num_experts, routing.ids.shape[1]
        key = torch.where(routing.kept, routing.ids, e).reshape(-1)  # dropped: sorted last
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=e + 1)[:e].tolist()  # dropless needs the sizes
        order = order[: sum(counts)]
        tokens = order // k
        held, held_counts, state = self.exchange.dispatch(x[tokens], counts)
        y = self.exchange.combine(self.experts(held, held_counts), state)
        weights = routing.weights.reshape(-1)[order].unsqueeze(-1)
        if torch.is_grad_enabled() and not _recomputing():
            stats = self._current_stats(x.device)
            stats["routed"] += expert_counts(routing, e)
            stats["dropped"] += routing.ids.numel() - len(order)
            stats["forwards"] += 1
        return torch.zeros_like(x).index_add_(0, tokens, (y * weights).to(x.dtype))

    def _with_losses(self, out: torch.Tensor, routing: Routing) -> torch.Tensor:
        m = self.moe
        if not (m.aux_loss_coef or m.z_loss_coef) or not torch.is_grad_enabled():
            return out
        counts = expert_counts(routing, self.num_experts).double()
        totals = torch.cat([counts, counts.new_tensor([routing.ids.shape[0]])])
        if self.token_group is not None:
            self.token_group(totals)
        counts, tokens = totals[:-1], int(totals[-1].item())
        loss = out.new_zeros((), dtype=torch.float32)
        if m.aux_loss_coef:
            aux = balance_loss_share(routing, counts, tokens, m.top_k, m.score == "softmax")
            loss = loss + m.aux_loss_coef * aux
            if not _recomputing():
                self._current_stats(out.device)["aux_loss"] += aux.detach().double()
        if m.z_loss_coef:
            z = z_loss_share(routing, tokens)
            loss = loss + m.z_loss_coef * z
            if not _recomputing():
                self._current_stats(out.device)["z_loss"] += z.detach().double()
        return inject(out, loss, self.aux_scale / self.aux_replicas)

    # ---- routing statistics and the balancing bias ----
    def reset_stats(self) -> None:
        self._stats: dict[str, Any] | None = None

    def _current_stats(self, device: torch.device) -> dict[str, Any]:
        if self._stats is None:
            zero = torch.zeros((), dtype=torch.float64, device=device)
            self._stats = {
                "routed": torch.zeros(self.num_experts, dtype=torch.int64, device=device),
                "dropped": 0,
                "forwards": 0,
                "aux_loss": zero,
                "z_loss": zero.clone(),
            }
        return self._stats

    def take_stats(self, device: torch.device | str = "cpu") -> dict[str, Any]:
        """What the forwards since the last call routed (this rank's tokens), then reset:
        routed [E] assignments per expert, dropped assignments, forwards, and the summed
        load-balancing and z-loss values (this rank's shares, without coefficients)."""
        stats = self._current_stats(torch.device(device))
        self.reset_stats()
        return stats

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): move each expert's bias by
        `bias_update_rate` towards the mean load (`load`: assignments per expert of the
        step, over every rank's tokens)."""
        rate = self.moe.bias_update_rate
        if not rate:
            return
        bias = getattr(self.gate, BIAS)
        load = load.to(bias.device, torch.float32)
        bias.add_(rate * torch.sign(load.mean() - load))


def feed_forward(config: ModelConfig, layer_idx: int) -> nn.Module:
    """The feed-forward of block `layer_idx`: a MoE block where the config makes it sparse
    (`MoEConfig.moe_layers`: the last blocks), else the dense MLP."""
    if not is_moe_layer(config, layer_idx):
        return MLP(config)
    if not get_spec(config.architecture).experts:
        moe_archs = [a for a in registered_architectures() if get_spec(a).experts]
        raise ConfigError(
            f"{config.name}: architecture {config.architecture!r} has no MoE block; a config "
            f"with experts needs one of {', '.join(moe_archs)}"
        )
    return MoE(config, layer_idx)


def set_routing(model: nn.Module, config: ModelConfig) -> None:
    """Give a built model `config`'s routing settings (losses, capacity, bias rate): the same
    experts, so only the MoEConfig changes; shapes must agree."""
    old = model.config.moe
    if old is None or config.moe == old:
        model.config = config
        return
    shape = ("num_experts", "expert_ffn_hidden", "moe_layers", "shared_experts", "expert_bias")
    changed = [f for f in shape if getattr(old, f) != getattr(config.moe, f)]
    if changed:
        raise ConfigError(f"MoE fields {changed} change the model's experts: build a new model")
    for module in model.modules():
        if isinstance(module, MoE):
            module.moe = module.gate.moe = config.moe
    model.config = config
