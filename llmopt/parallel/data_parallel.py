"""Data parallelism with ZeRO 1/2/3 and mixed precision, on flat per-block buffers.

The model's parameters are regrouped into *units*: one per transformer block plus a root unit
(embedding, final norm, head). Each unit keeps its parameters as views into one flat buffer in
the compute dtype (bf16 or fp32), padded to a multiple of the DP size, and an fp32 *master*
copy that the optimizer updates (Megatron's convention: bf16 compute, fp32 master weights and
optimizer states). The unit is also the gradient bucket: when backward has produced the
gradient of every parameter of a unit, its reduction is launched asynchronously while backward
continues with the earlier blocks (overlap).

ZeRO stages (Rajbhandari et al.):

- 0: gradients are all-reduced; every rank holds the full master and optimizer state.
- 1: gradients are reduce-scattered (Megatron's distributed optimizer): each rank receives only
  the 1/dp shard of the reduced gradient it updates (so the optimizer state is 1/dp), then the
  updated parameters are all-gathered. Half the bytes of an all-reduce, same result on the shard.
- 2: gradients are reduce-scattered every micro-batch and accumulated in an fp32 shard, so no
  rank holds a full gradient across accumulation (DeepSpeed stage 2, the memory claim of
  ZeRO-2); update and parameter all-gather as in 1.
- 3: parameters are sharded too. A unit is all-gathered just before its forward (the next
  one is prefetched), freed after it, all-gathered again just before its backward (the
  previous one prefetched), and freed once its gradients are reduce-scattered (every
  micro-batch, as in 2). The root unit (embedding, final norm, head: needed first in forward
  and last in backward) stays gathered from its first use until the parameter update.

Gradient accumulation: ZeRO-0/1 inside `no_sync()` sum gradients into the full unit buffers
and communicate nothing; the last micro-batch (outside `no_sync`) launches the reductions.
ZeRO-2/3 ignore `no_sync()` (as DeepSpeed stage 2/3 do): every micro-batch reduce-scatters and
frees its full gradient. Exception: with tied embeddings split over pipeline stages, the root
unit (embedding or output layer) is *held* inside `no_sync()` on every stage, because its
gradient must be summed across stages (by the caller, on `unit.grad`) before it is sharded;
it is reduce-scattered once, in `finish_grad_sync()`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from llmopt.parallel.comm import Group
from llmopt.parallel.grid import RankGrid
from llmopt.parallel.tensor_parallel import gather_tp_tensor

ZERO_STAGES = (0, 1, 2, 3)


@dataclass
class _Slot:
    name: str
    param: nn.Parameter
    start: int
    numel: int
    shape: torch.Size


@dataclass
class Unit:
    """A group of parameters sharing one flat buffer; the bucket and the ZeRO-3 gather unit."""

    name: str
    slots: list[_Slot]
    numel: int
    padded: int
    flat: torch.Tensor  # compute dtype, `padded` elements (storage freed when ZeRO-3 shards)
    master: nn.Parameter  # fp32: full (ZeRO-0) or this rank's shard
    shard: torch.Tensor | None = None  # ZeRO-3: this rank's shard in compute dtype
    grad: torch.Tensor | None = None  # full padded accumulation buffer (reduce dtype)
    grad_shard: torch.Tensor | None = None  # reduce-scatter output of the launch in flight
    grad_accum: torch.Tensor | None = None  # ZeRO-2/3: fp32 sum of the reduced shards so far
    ready: int = 0
    work: object | None = None
    gathered: bool = True
    gather_work: object | None = None
    launched: bool = False
    index: int = 0
    extra: dict = field(default_factory=dict)


class _PreBackwardGather(torch.autograd.Function):
    """Identity at a ZeRO-3 block's output whose backward re-gathers the block's parameters
    before any of the block's own backward runs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, engine: DataParallel, unit: Unit) -> torch.Tensor:
        ctx.engine, ctx.unit = engine, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.engine._gather(ctx.unit)
        ctx.engine._prefetch(ctx.unit.index - 1)
        return grad, None, None


