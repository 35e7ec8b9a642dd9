"""Pipeline parallelism composed with TP/SP, DP/ZeRO and recompute: full 3D on one rank grid.

`build_pipeline_model(model, grid, config, ...)` applies, in order, tensor (+sequence)
parallelism over `grid.tp`, activation checkpointing, the stage split over `grid.pp`, and data
parallelism (ZeRO) over `grid.dp` to *this rank's stages only*; `PipelineModel.train_step`
runs one optimizer step with the chosen schedule. This is what the trainer calls:

    pm = build_pipeline_model(model, grid, PipelineConfig("1f1b", microbatches=8), zero=1)
    opt = torch.optim.AdamW(pm.master_params(), lr=...)
    out = pm.train_step(tokens, labels, opt, max_norm=1.0)   # out.loss on every rank

Tied embeddings: the first and the last stage hold two copies of the shared weight. Their
gradients are summed over the PP group before the DP reduction (so both copies get the same
update and stay identical).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from llmopt.models.llama import Transformer
from llmopt.parallel.data_parallel import DataParallel
from llmopt.parallel.grid import RankGrid
from llmopt.parallel.pipeline.executor import PipelineExecutor, StepResult, cross_entropy_sum
from llmopt.parallel.pipeline.schedule import (
    SCHEDULES,
    PipelineSchedule,
    ScheduleError,
    build_schedule,
)
from llmopt.parallel.pipeline.stage import (
    PipelineStage,
    split_model,
    stage_layout,
    stage_parameters,
)
from llmopt.parallel.recompute import apply_activation_checkpointing
from llmopt.parallel.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy


@dataclass(frozen=True)
class PipelineConfig:
    """Schedule, micro-batches per step, chunks per rank, optional explicit layer split."""

    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    layers_per_stage: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ScheduleError(
                f"unknown schedule {self.schedule!r}; choose from {', '.join(SCHEDULES)}"
            )
        for name in ("microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"{name}={value!r} must be a positive integer")
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))


class _RankModule(nn.Module):
    """This rank's stages seen as one model (what DataParallel buckets and shards).

    `layers` are this rank's blocks in stage order (one DP bucket each); embedding, final norm
    and head are present only where their stage lives.
    """

    def __init__(self, stages: Sequence[PipelineStage]) -> None:
        super().__init__()
        self.config = stages[0].config
        self.layers = nn.ModuleList(b for s in stages for b in s.layers.values())
        for s in stages:
            if s.is_first:
                self.embed_tokens = s.embed_tokens
            if s.is_last:
                self.norm = s.norm
                self.lm_head = s.lm_head
        self.original_names = {}
        k = 0
        for s in stages:
            for index in s.layer_indices:
                self.original_names[f"layers.{k}."] = f"layers.{index}."
                k += 1

    def original_name(self, name: str) -> str:
        """`layers.0.mlp...` on this rank -> the single model's `layers.6.mlp...`."""
        if name.startswith("layers."):
            prefix = ".".join(name.split(".")[:2]) + "."
            return self.original_names[prefix] + name[len(prefix) :]
        return name


@dataclass
class TrainStepResult:
    loss: float  # global-batch mean, identical on every rank
    grad_norm: float | None
    pipeline: StepResult


