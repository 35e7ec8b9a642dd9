"""Data parallelism on flat per-block buffers, with the ZeRO stage as a pluggable strategy.

`DataParallel` owns what every stage shares: the units (`llmopt.parallel.zero.buffers`),
gradient hooks that launch a unit's reduction as soon as backward has produced all of its
gradients (so reductions overlap the rest of backward), gradient accumulation, the global
gradient norm, and full (gathered) views for checkpoints. The stage object
(`llmopt.parallel.zero.stages`) decides how a unit is reduced and where its master lives.
Masters are fp32 whatever the compute dtype (Megatron's convention: bf16 compute, fp32
master weights and optimizer states).

Gradient accumulation: ZeRO-0/1 inside `no_sync()` sum gradients into the full unit buffers
and communicate nothing; the last micro-batch (outside `no_sync`) launches the reductions.
ZeRO-2/3 ignore `no_sync()` (as DeepSpeed does): every micro-batch reduce-scatters. Exception:
a *held* root unit (`hold_root=True`: tied embeddings split over pipeline stages) is reduced
only in `finish_grad_sync()`, because its gradient must first be summed across stages by the
caller, on `grad_buffer(param)`.

Groups: dense units are reduced over the grid's `dp_cp` group (dp x cp ranks). Parameters
marked `expert=True` (routed experts under expert parallelism) form their own units per block
(`layers.<i>.experts`), reduced and ZeRO-sharded over the expert-data-parallel group `edp`;
both average by dp x cp, the model replicas whose tokens reached them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from llmopt.parallel.comm import Group
from llmopt.parallel.grid import RankGrid
from llmopt.parallel.tensor_parallel import gather_tp_tensor
from llmopt.parallel.zero.buffers import (
    EXPERTS,
    ROOT,
    Slot,
    Unit,
    build_unit,
    group_parameters,
    overlap,
)
from llmopt.parallel.zero.stage3 import ZeroStage3
from llmopt.parallel.zero.stages import ZERO_STAGES, ZeroStage, ZeroStage1, ZeroStage2

__all__ = ["ZERO_STAGES", "DataParallel", "make_stage"]

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STAGE_CLASSES: dict[int, type[ZeroStage]] = {0: ZeroStage, 1: ZeroStage1, 2: ZeroStage2}


def make_stage(
    zero: int,
    dp: Group,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    prefetch: bool = True,
    divisor: int | None = None,
) -> ZeroStage:
    """The strategy object of ZeRO stage `zero` over the DP group `dp` (gradients averaged
    by `divisor`, default the group's size)."""
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero={zero!r} is not a ZeRO stage; choose one of 0, 1, 2, 3")
    if zero == 3:
        return ZeroStage3(dp, param_dtype, reduce_dtype, prefetch=prefetch, divisor=divisor)
    return STAGE_CLASSES[zero](dp, param_dtype, reduce_dtype, divisor=divisor)


class DataParallel:
    """Wraps a (possibly tensor-parallel) model, or one rank's pipeline stages, for DP training.

    Use: forward/backward as usual (inside `no_sync()` for all but the last micro-batch), then
    `finish_grad_sync()`, `clip_grad_norm_()`, `optimizer.step()`, `update_params()`,
    `zero_grad()` (or `step(optimizer, max_norm)`). The optimizer owns `master_params()`.
    `blocks`: the modules that get one unit each (default: the model's transformer blocks).
    """

    def __init__(
        self,
        model: nn.Module,
        grid: RankGrid,
        zero: int = 0,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        prefetch: bool = True,
        blocks: Sequence[nn.Module] | None = None,
        hold_root: bool = False,
    ) -> None:
        if param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype={param_dtype} must be float32, bfloat16 or float16")
        self.model = model
        self.grid = grid
        self.dp = grid.dp_cp
        replicas = grid.dp_cp.size  # the model replicas every gradient averages over
        self.stage: ZeroStage = make_stage(zero, self.dp, param_dtype, reduce_dtype, prefetch)
        self.expert_stage: ZeroStage = make_stage(
            zero, grid.edp, param_dtype, reduce_dtype, prefetch, divisor=replicas
        )
        self._sync = True
        blocks = list(_default_blocks(model) if blocks is None else blocks)
        self.units: list[Unit] = []
        placed: dict[int, list[tuple[Unit, nn.Module]]] = {
            id(self.stage): [],
            id(self.expert_stage): [],
        }
        for name, params, block in group_parameters(model, blocks):
            stage = self.expert_stage if name.endswith(EXPERTS) else self.stage
            unit, full32 = build_unit(name, params, stage.dp.size, param_dtype)
            unit.stage = stage
            stage.init_unit(unit, full32)
            self.units.append(unit)
            if block is not None:
                placed[id(stage)].append((unit, blocks[block]))
        self._held = {ROOT} if hold_root else set()
        self._unit_of = {id(s.param): (u, s) for u in self.units for s in u.slots}
        for unit in self.units:
            for slot in unit.slots:
                slot.param.register_post_accumulate_grad_hook(self._on_grad_ready)
        root = next((u for u in self.units if u.is_root), None)
        for stage in (self.stage, self.expert_stage):
            for i, (unit, _) in enumerate(placed[id(stage)]):
                unit.index = i
            stage.attach(model, placed[id(stage)], root if stage is self.stage else None)
        self.zero_grad()

    # ---- what the stage is ----
    @property
    def zero(self) -> int:
        return self.stage.stage

    @property
    def param_dtype(self) -> torch.dtype:
        return self.stage.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.stage.reduce_dtype

    def master_params(self) -> list[nn.Parameter]:
        return [u.master for u in self.units]

    def prepare_forward(self) -> None:
        """Call before a forward that does not start at the model's own forward (pipeline
        stages): ZeRO-3 gathers the root unit there."""
        self.stage.prepare_forward()

    # ---- gradients ----
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (inner micro-batches): no communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        unit, slot = self._unit_of[id(param)]
        if unit.grad is None:
            unit.grad = unit.new_grad(self.reduce_dtype)
        target = unit.grad[slot.start : slot.start + slot.numel]
        if param.grad.data_ptr() != target.data_ptr():  # not (or no longer) a bucket view
            target.add_(param.grad.reshape(-1))
            param.grad = target.view(slot.shape) if unit.stage.grad_views else None
        unit.ready += 1
        if unit.ready == len(unit.slots):
            unit.ready = 0
            every = unit.stage.reduce_every_microbatch and unit.name not in self._held
            if self._sync or every:
                self._launch(unit)

    def _launch(self, unit: Unit) -> None:
        if unit.grad is None:
            unit.grad = unit.new_grad(self.reduce_dtype)
        unit.stage.launch(unit)
        unit.launched = True

    def grad_buffer(self, param: nn.Parameter) -> torch.Tensor:
        """The accumulated (not yet reduced) gradient of `param`, flat: a view into its unit's
        bucket that a caller may add to before `finish_grad_sync` (held units only)."""
        unit, slot = self._unit_of[id(param)]
        if unit.grad is None:
            unit.grad = unit.new_grad(self.reduce_dtype)
        return unit.grad[slot.start : slot.start + slot.numel]

    def local_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """This rank's part of `param`'s reduced gradient (after `finish_grad_sync`)."""
        unit, slot = self._unit_of[id(param)]
        part = overlap(slot, *unit.stage.local_range(unit))
        if part is None or unit.master.grad is None:
            return None
        return unit.master.grad[part[0] : part[1]]

    def finish_grad_sync(self) -> None:
        """Wait for every reduction; give each master its (fp32) reduced gradient."""
        for unit in self.units:
            # The last micro-batch's buckets (ZeRO-0/1), held units, and any unit whose
            # backward did not run this step (zero gradient, so the collectives still match).
            pending = unit.grad is not None and unit.stage.reduce_every_microbatch
            if not unit.launched or pending:
                unit.ready = 0
                self._launch(unit)
        for unit in self.units:
            unit.launched = False
            unit.master.grad = unit.stage.collect(unit)

    def _owned(self, unit: Unit) -> bool:
        """Whether this rank counts its part of `unit` in global sums: a ZeRO shard is its
        own; a replicated unit counts on the first rank of its reduction group."""
        return unit.stage.sharded or unit.stage.dp.rank == 0

    def _counted(self, slot: Slot) -> bool:
        # Parameters replicated across TP count on TP rank 0 only; experts are never
        # TP-replicated (they are TP-sharded, or whole and owned by one EP rank).
        return (
            self.grid.tp.rank == 0
            or hasattr(slot.param, "tp_dim")
            or getattr(slot.param, "expert", False)
        )

    @torch.no_grad()
    def local_sumsq(self, skip: nn.Parameter | None = None) -> torch.Tensor:
        """This rank's counted share of the global gradient's sum of squares (fp64, not
        reduced): summed over the world it counts every element once. `skip`: a parameter
        left out (the second copy of a tied weight)."""
        # On the parameters' device: NCCL reduces only CUDA tensors.
        sumsq = torch.zeros((), dtype=torch.float64, device=self.units[0].master.device)
        for unit in self.units:
            g = unit.master.grad
            if g is None or not self._owned(unit):
                continue
            lo, hi = unit.stage.local_range(unit)
            for slot in unit.slots:
                if slot.param is skip or not self._counted(slot):
                    continue
                part = overlap(slot, lo, hi)
                if part is not None:
                    sumsq += torch.linalg.vector_norm(g[part[0] : part[1]]).double() ** 2
        return sumsq

    def reduce_sumsq(self, sumsq: torch.Tensor) -> float:
        """Sum the per-rank shares over the world; uncounted (not training data)."""
        with self.grid.counter.paused():
            self.grid.world.all_reduce(sumsq)
        return sumsq.item()

    def grad_norm(self) -> float:
        """Global L2 norm of the gradient across TP shards, ZeRO shards and pipeline stages."""
        return math.sqrt(self.reduce_sumsq(self.local_sumsq()))

    @torch.no_grad()
    def scale_grads(self, coef: float) -> None:
        for unit in self.units:
            if unit.master.grad is not None:
                unit.master.grad.mul_(coef)

    def clip_grad_norm_(self, max_norm: float | None) -> float:
        """Scale gradients so their global norm is at most max_norm; returns the norm before."""
        norm = self.grad_norm()
        clip_to(self, norm, max_norm)
        return norm

    # ---- parameter update ----
    def update_params(self) -> None:
        """Copy the updated masters into the compute-dtype parameters (all-gather if sharded)."""
        for unit in self.units:
            unit.stage.update(unit)

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.master.grad = None
            unit.ready = 0
            if not unit.stage.grad_views:
                unit.grad = None
                continue
            if unit.grad is None:
                unit.grad = unit.new_grad(self.reduce_dtype)
            else:
                unit.grad.zero_()
            for slot in unit.slots:
                slot.param.grad = unit.grad[slot.start : slot.start + slot.numel].view(slot.shape)

    def step(self, optimizer, max_norm: float | None = None) -> float:
        """finish_grad_sync, clip, optimizer step, update params, zero grads; returns grad norm."""
        self.finish_grad_sync()
        norm = self.clip_grad_norm_(max_norm)
        optimizer.step()
        self.update_params()
        self.zero_grad()
        return norm

    # ---- full tensors (tests, checkpoints, export) ----
    @torch.no_grad()
    def gather_full(self, locals_: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Full (ZeRO- and TP-gathered) tensors by parameter name, from one tensor per unit in
        the master's layout (masters, their gradients, optimizer moments).

        Collective: every rank of the grid must call it. Not counted."""
        out = {}
        with self.grid.counter.paused():
            for unit, local in zip(self.units, locals_):
                if local is None:
                    continue
                full = unit.stage.gather_full(unit, local)
                for s in unit.slots:
                    t = full[s.start : s.start + s.numel].view(s.shape)
                    if hasattr(s.param, "tp_dim"):
                        t = gather_tp_tensor(_with_tp_dim(t, s.param.tp_dim), self.grid.tp)
                    out[s.name] = t.clone()
        return out

    @torch.no_grad()
    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full fp32 masters (or their reduced gradients) by parameter name. Collective."""
        return self.gather_full([u.master.grad if grads else u.master.detach() for u in self.units])

    @torch.no_grad()
    def local_from_full(self, full: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The inverse of `gather_full` for this rank's layout: each unit's piece (fp32) cut
        from full tensors — how a checkpoint of any TP/DP/ZeRO layout is loaded into this one.
        """
        out = []
        tp = self.grid.tp
        for unit in self.units:
            flat = torch.zeros(unit.padded, dtype=torch.float32, device=unit.master.device)
            for s in unit.slots:
                if s.name not in full:
                    raise KeyError(f"the full state lacks {s.name!r}")
                t = full[s.name]
                dim = getattr(s.param, "tp_dim", None)
                if dim is not None and tp.size > 1:
                    t = t.chunk(tp.size, dim=dim)[tp.rank]
                if tuple(t.shape) != tuple(s.shape):
                    raise ValueError(
                        f"{s.name}: saved shape {tuple(full[s.name].shape)} does not give this "
                        f"layout's {tuple(s.shape)}"
                    )
                flat[s.start : s.start + s.numel] = t.reshape(-1).to(flat)
            lo, hi = unit.stage.local_range(unit)
            out.append(flat[lo:hi].clone())
        return out

    def optimizer_state_bytes(self, optimizer) -> int:
        total = 0
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total


def clip_to(owner, norm: float, max_norm: float | None) -> None:
    """Scale `owner`'s gradients (anything with `scale_grads`) so that a gradient of global
    norm `norm` ends with norm at most `max_norm` (None or <= 0: no clipping)."""
    if max_norm is not None and max_norm > 0:
        owner.scale_grads(min(max_norm / (norm + 1e-6), 1.0))


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model llmopt built (from its ModelSpec), else none."""
    if getattr(model, "config", None) is None:
        return []
    from llmopt.models.spec import UnknownArchitectureError, spec_for

    try:
        spec = spec_for(model)
    except UnknownArchitectureError:
        return []
    return list(getattr(model, spec.blocks, None) or [])


def _with_tp_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    t = t.contiguous()
    t.tp_dim = dim
    return t