class DataParallel:
    """Wraps a (possibly tensor-parallel) model for data parallel training.

    Use: forward/backward on the model as usual (inside `no_sync()` for all but the last
    micro-batch), then `finish_grad_sync()`, `clip_grad_norm_()`, `optimizer.step()`,
    `update_params()`, `zero_grad()` (or just `step(optimizer, max_norm)`).
    The optimizer must be built over `master_params()`.
    """

    def __init__(
        self,
        model: nn.Module,
        grid: RankGrid,
        zero: int = 0,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        prefetch: bool = True,
    ) -> None:
        if zero not in ZERO_STAGES:
            raise ValueError(f"zero={zero!r} is not a ZeRO stage; choose one of 0, 1, 2, 3")
        if param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype={param_dtype} must be float32, bfloat16 or float16")
        self.model = model
        self.grid = grid
        self.dp: Group = grid.dp
        self.zero = zero
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.prefetch_enabled = prefetch
        self._sync = True
        # fp32 gradients of fp32 parameters accumulate straight into the bucket buffers
        # (parameter .grad is a view, as DDP's gradient_as_bucket_view): no copy. Not for
        # ZeRO-2/3, whose full-size buffers must only exist while backward fills them.
        self._grad_views = param_dtype == reduce_dtype and zero <= 1
        self.units = self._build_units(model)
        # Root units whose weight is tied to another pipeline stage's (see module docstring).
        config = getattr(model, "config", None)
        tied_across_stages = bool(getattr(config, "tie_embeddings", False)) and grid.pp.size > 1
        self._held = {u.name for u in self.units if u.name == "root" and tied_across_stages}
        self._unit_of = {id(s.param): (u, s) for u in self.units for s in u.slots}
        for unit in self.units:
            for slot in unit.slots:
                slot.param.register_post_accumulate_grad_hook(self._on_grad_ready)
        if zero == 3:
            self._install_zero3_hooks(model)
            for unit in self.units:
                self._free(unit)
        self.zero_grad()

    # ---- construction ----
    def _build_units(self, model: nn.Module) -> list[Unit]:
        groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
        layers = getattr(model, "layers", None)
        block_ids = {}
        if layers is not None:
            for i, block in enumerate(layers):
                for p in block.parameters():
                    block_ids[id(p)] = i
        order = []
        for name, p in model.named_parameters():
            key = f"layers.{block_ids[id(p)]}" if id(p) in block_ids else "root"
            if key not in groups:
                groups[key] = []
                order.append(key)
            groups[key].append((name, p))
        dp = self.dp.size
        units = []
        for key in order:
            slots, offset = [], 0
            for name, p in groups[key]:
                slots.append(_Slot(name, p, offset, p.numel(), p.shape))
                offset += p.numel()
            padded = math.ceil(offset / dp) * dp
            full32 = torch.zeros(padded, dtype=torch.float32, device=slots[0].param.device)
            for s in slots:
                full32[s.start : s.start + s.numel] = s.param.detach().reshape(-1).float()
            flat = full32.to(self.param_dtype)
            for s in slots:
                s.param.data = flat[s.start : s.start + s.numel].view(s.shape)
            lo, hi = self._local_range(padded)
            if self.zero == 0 and flat.data_ptr() == full32.data_ptr():
                master = nn.Parameter(full32)  # fp32 ZeRO-0: the parameters are the masters
            else:
                master = nn.Parameter(full32[lo:hi].clone())
            unit = Unit(key, slots, offset, padded, flat, master)
            if self.zero == 3:
                unit.shard = flat[lo:hi].clone()
            units.append(unit)
        # Root first in forward but last in backward; blocks are indexed by position.
        blocks = [u for u in units if u.name != "root"]
        for i, unit in enumerate(blocks):
            unit.index = i
        self._blocks = blocks
        return units

    def _local_range(self, padded: int) -> tuple[int, int]:
        if self.zero == 0:
            return 0, padded
        size = padded // self.dp.size
        return self.dp.rank * size, (self.dp.rank + 1) * size

    def master_params(self) -> list[nn.Parameter]:
        return [u.master for u in self.units]

    # ---- ZeRO-3 parameter gathering ----
    def _install_zero3_hooks(self, model: nn.Module) -> None:
        root = next(u for u in self.units if u.name == "root")
        model.register_forward_pre_hook(lambda mod, args: self._gather(root))
        embed = getattr(model, "embed_tokens", None)
        if embed is not None:  # callers may skip the model's own forward (hidden_states)
            embed.register_forward_pre_hook(lambda mod, args: self._gather(root))
        for unit, block in zip(self._blocks, model.layers):
            block.register_forward_pre_hook(self._block_pre_forward(unit))
            block.register_forward_hook(self._block_post_forward(unit))

    def _block_pre_forward(self, unit: Unit):
        def hook(module, args):
            self._gather(unit)
            self._prefetch(unit.index + 1)

        return hook

    def _block_post_forward(self, unit: Unit):
        def hook(module, args, output):
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                self._free(unit)
                return _PreBackwardGather.apply(output, self, unit)
            if not torch.is_grad_enabled():
                self._free(unit)
            return output

        return hook

    def _prefetch(self, index: int) -> None:
        if self.prefetch_enabled and 0 <= index < len(self._blocks):
            self._gather(self._blocks[index], async_op=True)

    def _gather(self, unit: Unit, async_op: bool = False) -> None:
        if self.zero != 3:
            return
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

    def _free(self, unit: Unit) -> None:
        if self.zero != 3:
            return
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None
        unit.flat.untyped_storage().resize_(0)
        unit.gathered = False

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
            unit.grad = torch.zeros(unit.padded, dtype=self.reduce_dtype, device=param.device)
        target = unit.grad[slot.start : slot.start + slot.numel]
        if param.grad.data_ptr() != target.data_ptr():  # not (or no longer) a bucket view
            target.add_(param.grad.reshape(-1))
            param.grad = target.view(slot.shape) if self._grad_views else None
        unit.ready += 1
        if unit.ready == len(unit.slots):
            unit.ready = 0
            if self._sync or (self.zero >= 2 and unit.name not in self._held):
                self._launch(unit)

    def _launch(self, unit: Unit) -> None:
        if unit.grad is None:
            unit.grad = torch.zeros(unit.padded, dtype=self.reduce_dtype, device=unit.flat.device)
        unit.grad.div_(self.dp.size)
        if self.zero == 0:
            unit.work = self.dp.all_reduce(unit.grad, async_op=True)
        else:
            self._fold(unit)  # the previous micro-batch's shard, before reusing the slot
            unit.grad_shard = torch.empty(
                unit.padded // self.dp.size, dtype=self.reduce_dtype, device=unit.grad.device
            )
            unit.work = self.dp.reduce_scatter_into(unit.grad_shard, unit.grad, async_op=True)
        unit.launched = True
        if self.zero >= 2:  # only the reduced shard survives: drop the full-size buffer
            for slot in unit.slots:
                slot.param.grad = None
            unit.grad = None
        if self.zero == 3 and unit.name != "root":  # the root stays gathered for the step
            self._free(unit)

    def _fold(self, unit: Unit) -> None:
        """Wait for a ZeRO-2/3 unit's reduce-scatter in flight and add it to the fp32 shard."""
        if self.zero < 2 or unit.work is None:
            return
        unit.work.wait()
        unit.work = None
        shard = unit.grad_shard.float()  # a fresh tensor per launch: may become the sum
        if unit.grad_accum is None:
            unit.grad_accum = shard
        else:
            unit.grad_accum.add_(shard)
        unit.grad_shard = None

    def finish_grad_sync(self) -> None:
        """Wait for every reduction; give each master its (fp32) reduced gradient."""
        for unit in self.units:
            # ZeRO-0/1: the last micro-batch's buckets; ZeRO-2/3: held units (and any whose
            # backward did not run this step, with a zero gradient, so collectives match).
            if not unit.launched or (unit.grad is not None and self.zero >= 2):
                unit.ready = 0
                self._launch(unit)
        for unit in self.units:
            unit.launched = False
            if self.zero >= 2:
                self._fold(unit)
                unit.master.grad = unit.grad_accum
                unit.grad_accum = None
                continue
            if unit.work is not None:
                unit.work.wait()
                unit.work = None
            if self.zero == 1:
                local = unit.grad_shard
                unit.grad_shard = None
            else:
                local = unit.grad
            # No copy in fp32 ZeRO-0: the master's gradient is (a view of) the reduced buffer.
            unit.master.grad = local.float() if local.dtype != torch.float32 else local
            if not self._grad_views:
                unit.grad = None

    def _counted_segments(self, unit: Unit) -> list[tuple[int, int]]:
        """Ranges of the master (local coordinates) whose squares enter the global norm:
        parameters replicated across TP count on TP rank 0 only."""
        lo, hi = self._local_range(unit.padded)
        tp_rank = self.grid.tp.rank
        out = []
        for s in unit.slots:
            if tp_rank != 0 and not hasattr(s.param, "tp_dim"):
                continue
            a, b = max(lo, s.start), min(hi, s.start + s.numel)
            if a < b:
                out.append((a - lo, b - lo))
        return out

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Global L2 norm of the gradient across TP shards, ZeRO shards and pipeline stages."""
        # On the parameters' device: NCCL reduces only CUDA tensors.
        sumsq = torch.zeros((), dtype=torch.float64, device=self.units[0].master.device)
        for unit in self.units:
            g = unit.master.grad
            if g is None:
                continue
            segments = self._counted_segments(unit)
            if self.grid.tp.rank == 0:  # everything local counts (padding is zero)
                segments = [(0, g.numel())]
            for a, b in segments:
                sumsq += torch.linalg.vector_norm(g[a:b]).double() ** 2
        with self.grid.counter.paused():
            if self.zero >= 1:
                self.dp.all_reduce(sumsq)
            self.grid.tp.all_reduce(sumsq)
            self.grid.pp.all_reduce(sumsq)
        return math.sqrt(sumsq.item())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | None) -> float:
        """Scale gradients so their global norm is at most max_norm; returns the norm before."""
        norm = self.grad_norm()
        if max_norm is not None and max_norm > 0:
            coef = min(max_norm / (norm + 1e-6), 1.0)
            for unit in self.units:
                if unit.master.grad is not None:
                    unit.master.grad.mul_(coef)
        return norm

    # ---- parameter update ----
    @torch.no_grad()
    def update_params(self) -> None:
        """Copy the updated masters into the compute-dtype parameters (all-gather if sharded)."""
        for unit in self.units:
            if self.zero == 0:
                if unit.flat.data_ptr() != unit.master.data_ptr():
                    unit.flat.copy_(unit.master)
            elif self.zero in (1, 2):
                shard = unit.master.detach().to(self.param_dtype)
                self.dp.all_gather_into(unit.flat, shard)
            else:
                unit.shard.copy_(unit.master)
                self._free(unit)

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.master.grad = None
            unit.ready = 0
            if not self._grad_views:
                unit.grad = None
                continue
            if unit.grad is None:
                unit.grad = torch.zeros(
                    unit.padded, dtype=self.reduce_dtype, device=unit.master.device
                )
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
    def _full_local(self, unit: Unit, local: torch.Tensor) -> torch.Tensor:
        if self.zero == 0:
            return local
        full = torch.empty(unit.padded, dtype=local.dtype, device=local.device)
        self.dp.all_gather_into(full, local.contiguous())
        return full

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
                full = self._full_local(unit, local)
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
            lo, hi = self._local_range(unit.padded)
            out.append(flat[lo:hi].clone())
        return out

    def optimizer_state_bytes(self, optimizer) -> int:
        total = 0
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total


def _with_tp_dim(t: torch.Tensor, dim: int) -> torch.Tensor:
    t = t.contiguous()
    t.tp_dim = dim
    return t