class PipelineModel:
    """This rank's part of a 3D-parallel model and the machinery to train it."""

    def __init__(
        self,
        model: Transformer,
        grid: RankGrid,
        config: PipelineConfig,
        *,
        zero: int = 0,
        sequence_parallel: bool = False,
        recompute: str = "none",
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype = torch.float32,
        record_events: bool = False,
    ) -> None:
        pp = grid.pp.size
        cfg = model.config
        self.grid = grid
        self.config = config
        self.schedule: PipelineSchedule = build_schedule(
            config.schedule, pp, config.microbatches, config.virtual_stages
        )
        tied = cfg.tie_embeddings and pp > 1
        if zero == 3 and pp > 2:
            raise ScheduleError(
                f"zero=3 with pp={pp} > 2 is not supported: middle stages hold no embedding or "
                "head, and DataParallel needs a root unit for ZeRO-3; use zero<=2 or pp<=2"
            )
        # Validate the layer split before touching the model.
        stage_layout(cfg.num_layers, pp, config.virtual_stages, config.layers_per_stage)
        apply_tensor_parallel(model, grid.tp, sequence_parallel=sequence_parallel)
        apply_activation_checkpointing(model, recompute)
        self.model = model
        self.stages = split_model(
            model, grid.pp.rank, pp, config.virtual_stages, config.layers_per_stage
        )
        self.rank_module = _RankModule(self.stages)
        self.dp = DataParallel(
            self.rank_module, grid, zero=zero, param_dtype=param_dtype, reduce_dtype=reduce_dtype
        )
        self.zero = zero
        self.sp = bool(getattr(model, "sequence_parallel", False))
        tp = grid.tp.size
        hidden = cfg.hidden_size
        tied_stages = (0, self.schedule.num_stages - 1) if tied else ()
        self._tied_params = [
            p
            for s in self.stages
            if s.stage in tied_stages
            for p in ([s.embed_tokens.weight] if s.is_first else [s.lm_head.weight])
        ]
        self.executor = PipelineExecutor(
            self.stages,
            self.schedule,
            grid.pp,
            loss_fn=self._loss_fn(model),
            activation_shape=lambda b, t: (b, t // tp if self.sp else t, hidden),
            dtype=param_dtype,
            tied_embeddings=False,  # summed here, on DataParallel's buffers
            no_sync=self.dp.no_sync,
            defer_sync_stages=tied_stages,
            record_events=record_events,
        )

    def _loss_fn(self, model: Transformer):
        group = self.grid.tp
        if group.size == 1:
            return cross_entropy_sum
        start = model.vocab_start

        def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            # vocab-parallel CE returns the token mean; the executor wants the sum.
            return vocab_parallel_cross_entropy(logits, labels, group, start) * labels.numel()

        return loss

    def master_params(self) -> list[nn.Parameter]:
        """What the optimizer must own (fp32 masters, ZeRO-sharded)."""
        return self.dp.master_params()

    @contextlib.contextmanager
    def _zero3_root(self) -> Iterator[None]:
        # ZeRO-3 gathers the root unit in a pre-hook of the whole model's forward, which the
        # pipeline never calls; keep it gathered for the step (DataParallel frees it after
        # its gradient reduction).
        if self.zero == 3:
            for unit in self.dp.units:
                if unit.name == "root":
                    self.dp._gather(unit)
        yield

    def forward_backward(
        self, tokens: torch.Tensor, labels: torch.Tensor, num_tokens: int | None = None
    ) -> StepResult:
        """Pipeline forward+backward of this DP replica's batch; gradients DP-reduced."""
        with self._zero3_root():
            result = self.executor.step(tokens, labels, num_tokens)
        self._sum_tied_grads()
        self.dp.finish_grad_sync()
        return result

    def _sum_tied_grads(self) -> None:
        if not self._tied_params:
            return
        last_rank = self.schedule.rank_of(self.schedule.num_stages - 1)
        peer = last_rank if self.grid.pp.rank == 0 else 0
        param = self._tied_params[0]
        unit, slot = self.dp._unit_of[id(param)]
        if unit.grad is None:
            unit.grad = torch.zeros(unit.padded, dtype=self.dp.reduce_dtype)
        mine = unit.grad[slot.start : slot.start + slot.numel]
        other = torch.empty_like(mine)
        self.grid.pp.batch_p2p([("send", mine.clone(), peer), ("recv", other, peer)], wait=True)
        mine.add_(other)

    def train_step(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None = None,
    ) -> TrainStepResult:
        """One optimizer step on this DP replica's batch [B, T] (B divisible by microbatches).

        The loss is computed on the last stage and broadcast over the PP group (uncounted: it
        is logging, not training traffic) and averaged over DP, so every rank logs the same
        global-batch loss.
        """
        result = self.forward_backward(tokens, labels)
        norm = self.clip_grad_norm_(max_norm)
        optimizer.step()
        self.dp.update_params()
        self.dp.zero_grad()
        return TrainStepResult(self.global_loss(result), norm, result)

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Global gradient L2 norm, counting a tied embedding/head weight once.

        DataParallel's norm sums every rank's parameters over TP, DP and PP; with tied
        embeddings under PP both copies hold the same summed gradient, so the last stage's copy
        is subtracted here.
        """
        total = self.dp.grad_norm()
        if not self._tied_params:
            return total
        dup = torch.zeros((), dtype=torch.float64)
        last_rank = self.schedule.rank_of(self.schedule.num_stages - 1)
        if self.grid.pp.rank == last_rank:
            unit, slot = self.dp._unit_of[id(self._tied_params[0])]
            lo, hi = self.dp._local_range(unit.padded)
            a, b = max(lo, slot.start), min(hi, slot.start + slot.numel)
            if a < b and unit.master.grad is not None:
                dup += unit.master.grad[a - lo : b - lo].double().pow(2).sum()
        with self.grid.counter.paused():
            if self.zero >= 1:
                self.grid.dp.all_reduce(dup)
            self.grid.tp.all_reduce(dup)  # the tied weight is vocab-sharded over TP
            self.grid.pp.all_reduce(dup)
        return math.sqrt(max(total * total - dup.item(), 0.0))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | None) -> float:
        """Scale gradients so their global norm is at most max_norm; returns the norm before."""
        norm = self.grad_norm()
        if max_norm is not None and max_norm > 0:
            coef = min(max_norm / (norm + 1e-6), 1.0)
            for unit in self.dp.units:
                if unit.master.grad is not None:
                    unit.master.grad.mul_(coef)
        return norm

    def global_loss(self, result: StepResult) -> float:
        last_rank = self.schedule.rank_of(self.schedule.num_stages - 1)
        value = torch.tensor(result.loss if result.loss is not None else 0.0, dtype=torch.float64)
        with self.grid.counter.paused():
            self.grid.pp.broadcast(value, src=last_rank)
            self.grid.dp.all_reduce(value)
        return value.item() / self.grid.dp.size

    def full_grads(self) -> dict[str, torch.Tensor]:
        """This rank's reduced gradients, full (TP- and ZeRO-gathered), by single-model name.

        Collective over the TP and DP groups."""
        grads = self.dp.full_state_dict(grads=True)
        return {self.rank_module.original_name(n): g for n, g in grads.items()}

    def full_params(self) -> dict[str, torch.Tensor]:
        """This rank's fp32 parameters, full (TP- and ZeRO-gathered), by single-model name."""
        params = self.dp.full_state_dict()
        return {self.rank_module.original_name(n): p for n, p in params.items()}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's fp32 state (single-model names, loadable into `Transformer`) on
        pp rank 0 of every TP/DP coordinate; {} on the other pp ranks.

        Collective over TP, DP and PP; not counted (checkpointing, not training traffic). A
        tied weight appears under both names, as `Transformer.state_dict()` lists it.
        """
        local = self.full_params()
        pp = self.grid.pp.size
        if pp == 1:
            if self.model.config.tie_embeddings:
                local.setdefault("lm_head.weight", local["embed_tokens.weight"])
            return local
        with self.grid.counter.paused():
            if self.grid.pp.rank != 0:
                names = _flat_names(self.model.config, self.grid.pp.rank, pp, self.config)
                flat = torch.cat([local[n].reshape(-1).float() for n, _ in names])
                self.grid.pp.batch_p2p([("send", flat, 0)], wait=True)
                return {}
            out = dict(local)
            for rank in range(1, pp):
                names = _flat_names(self.model.config, rank, pp, self.config)
                flat = torch.empty(sum(shape.numel() for _, shape in names))
                self.grid.pp.batch_p2p([("recv", flat, rank)], wait=True)
                offset = 0
                for name, shape in names:
                    out[name] = flat[offset : offset + shape.numel()].view(shape).clone()
                    offset += shape.numel()
        return out


def _flat_names(
    config, pp_rank: int, pp: int, pcfg: PipelineConfig
) -> list[tuple[str, torch.Size]]:
    """(name, full shape) of pp rank's parameters, in a fixed order, from a weightless model."""
    with torch.device("meta"):
        meta = Transformer(config)
    stages = split_model(meta, pp_rank, pp, pcfg.virtual_stages, pcfg.layers_per_stage)
    return [(n, p.shape) for n, p in stage_parameters(stages).items()]


def build_pipeline_model(
    model: Transformer,
    grid: RankGrid,
    config: PipelineConfig,
    **kwargs,
) -> PipelineModel:
    """TP/SP -> recompute -> stage split -> DP/ZeRO on this rank; see `PipelineModel`."""
    return PipelineModel(model, grid, config, **kwargs)
