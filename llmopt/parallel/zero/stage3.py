"""ZeRO stage 3: parameters sharded as well, gathered one unit at a time.

A block's unit is all-gathered just before its forward (the next one is prefetched), freed
after it, all-gathered again just before its backward (the previous one prefetched), and freed
once its gradient is reduce-scattered (every micro-batch, as in stage 2). The root unit
(embedding, final norm, head: needed first in forward and last in backward) stays gathered
from its first use until the parameter update.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.parallel.comm import Group
from llmopt.parallel.zero.buffers import Unit
from llmopt.parallel.zero.stages import ZeroStage2


class _PreBackwardGather(torch.autograd.Function):
    """Identity at a block's output whose backward re-gathers the block's parameters before
    any of the block's own backward runs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stage: ZeroStage3, unit: Unit) -> torch.Tensor:
        ctx.stage, ctx.unit = stage, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.stage.gather(ctx.unit)
        ctx.stage.prefetch(ctx.unit.index - 1)
        return grad, None, None


class ZeroStage3(ZeroStage2):
    stage = 3

    def __init__(
        self,
        dp: Group,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        prefetch: bool = True,
        divisor: int | None = None,
    ) -> None:
        super().__init__(dp, param_dtype, reduce_dtype, divisor)
        self.prefetch_enabled = prefetch  # gather the next block while this one computes
        self.blocks: list[Unit] = []
        self.root: Unit | None = None

    def init_unit(self, unit: Unit, full32: torch.Tensor) -> None:
        super().init_unit(unit, full32)
        lo, hi = self.local_range(unit)
        unit.shard = unit.flat[lo:hi].clone()

    def attach(
        self, model: nn.Module, placed: list[tuple[Unit, nn.Module]], root: Unit | None
    ) -> None:
        self.blocks = [unit for unit, _ in placed]
        self.root = root
        if root is not None:
            model.register_forward_pre_hook(lambda mod, args: self.prepare_forward())
            embedding = _embedding_of(model)
            if embedding is not None:  # callers may skip the model's forward (hidden states)
                embedding.register_forward_pre_hook(lambda mod, args: self.prepare_forward())
        for unit, block in placed:
            block.register_forward_pre_hook(self._pre_forward(unit))
            block.register_forward_hook(self._post_forward(unit))
        for unit in [*self.blocks, *([root] if root is not None else [])]:
            self.free(unit)

    def prepare_forward(self) -> None:
        if self.root is not None:
            self.gather(self.root)

    def _pre_forward(self, unit: Unit):
        def hook(module, args):
            self.gather(unit)
            self.prefetch(unit.index + 1)

        return hook

    def _post_forward(self, unit: Unit):
        def hook(module, args, output):
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                self.free(unit)
                return _PreBackwardGather.apply(output, self, unit)
            if not torch.is_grad_enabled():
                self.free(unit)
            return output

        return hook

    def prefetch(self, index: int) -> None:
        if self.prefetch_enabled and 0 <= index < len(self.blocks):
            self.gather(self.blocks[index], async_op=True)

    def gather(self, unit: Unit, async_op: bool = False) -> None:
        if unit.gather_work is not None:
            if not async_op:
                unit.gather_work.wait()
                unit.gather_work = None
            return
        if unit.gathered:
            return
        unit.flat.untyped_storage().resize_(unit.padded * unit.flat.element_size())
        work = self.dp.all_gather_into(unit.flat, unit.shard, async_op=async_op)
        unit.gathered = True
        unit.gather_work = work if async_op else None

    def free(self, unit: Unit) -> None:
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None
        unit.flat.untyped_storage().resize_(0)
        unit.gathered = False

    def launch(self, unit: Unit) -> None:
        super().launch(unit)
        if not unit.is_root:  # the root stays gathered for the step
            self.free(unit)

    @torch.no_grad()
    def update(self, unit: Unit) -> None:
        unit.shard.copy_(unit.master)
        self.free(unit)


def _embedding_of(model: nn.Module) -> nn.Module | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    from llmopt.models.spec import UnknownArchitectureError, spec_for

    try:
        return spec_for(model).top_module(model, "embedding")
    except UnknownArchitectureError:
        return None
