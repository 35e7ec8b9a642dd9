"""Run one rank's pipeline program: forwards, backwards and point-to-point transfers.

The program is the schedule's action list, executed verbatim. Consecutive SEND/RECV actions
go out as one `batch_isend_irecv` on the PP group (through `llmopt.parallel.comm`, so every
byte is counted). A RECV is waited for before the next compute; a SEND is only waited for at the
end of the step — the execution model the simulator checked for deadlocks.

Loss scaling: each micro-batch's loss is its token-loss *sum* divided by the number of
*supervised* tokens (labels != IGNORE_INDEX) of the whole batch (all micro-batches, and all DP
replicas when the caller passes `num_tokens`), so the accumulated gradient is exactly the
gradient of the global-batch mean over supervised tokens — not of the last micro-batch, not m
times too large (the bug class of torchtitan #1733 and NeMo's "only the last micro-batch
trained"), and not a mean of per-micro-batch means when masks leave them unequal counts. A
custom `loss_fn` keeps this for free by returning a *sum* over its supervised tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmopt.models.spec import spec_for
from llmopt.parallel.comm import Group
from llmopt.parallel.pipeline.schedule import Action, PipelineSchedule, ScheduleError
from llmopt.parallel.pipeline.simulate import Event
from llmopt.parallel.pipeline.stage import PipelineStage

IGNORE_INDEX = -100

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies in fp32 (labels == -100 are ignored)."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@dataclass
class StepResult:
    """`loss` is the global-batch mean loss on the rank holding the last stage, else None."""

    loss: float | None
    events: list[Event] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0


class PipelineExecutor:
    """Executes `schedule` for one PP rank holding `stages` (its chunks, in chunk order).

    `activation_shape(micro_batch_size, seq_len)` gives the shape of the tensors that cross
    stages (default [b, T, hidden]; sequence parallelism shards T). `no_sync()` is entered for
    every backward except each chunk's last one, so data parallelism can skip its gradient
    reduction on inner micro-batches; stages in `defer_sync_stages` run every backward inside
    it (their reduction is launched by the caller, e.g. after summing tied weights' gradients
    across stages). `record_events` keeps wall-clock compute events for
    timelines and measured bubbles.
    """

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        schedule: PipelineSchedule,
        group: Group,
        *,
        loss_fn: LossFn = cross_entropy_sum,
        activation_shape: Callable[[int, int], tuple[int, ...]] | None = None,
        dtype: torch.dtype | None = None,
        tied_embeddings: bool = False,
        no_sync: Callable[[], AbstractContextManager] | None = None,
        defer_sync_stages: Collection[int] = (),
        record_events: bool = False,
    ) -> None:
        if group.size != schedule.pp:
            raise ScheduleError(
                f"PP group has {group.size} ranks but the schedule pp={schedule.pp}"
            )
        self.rank = group.rank
        self.group = group
        self.schedule = schedule
        expected = list(range(self.rank, schedule.num_stages, schedule.pp))
        got = [s.stage for s in stages]
        if got != expected:
            raise ScheduleError(f"pp rank {self.rank} must hold stages {expected}, got {got}")
        self.stages = {s.stage: s for s in stages}
        self.loss_fn = loss_fn
        first = stages[0]
        hidden = first.config.hidden_size
        self.activation_shape = activation_shape or (lambda b, t: (b, t, hidden))
        param = next(iter(first.parameters()), None)
        self.dtype = dtype or (param.dtype if param is not None else torch.float32)
        self.device = param.device if param is not None else torch.device("cpu")
        self.tied_embeddings = tied_embeddings and schedule.pp > 1
        self.no_sync = no_sync
        self.defer_sync_stages = frozenset(defer_sync_stages)
        self.record_events = record_events

    # ---- one training step ----
    def step(
        self,
        tokens: torch.Tensor | None,
        labels: torch.Tensor | None,
        num_tokens: float | None = None,
    ) -> StepResult:
        """Forward and backward of the batch [B, T] split into m micro-batches of B/m rows.

        `tokens` is needed on the first stage's rank, `labels` on the last stage's; other
        ranks may pass None (they only need the shape, given by whichever is present).
        `num_tokens`: the divisor of every micro-batch's loss sum (default: this batch's
        supervised-token count); a batch with none supervised gets zero loss and gradient.
        """
        m = self.schedule.num_microbatches
        ref = tokens if tokens is not None else labels
        if ref is None:
            raise ValueError("step needs tokens or labels to know the batch shape")
        batch, seq_len = ref.shape
        if batch % m:
            raise ValueError(
                f"batch size {batch} is not divisible by num_microbatches={m}; "
                f"use a batch size that is a multiple of {m}"
            )
        mb_size = batch // m
        holds_first = 0 in self.stages
        holds_last = self.schedule.num_stages - 1 in self.stages
        if holds_first and tokens is None:
            raise ValueError("the rank holding the first stage needs tokens")
        if holds_last and labels is None:
            raise ValueError("the rank holding the last stage needs labels")
        if holds_last and num_tokens is None:
            num_tokens = int((labels != IGNORE_INDEX).sum())
        if num_tokens == 0:
            num_tokens = 1  # all masked: the sums are 0, so are the loss and the gradient
        shape = self.activation_shape(mb_size, seq_len)

        def rows(t: torch.Tensor, mb: int) -> torch.Tensor:
            return t[mb * mb_size : (mb + 1) * mb_size]

        inputs: dict[tuple[int, int], torch.Tensor] = {}  # (mb, stage) -> stage input
        outputs: dict[tuple[int, int], torch.Tensor] = {}  # (mb, stage) -> output or loss
        arrived: dict[tuple[str, int, int], torch.Tensor] = {}  # message -> received tensor
        to_send: dict[tuple[str, int, int], torch.Tensor] = {}
        pending: list = []  # send works, waited at the end of the step
        remaining_bwd = {s: m for s in self.stages}
        losses: list[torch.Tensor] = []
        events: list[Event] = []
        step_start = time.perf_counter()

        actions = self.schedule.actions[self.rank]
        i = 0
        while i < len(actions):
            action = actions[i]
            if not action.is_compute:
                j = i
                while j < len(actions) and not actions[j].is_compute:
                    j += 1
                pending += self._communicate(actions[i:j], shape, to_send, arrived)
                i = j
                continue
            t0 = time.perf_counter()
            key = (action.mb, action.stage)
            stage = self.stages[action.stage]
            if action.op == "F":
                if stage.is_first:
                    x = rows(tokens, action.mb)
                else:
                    x = arrived.pop(("act", action.mb, action.stage - 1)).requires_grad_()
                    inputs[key] = x
                y = stage(x, seq_len)
                if stage.is_last:
                    y = self.loss_fn(y, rows(labels, action.mb)) / num_tokens
                    losses.append(y.detach())
                else:
                    to_send[("act", action.mb, action.stage)] = y.detach()
                outputs[key] = y
            else:
                y = outputs.pop(key)
                remaining_bwd[action.stage] -= 1
                sync = remaining_bwd[action.stage] == 0
                sync = sync and action.stage not in self.defer_sync_stages
                ctx = self.no_sync() if self.no_sync and not sync else nullcontext()
                with ctx:
                    if stage.is_last:
                        y.backward()
                    else:
                        y.backward(arrived.pop(("grad", action.mb, action.stage + 1)))
                if not stage.is_first:
                    to_send[("grad", action.mb, action.stage)] = inputs.pop(key).grad
            if self.record_events:
                events.append(Event(action, t0, time.perf_counter()))
            i += 1
        for work in pending:
            work.wait()
        if arrived or to_send or outputs or inputs:
            raise ScheduleError(
                f"pp rank {self.rank}: step ended with unused tensors "
                f"(arrived={list(arrived)}, unsent={list(to_send)})"
            )
        if self.tied_embeddings:
            self._sync_tied_grads()
        loss = float(torch.stack(losses).sum()) if losses else None
        return StepResult(loss, events, step_start, time.perf_counter())

    def _communicate(
        self,
        actions: Sequence[Action],
        shape: tuple[int, ...],
        to_send: dict[tuple[str, int, int], torch.Tensor],
        arrived: dict[tuple[str, int, int], torch.Tensor],
    ) -> list:
        ops, recvs = [], []
        for action in actions:
            message = action.message()
            if action.op.startswith("SEND"):
                ops.append(("send", to_send.pop(message).contiguous(), action.peer))
            else:
                buf = torch.empty(shape, dtype=self.dtype, device=self.device)
                ops.append(("recv", buf, action.peer))
                recvs.append((message, buf))
        works = self.group.batch_p2p(ops)
        sends = []
        for (kind, _, _), work in zip(ops, works):
            if kind == "recv":
                work.wait()
            else:
                sends.append(work)
        for message, buf in recvs:
            arrived[message] = buf
        return sends

    def _sync_tied_grads(self) -> None:
        """Embedding (first stage) and head (last stage) share one weight: sum their grads."""
        last_rank = self.schedule.rank_of(self.schedule.num_stages - 1)
        if self.rank == 0:
            stage, role, peer = self.stages[0], "embedding", last_rank
        elif self.rank == last_rank:
            stage, role, peer = self.stages[self.schedule.num_stages - 1], "head", 0
        else:
            return
        weight = spec_for(stage).top_module(stage, role).weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        exchange_tied_grad(self.group, weight.grad, peer)


def exchange_tied_grad(group: Group, grad: torch.Tensor, peer: int) -> None:
    """Tied embedding/head: add the peer stage's gradient of the shared weight to `grad`, in
    place (the peer does the same with ours).

    Both ranks send their part and add the other's, so each holds g_embed + g_head (float
    addition is commutative: the two copies stay bit-identical)."""
    other = torch.empty_like(grad)
    group.batch_p2p([("send", grad.detach().clone(), peer), ("recv", other, peer)], wait=True)
    grad.add_(other)
