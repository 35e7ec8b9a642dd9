"""The engine's side of the MoE blocks: loss scaling, routing statistics per step, and the
aux-loss-free balancing bias.

Per optimizer step every MoE block of this rank reports what it routed (`MoE.take_stats`);
one uncounted all-reduce over the world sums the blocks' tables, so every rank sees, for each
MoE layer of the model, the assignments per expert of the whole global batch. A table is
counted once per distinct set of tokens: blocks whose forwards ran alike on several ranks
(tensor parallelism's replicated tokens, `MoE.aux_replicas` of them) divide their share.

From those tables: tokens per expert (summed over layers), the imbalance (the busiest
expert's assignments over the mean: 1.0 is perfect balance) per layer, dropped assignments
(capacity factor), and the load-balancing and z-losses (means per forward, averaged over
layers, without their coefficients: the balance loss is 1.0 at perfect balance). The balancing
bias of each layer moves against that layer's global load, identically on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from llmopt.models.config import ModelConfig
from llmopt.models.experts import MoE
from llmopt.parallel.grid import RankGrid


def moe_blocks(modules: Iterable[nn.Module]) -> list[MoE]:
    """The MoE blocks inside `modules` (a rank's pipeline stages), each once, by layer."""
    found = {id(m): m for module in modules for m in module.modules() if isinstance(m, MoE)}
    return sorted(found.values(), key=lambda m: m.layer_idx)


def set_aux_scale(blocks: Sequence[MoE], num_microbatches: int, cp: int = 1) -> None:
    """Each micro-batch's auxiliary losses enter backward at 1/m: the step minimises their
    mean over micro-batches (data parallelism then averages over replicas). Under context
    parallelism each of the cp ranks holds a share of a forward's losses and gradients are
    averaged over dp x cp, so the shares enter at cp/m."""
    for block in blocks:
        block.aux_scale = cp / num_microbatches


@torch.no_grad()
def step_routing(
    blocks: Sequence[MoE],
    grid: RankGrid,
    config: ModelConfig,
    forwards: int,
    device: torch.device,
    update_bias: bool = True,
) -> dict[str, object]:
    """Collective over the world (for a model with experts): this step's routing statistics
    (module docstring), then the balancing biases moved and every block's statistics reset.
    `forwards`: forwards of each MoE layer per step over the model replicas (dp x
    micro-batches)."""
    if config.moe is None:
        return {}
    experts = config.moe.num_experts
    table = torch.zeros(config.num_layers, experts + 3, dtype=torch.float64, device=device)
    for block in blocks:
        stats = block.take_stats(device)
        row = table[block.layer_idx]
        row[:experts] += stats["routed"].to(device, torch.float64)
        row[experts] += stats["dropped"]
        row[experts + 1] += stats["aux_loss"].to(device)
        row[experts + 2] += stats["z_loss"].to(device)
        row /= block.aux_replicas
    with grid.counter.paused():
        grid.world.all_reduce(table)
    layers = [i for i in range(config.num_layers) if table[i, :experts].sum() > 0]
    if not layers:
        return {}
    routed = table[layers, :experts]
    if update_bias:
        for block in blocks:
            block.update_bias(table[block.layer_idx, :experts])
    imbalance = routed.max(dim=1).values / routed.mean(dim=1)
    per_forward = table[layers, experts + 1 :] / max(forwards, 1)
    return {
        "moe_aux_loss": per_forward[:, 0].mean().item(),
        "moe_z_loss": per_forward[:, 1].mean().item(),
        "moe_imbalance": imbalance.mean().item(),
        "moe_max_imbalance": imbalance.max().item(),
        "moe_dropped_fraction": (table[layers, experts].sum() / routed.sum()).item(),
        "moe_tokens_per_expert": [int(v) for v in routed.sum(dim=0).round().tolist()],
    }
