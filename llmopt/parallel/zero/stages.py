"""ZeRO stages 0-3 as strategies over the flat buffers of `llmopt.parallel.zero.buffers`.

Each stage answers the same few questions, so `DataParallel` never asks which stage it runs:
where this rank's master lives (`local_range`), how a finished gradient bucket is reduced
(`launch`), what the optimizer then sees (`collect`) and how updated masters return to the
compute parameters (`update`). Rajbhandari et al.'s stages, each a small step from the last:

- 0: gradients all-reduced; every rank holds the full master and optimizer state (DDP).
- 1: gradients reduce-scattered once per step (Megatron's distributed optimizer): each rank
  receives the 1/dp shard it updates, then the updated parameters are all-gathered. Half the
  bytes of an all-reduce, same result on the shard; optimizer state 1/dp.
- 2: gradients reduce-scattered every micro-batch and summed into an fp32 shard, so no rank
  holds a full gradient across accumulation (DeepSpeed stage 2); `no_sync()` is ignored.
- 3: parameters sharded too (`llmopt.parallel.zero.stage3`).

`llmopt.parallel.zero.data_parallel.make_stage(zero, ...)` picks the class.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from llmopt.parallel.comm import Group
from llmopt.parallel.zero.buffers import Unit, shard_range

ZERO_STAGES = (0, 1, 2, 3)


class ZeroStage:
    """Stage 0: replicated masters, gradients all-reduced once per step."""

    stage: ClassVar[int] = 0
    sharded: ClassVar[bool] = False  # masters and optimizer state are 1/dp per rank
    reduce_every_microbatch: ClassVar[bool] = False  # ignores no_sync()

    def __init__(
        self,
        dp: Group,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        divisor: int | None = None,
    ) -> None:
        self.dp = dp
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        # gradients are averaged by this (the model replicas: experts reduce over fewer ranks)
        self.divisor = dp.size if divisor is None else divisor

    @property
    def grad_views(self) -> bool:
        """Parameter .grad is a view of the bucket (DDP's gradient_as_bucket_view): no copy.
        Only where the dtypes agree and the full buffer lives for the whole step."""
        return self.param_dtype == self.reduce_dtype and not self.reduce_every_microbatch

    def local_range(self, unit: Unit) -> tuple[int, int]:
        return 0, unit.padded

    def init_unit(self, unit: Unit, full32: torch.Tensor) -> None:
        if unit.flat.data_ptr() == full32.data_ptr():
            unit.master = nn.Parameter(full32)  # fp32: the parameters are the masters
        else:
            unit.master = nn.Parameter(full32.clone())

    def attach(
        self, model: nn.Module, placed: list[tuple[Unit, nn.Module]], root: Unit | None
    ) -> None:
        """Install whatever the stage needs around forward/backward (ZeRO-3 only): `placed`
        are this stage's block units with their blocks, `root` the unit outside them."""

    def prepare_forward(self) -> None:
        """Make the parameters the first forward computation needs present (ZeRO-3 only)."""

    def launch(self, unit: Unit) -> None:
        unit.grad.div_(self.divisor)
        unit.work = self.dp.all_reduce(unit.grad, async_op=True)

    def _local_grad(self, unit: Unit, local: torch.Tensor) -> torch.Tensor:
        if not self.grad_views:
            unit.grad = None
        # No copy in fp32: the master's gradient is (a view of) the reduced buffer.
        return local.float() if local.dtype != torch.float32 else local

    def collect(self, unit: Unit) -> torch.Tensor:
        """Wait for the unit's reduction; this rank's fp32 reduced gradient (master layout)."""
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        return self._local_grad(unit, unit.grad)

    @torch.no_grad()
    def update(self, unit: Unit) -> None:
        if unit.flat.data_ptr() != unit.master.data_ptr():
            unit.flat.copy_(unit.master)

    def gather_full(self, unit: Unit, local: torch.Tensor) -> torch.Tensor:
        """A tensor in the master's layout, made full (padded) on every rank."""
        return local


class ZeroStage1(ZeroStage):
    """Sharded masters: one reduce-scatter per step, all-gather of the updated shard."""

    stage = 1
    sharded = True

    def local_range(self, unit: Unit) -> tuple[int, int]:
        return shard_range(unit.padded, self.dp.rank, self.dp.size)

    def init_unit(self, unit: Unit, full32: torch.Tensor) -> None:
        lo, hi = self.local_range(unit)
        unit.master = nn.Parameter(full32[lo:hi].clone())

    def launch(self, unit: Unit) -> None:
        unit.grad.div_(self.divisor)
        unit.grad_shard = torch.empty(
            unit.padded // self.dp.size, dtype=self.reduce_dtype, device=unit.grad.device
        )
        unit.work = self.dp.reduce_scatter_into(unit.grad_shard, unit.grad, async_op=True)

    def collect(self, unit: Unit) -> torch.Tensor:
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        local, unit.grad_shard = unit.grad_shard, None
        return self._local_grad(unit, local)

    @torch.no_grad()
    def update(self, unit: Unit) -> None:
        self.dp.all_gather_into(unit.flat, unit.master.detach().to(self.param_dtype))

    def gather_full(self, unit: Unit, local: torch.Tensor) -> torch.Tensor:
        full = torch.empty(unit.padded, dtype=local.dtype, device=local.device)
        self.dp.all_gather_into(full, local.contiguous())
        return full


class ZeroStage2(ZeroStage1):
    """Sharded gradients: every micro-batch reduce-scatters and frees its full gradient."""

    stage = 2
    reduce_every_microbatch = True

    def launch(self, unit: Unit) -> None:
        self._fold(unit)  # the previous micro-batch's shard, before reusing the slot
        super().launch(unit)
        for slot in unit.slots:  # only the reduced shard survives
            slot.param.grad = None
        unit.grad = None

    def _fold(self, unit: Unit) -> None:
        """Wait for the reduce-scatter in flight and add it to the fp32 shard sum."""
        if unit.grad_shard is None:
            return
        if unit.work is not None:  # None on a one-rank group: the shard is already there
            unit.work.wait()
            unit.work = None
        shard = unit.grad_shard.float()  # a fresh tensor per launch: may become the sum
        unit.grad_accum = shard if unit.grad_accum is None else unit.grad_accum.add_(shard)
        unit.grad_shard = None

    def collect(self, unit: Unit) -> torch.Tensor:
        self._fold(unit)
        grad, unit.grad_accum = unit.grad_accum, None
        return grad
