"""`parallelize(model, grid, plan) -> TrainingEngine`: the one way a model is mapped onto ranks.

In order: FP8 linears (precision=fp8), tensor (+sequence) parallelism over `grid.tp`, expert
parallelism over `grid.ep` (a MoE model: each rank keeps its experts, tokens go by
all-to-all), activation checkpointing, the stage split over `grid.pp`, and data parallelism
with the plan's ZeRO stage (dense weights over dp x cp, experts over the expert-data-parallel
group), applied to *this rank's stages only*. pp=1 is a one-stage pipeline: the same executor
runs its micro-batches (forward and backward of each, gradients accumulated under `no_sync`),
so there is one code path for every layout. The TrainingEngine's methods are all a training loop
needs:

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

import torch
from torch import nn

from llmopt.models.llama import Transformer
from llmopt.models.spec import spec_for
from llmopt.parallel.context_parallel import RingAttention, zigzag_shard
from llmopt.parallel.engine.checks import DTYPES, EngineError, check_plan, convert_fp8
from llmopt.parallel.engine.state import EngineState, persistent_buffers
from llmopt.parallel.expert_parallel import apply_expert_parallel
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
from llmopt.parallel.zero.data_parallel import DataParallel, clip_to


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
class TrainStepOutput:
    loss: float  # global-batch mean, identical on every rank
    grad_norm: float | None
    pipeline: StepResult
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's, if any
    applied: bool = True  # False: a non-finite step skipped (`step(skip_nonfinite=True)`)
    routing: dict[str, object] = field(default_factory=dict)  # MoE: `llmopt.parallel.routing`


class TrainingEngine(EngineState):
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
        check_plan(plan, grid, model)
        if objective is not None and (plan.tp > 1 or plan.pp > 1):
            raise EngineError(
                f"a custom objective needs each rank's full logits: tp={plan.tp}, pp={plan.pp} "
                "are not supported with it; use tp=1 pp=1 (data parallel and ZeRO work)"
            )
        self.objective = objective
        cfg = model.config
        pp = grid.pp.size
        self.grid, self.plan, self.model = grid, plan, model
        if layers_per_stage is None:
            layers_per_stage = plan.stage_split(cfg.num_layers)
        self.layers_per_stage = None if layers_per_stage is None else tuple(layers_per_stage)
        self.schedule: PipelineSchedule = build_schedule(
            plan.schedule, pp, plan.num_microbatches, plan.virtual_stages
        )
        # Validate the layer split before touching the model.
        stage_layout(cfg.num_layers, pp, plan.virtual_stages, self.layers_per_stage)
        if plan.precision == "fp8":
            convert_fp8(model, plan, grid)
        sp = plan.sequence_parallel
        expert_tp = grid.dims.expert_tp > 1 or grid.tp.size == 1
        apply_tensor_parallel(model, grid.tp, sequence_parallel=sp, expert_tp=expert_tp)
        if cfg.moe is not None:
            apply_expert_parallel(model, grid, sp and grid.tp.size > 1)
        apply_activation_checkpointing(model, plan.recompute)
        self.stages = split_model(
            model, grid.pp.rank, pp, plan.virtual_stages, self.layers_per_stage
        )
        self.rank_module = _RankModule(self.stages)
        self.moe_blocks = moe_blocks(self.stages)
        # context parallelism: every cp rank's tokens carry a share of each forward's losses
        set_aux_scale(self.moe_blocks, plan.num_microbatches, grid.cp.size)
        self._rings: dict[int, RingAttention] = {}
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
        tokens, labels = self.local_sequences(tokens, labels)
        if num_tokens is None:
            num_tokens = self.supervised_tokens(labels)
        self.dp.prepare_forward()
        if self.objective is not None:
            self.executor.loss_fn = self.objective.bind(tokens, labels)
        # every dp x cp rank's loss sum is divided by its share of the tokens: the gradient
        # average over dp x cp is then the gradient of the global mean
        result = self.executor.step(tokens, labels, num_tokens / self.grid.dp_cp.size)
        if self._tied:
            peer = self.last_rank if self.grid.pp.rank == 0 else 0
            exchange_tied_grad(self.grid.pp, self.dp.grad_buffer(self._tied[0]), peer)
        self.dp.finish_grad_sync()
        return result

    def local_sequences(
        self, tokens: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This cp rank's zig-zag share of sequences [B, S] (all of them without context
        parallelism), with the stages' ring attention set for length S."""
        cp = self.grid.cp
        if cp.size == 1:
            return tokens, labels
        seq = tokens.shape[1]
        if seq not in self._rings:
            self._rings[seq] = RingAttention(cp, seq, self.device)
        for stage in self.stages:
            stage.attn_backend = self._rings[seq]
        local = zigzag_shard(tokens, cp.size, cp.rank)
        return local, None if labels is None else zigzag_shard(labels, cp.size, cp.rank)

    def supervised_tokens(self, labels: torch.Tensor) -> int:
        """Labels != IGNORE_INDEX of this rank's sequences (its cp share) summed over the
        dp x cp ranks (uncounted: 8 bytes)."""
        count = (labels != IGNORE_INDEX).sum().to(torch.float64).to(self.device)
        with self.grid.counter.paused():
            self.grid.dp_cp.all_reduce(count)
        return int(count.item())

    def step(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None = None,
        num_tokens: int | None = None,
        skip_nonfinite: bool = False,
    ) -> TrainStepOutput:
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
        return TrainStepOutput(loss, norm, result, metrics, applied, self.routing_stats(applied))

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
        last = self._tied and self.grid.pp.rank == self.last_rank
        sumsq = self.dp.local_sumsq(skip=self._tied[0] if last else None)
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
            self.grid.dp_cp.all_reduce(value)
        return value.item() / self.grid.dp_cp.size


def parallelize(
    model: Transformer,
    grid: RankGrid,
    plan: ParallelPlan,
    *,
    layers_per_stage: Sequence[int] | None = None,
    record_events: bool = False,
    objective: Objective | None = None,
) -> TrainingEngine:
    """FP8 -> TP/SP -> recompute -> stage split -> DP/ZeRO on this rank; see `TrainingEngine`."""
    return TrainingEngine(model, grid, plan, layers_per_stage, record_events, objective)
