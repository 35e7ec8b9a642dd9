"""`parallelize(model, grid, plan) -> Engine`: the one way a model is mapped onto ranks.

In order: FP8 linears (precision=fp8), tensor (+sequence) parallelism over `grid.tp`,
activation checkpointing, the stage split over `grid.pp`, and data parallelism with the plan's
ZeRO stage over `grid.dp`, applied to *this rank's stages only*. pp=1 is a one-stage pipeline:
the same executor runs its micro-batches (forward and backward of each, gradients accumulated
under `no_sync`), so there is one code path for every layout. The Engine's methods are all a
training loop needs:

    engine = parallelize(model, grid, ParallelPlan(tp=2, pp=2, dp=2, num_microbatches=4))
    opt = AdamW(engine.master_params(), lr=...)
    out = engine.step(tokens, labels, opt, max_norm=1.0)   # out.loss on every rank

Tied embeddings split over stages: the first and the last stage hold two copies of the shared
weight; their gradients are summed over the PP group (`exchange_tied_grad`) on the DP buckets
before the DP reduction, so both copies get the same update and stay identical.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmopt.models.llama import Transformer
from llmopt.models.spec import spec_for
from llmopt.parallel.data_parallel import DataParallel, clip_to
from llmopt.parallel.grid import RankGrid
from llmopt.parallel.loss import Objective, token_loss_sum
from llmopt.parallel.pipeline.executor import (
    IGNORE_INDEX,
    LossFn,
    PipelineExecutor,
    StepResult,
    exchange_tied_grad,
)
from llmopt.parallel.pipeline.schedule import PipelineSchedule, build_schedule
from llmopt.parallel.pipeline.stage import (
    PipelineStage,
    split_model,
    stage_layout,
    stage_parameters,
)
from llmopt.parallel.plan import ParallelPlan
from llmopt.parallel.recompute import apply_activation_checkpointing
from llmopt.parallel.routing import moe_blocks, set_aux_scale, step_routing
from llmopt.parallel.tensor_parallel import apply_tensor_parallel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float32}
BUFFER = "buffer/"  # state_dict() prefix of trained buffers


class EngineError(ValueError):
    """A plan this engine cannot run on this grid; the message names the value and the fix."""


class _RankModule(nn.Module):
    """This rank's stages seen as one module (what DataParallel buckets and shards).

    `named_parameters` yields the single-model names (as the plain model's `state_dict` lists
    them) in stage order rather than stage-prefixed ones, so gradients, masters and checkpoints
    of every layout are keyed alike. `blocks` get one unit each."""

    def __init__(self, stages: Sequence[PipelineStage]) -> None:
        super().__init__()
        self.config = stages[0].config
        self.stages = nn.ModuleList(stages)
        spec = spec_for(stages[0])
        self.blocks = [b for s in stages for _, b in spec.named_blocks(s)]

    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, nn.Parameter]]:
        yield from stage_parameters(list(self.stages)).items()


@dataclass
class StepOutput:
    loss: float  # global-batch mean, identical on every rank
    grad_norm: float | None
    pipeline: StepResult
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's, if any
    applied: bool = True  # False: a non-finite step skipped (`step(skip_nonfinite=True)`)
    routing: dict[str, object] = field(default_factory=dict)  # MoE: `llmopt.parallel.routing`


class Engine:
    """This rank's part of a parallelized model and the machinery to train it."""

    def __init__(
        self,
        model: Transformer,
        grid: RankGrid,
        plan: ParallelPlan,
        layers_per_stage: Sequence[int] | None = None,
        record_events: bool = False,
        objective: Objective | None = None,
    ) -> None:
        _check_plan(plan, grid)
        if objective is not None and (plan.tp > 1 or plan.pp > 1):
            raise EngineError(
                f"a custom objective needs each rank's full logits: tp={plan.tp}, pp={plan.pp} "
                "are not supported with it; use tp=1 pp=1 (data parallel and ZeRO work)"
            )
        self.objective = objective
        cfg = model.config
        pp = grid.pp.size
        self.grid, self.plan, self.model = grid, plan, model
        self.layers_per_stage = layers_per_stage
        self.schedule: PipelineSchedule = build_schedule(
            plan.schedule, pp, plan.num_microbatches, plan.virtual_stages
        )
        # Validate the layer split before touching the model.
        stage_layout(cfg.num_layers, pp, plan.virtual_stages, layers_per_stage)
        if plan.precision == "fp8":
            _convert_to_fp8(model, plan, grid)
        apply_tensor_parallel(model, grid.tp, sequence_parallel=plan.sequence_parallel)
        apply_activation_checkpointing(model, plan.recompute)
        self.stages = split_model(model, grid.pp.rank, pp, plan.virtual_stages, layers_per_stage)
        self.rank_module = _RankModule(self.stages)
        self.moe_blocks = moe_blocks(self.stages)
        set_aux_scale(self.moe_blocks, plan.num_microbatches)
        # trained state that is not a parameter (MoE balancing biases), by single-model name
        self.extra_state = persistent_buffers(self.stages)
        tied = bool(cfg.tie_embeddings) and pp > 1
        param_dtype = DTYPES[plan.precision]
        self.dp = DataParallel(
            self.rank_module,
            grid,
            zero=plan.zero_stage,
            param_dtype=param_dtype,
            reduce_dtype=DTYPES[plan.reduce_dtype],
            blocks=self.rank_module.blocks,
            hold_root=tied,
        )
        self.device = self.dp.units[0].master.device
        self.last_rank = self.schedule.rank_of(self.schedule.num_stages - 1)
        tied_stages = (0, self.schedule.num_stages - 1) if tied else ()
        spec = spec_for(model)
        self._tied = [
            p
            for s in self.stages
            if s.stage in tied_stages
            for p in [spec.top_module(s, "embedding" if s.is_first else "head").weight]
        ]
        sp = bool(getattr(model, "sequence_parallel", False))
        tp, hidden = grid.tp.size, cfg.hidden_size
        self.executor = PipelineExecutor(
            self.stages,
            self.schedule,
            grid.pp,
            loss_fn=self._loss_fn(model),
            activation_shape=lambda b, t: (b, t // tp if sp else t, hidden),
            dtype=param_dtype,
            no_sync=self.dp.no_sync,
            defer_sync_stages=tied_stages,
            record_events=record_events,
        )

    def _loss_fn(self, model: Transformer) -> LossFn:
        return token_loss_sum(self.grid.tp, getattr(model, "vocab_start", 0))

    def master_params(self) -> list[nn.Parameter]:
        """What the optimizer must own (fp32 masters, ZeRO-sharded)."""
        return self.dp.master_params()

    @property
    def param_dtype(self) -> torch.dtype:
        """The compute dtype of the parameters (masters are fp32)."""
        return self.dp.param_dtype

    # ---- one step ----
    def forward_backward(
        self, tokens: torch.Tensor, labels: torch.Tensor, num_tokens: int | None = None
    ) -> StepResult:
        """Forward+backward of this DP replica's batch [micro_batch * num_microbatches, T];
        gradients reduced (DP) into the masters' .grad.

        The loss is the mean over the supervised tokens (labels != IGNORE_INDEX) of the whole
        global batch: `num_tokens` is their count over all DP replicas (computed with one
        uncounted all-reduce when not given). DP averages gradients over its replicas, so each
        replica divides its loss sum by num_tokens / dp."""
        rows = self.plan.micro_batch * self.plan.num_microbatches
        if tokens.shape[0] != rows:
            raise EngineError(
                f"batch of {tokens.shape[0]} sequences per DP rank; the plan needs micro_batch "
                f"{self.plan.micro_batch} x num_microbatches {self.plan.num_microbatches} = {rows}"
            )
        if num_tokens is None:
            num_tokens = self.supervised_tokens(labels)
        self.dp.prepare_forward()
        if self.objective is not None:
            self.executor.loss_fn = self.objective.bind(tokens, labels)
        result = self.executor.step(tokens, labels, num_tokens / self.grid.dp.size)
        if self._tied:
            peer = self.last_rank if self.grid.pp.rank == 0 else 0
            exchange_tied_grad(self.grid.pp, self.dp.grad_buffer(self._tied[0]), peer)
        self.dp.finish_grad_sync()
        return result

    def supervised_tokens(self, labels: torch.Tensor) -> int:
        """Labels != IGNORE_INDEX summed over the DP replicas (uncounted: 8 bytes)."""
        count = (labels != IGNORE_INDEX).sum().to(torch.float64).to(self.device)
        with self.grid.counter.paused():
            self.grid.dp.all_reduce(count)
        return int(count.item())

    def step(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None = None,
        num_tokens: int | None = None,
        skip_nonfinite: bool = False,
    ) -> StepOutput:
        """One optimizer step on this DP replica's batch; the logged loss is the global mean
        over supervised tokens (`forward_backward`). With `skip_nonfinite`, a NaN/inf loss or
        gradient norm applies no update; both are reduced over the grid, so ranks agree."""
        result = self.forward_backward(tokens, labels, num_tokens)
        norm = self.grad_norm()
        loss = self.global_loss(result)
        applied = not skip_nonfinite or (math.isfinite(loss) and math.isfinite(norm))
        if applied:
            clip_to(self, norm, max_norm)
            optimizer.step()
            self.update_params()
        self.zero_grad()
        metrics = self.objective_metrics() if applied else {}
        return StepOutput(loss, norm, result, metrics, applied, self.routing_stats(applied))

    def routing_stats(self, update_bias: bool = True) -> dict[str, object]:
        """The MoE routing statistics of the forwards since the last call (collective over
        the world for a model with experts; {} for a dense one); moves the balancing biases
        unless `update_bias` is False (a skipped step)."""
        forwards = self.grid.dp.size * self.plan.num_microbatches
        return step_routing(
            self.moe_blocks, self.grid, self.model.config, forwards, self.device, update_bias
        )

    def objective_metrics(self) -> dict[str, float]:
        """What a custom objective logs for the step just run (uncounted: logging)."""
        if self.objective is None:
            return {}
        with self.grid.counter.paused():
            return self.objective.metrics(self.grid.dp)

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Global gradient L2 norm over TP, DP and PP, counting a tied weight once (both
        copies hold the same summed gradient: the last stage's is left out)."""
        sumsq = self.dp.local_sumsq()
        if self._tied and self.grid.pp.rank == self.last_rank:
            dup = self.dp.local_grad(self._tied[0])
            if dup is not None and (self.grid.tp.rank == 0 or hasattr(self._tied[0], "tp_dim")):
                sumsq -= dup.double().pow(2).sum()
        return math.sqrt(max(self.dp.reduce_sumsq(sumsq), 0.0))

    def scale_grads(self, coef: float) -> None:
        self.dp.scale_grads(coef)

    def clip_grad_norm_(self, max_norm: float | None) -> float:
        """Scale gradients so their global norm is at most max_norm; returns the norm before."""
        norm = self.grad_norm()
        clip_to(self, norm, max_norm)
        return norm

    def update_params(self) -> None:
        self.dp.update_params()

    def zero_grad(self) -> None:
        self.dp.zero_grad()

    def global_loss(self, result: StepResult) -> float:
        """The last stage's loss, broadcast over PP and averaged over DP (uncounted: logging)."""
        loss = result.loss if result.loss is not None else 0.0
        # On the parameters' device: NCCL reduces only CUDA tensors.
        value = torch.tensor(loss, dtype=torch.float64, device=self.device)
        with self.grid.counter.paused():
            self.grid.pp.broadcast(value, src=self.last_rank)
            self.grid.dp.all_reduce(value)
        return value.item() / self.grid.dp.size

    # ---- state (checkpoints) ----
    def layout(self) -> dict[str, Any]:
        """What must match for a checkpoint to restore this rank's shards as they are."""
        d = self.grid.dims
        return {
            "tp": d.tp,
            "pp": d.pp,
            "dp": d.dp,
            "cp": d.cp,
            "zero": self.dp.zero,
            "param_dtype": str(self.dp.param_dtype),
            "units": [[u.name, u.padded] for u in self.dp.units],
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's fp32 masters (full or ZeRO shard) by unit name, and its trained
        buffers (MoE balancing biases) under `buffer/<name>`."""
        state = {u.name: u.master.detach() for u in self.dp.units}
        state.update({f"{BUFFER}{n}": b.detach() for n, b in self.extra_state.items()})
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore this rank's masters (from `state_dict()` or `local_from_full`)."""
        for unit in self.dp.units:
            if unit.name not in state:
                raise KeyError(f"the state lacks unit {unit.name!r}")
            unit.master.copy_(state[unit.name])
        for name, buf in self.extra_state.items():
            if f"{BUFFER}{name}" not in state:
                raise KeyError(f"the state lacks buffer {name!r}")
            buf.copy_(state[f"{BUFFER}{name}"])
        self.update_params()

    def gather_full(self, locals_: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Full tensors by single-model name from one per unit (master layout). Collective."""
        return self.dp.gather_full(locals_)

    def local_from_full(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's per-unit pieces (by unit name) cut from full tensors by name."""
        pieces = self.dp.local_from_full(full)
        return {u.name: t for u, t in zip(self.dp.units, pieces)}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """This rank's reduced gradients, full (TP- and ZeRO-gathered). Collective over TP, DP."""
        return self.dp.full_state_dict(grads=True)

    def full_params(self) -> dict[str, torch.Tensor]:
        """This rank's fp32 parameters, full (TP- and ZeRO-gathered). Collective over TP, DP."""
        return self.dp.full_state_dict()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's fp32 state (single-model names, loadable into `Transformer`) on
        pp rank 0 of every TP/DP coordinate; {} on the other pp ranks.

        Collective over TP, DP and PP; not counted. A tied weight appears under both names,
        as `Transformer.state_dict()` lists it."""
        local = self.full_params()
        pp = self.grid.pp.size
        config = self.model.config
        if pp == 1:
            if config.tie_embeddings:
                spec = spec_for(self.model)
                local.setdefault(f"{spec.head}.weight", local[f"{spec.embedding}.weight"])
            return local
        with self.grid.counter.paused():  # sends go from the parameters' device (NCCL)
            if self.grid.pp.rank != 0:
                names = self._flat_names(self.grid.pp.rank)
                flat = torch.cat([local[n].reshape(-1).float() for n, _ in names])
                self.grid.pp.batch_p2p([("send", flat, 0)], wait=True)
                return {}
            out = dict(local)
            for rank in range(1, pp):
                names = self._flat_names(rank)
                flat = torch.empty(sum(s.numel() for _, s in names), device=self.device)
                self.grid.pp.batch_p2p([("recv", flat, rank)], wait=True)
                offset = 0
                for name, shape in names:
                    out[name] = flat[offset : offset + shape.numel()].view(shape).clone()
                    offset += shape.numel()
        return out

    def _flat_names(self, pp_rank: int) -> list[tuple[str, torch.Size]]:
        """(name, full shape) of a pp rank's parameters, in a fixed order (weightless model)."""
        with torch.device("meta"):
            meta = Transformer(self.model.config)
        stages = split_model(
            meta, pp_rank, self.grid.pp.size, self.plan.virtual_stages, self.layers_per_stage
        )
        return [(n, p.shape) for n, p in stage_parameters(stages).items()]


def persistent_buffers(stages: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Persistent buffers of the stages by single-model name (the trained ones: MoE biases)."""
    out = {}
    for stage in stages:
        for module_name, module in stage.named_modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and name not in module._non_persistent_buffers_set:
                    out[f"{module_name}.{name}" if module_name else name] = buf
    return out


def _check_plan(plan: ParallelPlan, grid: RankGrid) -> None:
    d = grid.dims
    for name in ("tp", "pp", "dp"):
        if getattr(plan, name) != getattr(d, name):
            raise EngineError(
                f"plan {name}={getattr(plan, name)} but the rank grid has {name}={getattr(d, name)}"
            )
    for name in ("cp", "ep"):
        if getattr(plan, name) != 1:
            raise EngineError(f"{name}={getattr(plan, name)} is not supported by the engine yet")
    if plan.zero_stage == 3 and plan.pp > 2:
        raise EngineError(
            f"zero_stage=3 with pp={plan.pp} > 2 is not supported: middle stages hold no "
            "embedding or head to keep gathered; use zero_stage<=2 or pp<=2"
        )
    if plan.precision == "fp8" and plan.pp > 1:
        raise EngineError(
            "precision=fp8 with pp>1 is not supported yet: amaxes must be reduced over the "
            "ranks holding the same stage (tp x dp), a group the grid does not create; "
            "use pp=1 or precision=bf16"
        )


def _convert_to_fp8(model: Transformer, plan: ParallelPlan, grid: RankGrid) -> None:
    try:
        from llmopt.precision.fp8 import convert_to_fp8
    except ImportError as exc:
        raise EngineError(
            f"precision=fp8 needs llmopt.precision.fp8.convert_to_fp8, unavailable: {exc}"
        ) from exc
    # With pp=1 the world is the tp x dp group: TP shards and DP replicas share one scale.
    convert_to_fp8(model, plan.fp8_recipe, amax_group=grid.world)


def parallelize(
    model: Transformer,
    grid: RankGrid,
    plan: ParallelPlan,
    *,
    layers_per_stage: Sequence[int] | None = None,
    record_events: bool = False,
    objective: Objective | None = None,
) -> Engine:
    """FP8 -> TP/SP -> recompute -> stage split -> DP/ZeRO on this rank; see `Engine`."""
    return Engine(model, grid, plan, layers_per_stage, record_events, objective)
