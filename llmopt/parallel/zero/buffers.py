"""Flat parameter buffers: the storage every ZeRO stage works on.

The parameters of a model are regrouped into *units*: one per transformer block plus a root
unit (everything outside the blocks: embedding, final norm, head). A unit keeps its parameters
as views into one flat buffer in the compute dtype, padded to a multiple of the DP size so it
splits into equal shards, and an fp32 *master* (full or one shard) that the optimizer updates.
The unit is also the gradient bucket and the ZeRO-3 gather unit. What a stage does with these
buffers (all-reduce or reduce-scatter, when, what it keeps) lives in `llmopt.parallel.zero.stages`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

ROOT = "root"  # the unit of every parameter outside the blocks
EXPERTS = ".experts"  # suffix of a block's routed-expert unit (parameters marked `expert`)


@dataclass
class Slot:
    """Where one parameter lives in its unit's flat buffer."""

    name: str
    param: nn.Parameter
    start: int
    numel: int
    shape: torch.Size


@dataclass
class Unit:
    """A group of parameters sharing one flat buffer, and its reduction state."""

    name: str
    slots: list[Slot]
    numel: int
    padded: int
    flat: torch.Tensor  # compute dtype, `padded` elements (storage freed while ZeRO-3 shards)
    master: nn.Parameter | None = None  # fp32: full or this rank's shard (set by the stage)
    shard: torch.Tensor | None = None  # ZeRO-3: this rank's parameter shard, compute dtype
    grad: torch.Tensor | None = None  # full padded accumulation buffer (reduce dtype)
    grad_shard: torch.Tensor | None = None  # reduce-scatter output of the launch in flight
    grad_accum: torch.Tensor | None = None  # fp32 sum of the reduced shards so far
    ready: int = 0  # parameters whose gradient of this backward has arrived
    work: object | None = None  # the reduction in flight
    gathered: bool = True
    gather_work: object | None = None
    launched: bool = False
    index: int = 0  # position among its stage's block units (ZeRO-3 prefetch order)
    stage: object | None = None  # the ZeroStage that reduces and shards it

    @property
    def is_root(self) -> bool:
        return self.name == ROOT

    def new_grad(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.padded, dtype=dtype, device=self.flat.device)


def group_parameters(
    model: nn.Module, blocks: Sequence[nn.Module]
) -> list[tuple[str, list[tuple[str, nn.Parameter]], int | None]]:
    """(unit name, [(parameter name, parameter)], block index or None) in order of first
    appearance in `model`: `layers.<i>` for the parameters of blocks[i] (its routed experts,
    marked `expert`, apart in `layers.<i>.experts`), `root` for all others."""
    block_of = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    index: dict[str, int | None] = {}
    for name, param in model.named_parameters():
        block = block_of.get(id(param))
        key = ROOT if block is None else f"layers.{block}"
        if block is not None and getattr(param, "expert", False):
            key += EXPERTS
        groups.setdefault(key, []).append((name, param))
        index[key] = block
    return [(key, params, index[key]) for key, params in groups.items()]


def build_unit(
    name: str, params: Iterable[tuple[str, nn.Parameter]], dp_size: int, dtype: torch.dtype
) -> tuple[Unit, torch.Tensor]:
    """Move `params` into one flat buffer (their `.data` become views of it).

    Returns the unit and the fp32 copy of its values (a stage cuts its master from it; for
    fp32 parameters it *is* the flat buffer)."""
    slots, offset = [], 0
    for pname, p in params:
        slots.append(Slot(pname, p, offset, p.numel(), p.shape))
        offset += p.numel()
    padded = math.ceil(offset / dp_size) * dp_size
    full32 = torch.zeros(padded, dtype=torch.float32, device=slots[0].param.device)
    for s in slots:
        full32[s.start : s.start + s.numel] = s.param.detach().reshape(-1).float()
    flat = full32.to(dtype)
    for s in slots:
        s.param.data = flat[s.start : s.start + s.numel].view(s.shape)
    return Unit(name, slots, offset, padded, flat), full32


def shard_range(padded: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of rank's equal shard of a padded buffer."""
    per = padded // size
    return rank * per, (rank + 1) * per


def overlap(slot: Slot, lo: int, hi: int) -> tuple[int, int] | None:
    """The part of `slot` inside [lo, hi), in the coordinates of that range."""
    a, b = max(lo, slot.start), min(hi, slot.start + slot.numel)
    return (a - lo, b - lo) if a < b else None
