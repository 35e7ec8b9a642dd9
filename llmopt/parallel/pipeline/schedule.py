"""Pipeline schedules as plain data: each rank's ordered list of actions.

A schedule is computed once, checked by `llmopt.parallel.pipeline.simulate`, rendered by
`timeline`, and executed verbatim by `executor` — the same list in all three places, so what a
user debugs on the picture is what the ranks run.

Stages: the model is cut into `pp * v` virtual stages. Stage `s` lives on rank `s % pp` as its
local chunk `s // pp` (Megatron's interleaved layout; with v=1 stage s is simply rank s).

Communication is derived from the compute order, never written by hand: after a compute that
produces a tensor for another rank comes a SEND; before a compute that needs a tensor comes a
RECV. Messages on one (src, dst) channel are matched in FIFO order (NCCL has no tags), so a RECV
is hoisted earlier when the sender emits an earlier message on the same channel. Hoisting never
adds a wait: the hoisted message was sent before the one the compute needs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from llmopt.errors import LlmoptError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
ScheduleName = Literal["gpipe", "1f1b", "interleaved"]

COMPUTE_OPS = ("F", "B")
COMM_OPS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class ScheduleError(LlmoptError, ValueError):
    """A schedule configuration that cannot run, or a schedule that breaks a dependency."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's program.

    op: F / B (forward / backward of micro-batch `mb` on virtual stage `stage`), SEND_F / SEND_B
    (send the output activation / input gradient that `stage` produced to rank `peer`),
    RECV_F / RECV_B (receive the input activation / output gradient that `stage` consumes from
    rank `peer`).
    """

    op: str
    mb: int
    stage: int
    peer: int | None = None

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    def message(self) -> tuple[str, int, int]:
        """Identity of the tensor a SEND/RECV moves: (kind, micro-batch, producing stage)."""
        if self.op == "SEND_F":
            return ("act", self.mb, self.stage)
        if self.op == "RECV_F":
            return ("act", self.mb, self.stage - 1)
        if self.op == "SEND_B":
            return ("grad", self.mb, self.stage)
        if self.op == "RECV_B":
            return ("grad", self.mb, self.stage + 1)
        raise ScheduleError(f"{self} is not a communication action")

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.op}(mb={self.mb},s={self.stage}){peer}"


@dataclass(frozen=True)
class ScheduleConfig:
    """Validated pipeline schedule parameters (pp ranks, m micro-batches, v chunks per rank)."""

    name: str
    pp: int
    num_microbatches: int
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        if self.name == "interleaved-1f1b":
            raise ScheduleError("schedule 'interleaved-1f1b' is now called 'interleaved'")
        if self.name not in SCHEDULES:
            raise ScheduleError(
                f"unknown schedule {self.name!r}; choose from {', '.join(SCHEDULES)}"
            )
        for field_name in ("pp", "num_microbatches", "virtual_stages"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"{field_name}={value!r} must be a positive integer")
        pp, m, v = self.pp, self.num_microbatches, self.virtual_stages
        if self.name == "interleaved":
            if pp < 2:
                raise ScheduleError(
                    "interleaved needs pp >= 2 (got pp=1); use gpipe or 1f1b on one stage"
                )
            if v < 2:
                raise ScheduleError(
                    f"interleaved needs virtual_stages >= 2 (got {v}); use 1f1b for v=1"
                )
            if m < pp:
                raise ScheduleError(
                    f"interleaved needs num_microbatches >= pp: got num_microbatches={m} < pp={pp}"
                )
        elif v != 1:
            raise ScheduleError(
                f"schedule {self.name!r} runs one chunk per rank (got virtual_stages={v}); "
                "use interleaved for virtual_stages > 1"
            )

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages


@dataclass(frozen=True)
class PipelineSchedule:
    """Every rank's ordered action list for one training step."""

    config: ScheduleConfig
    actions: tuple[tuple[Action, ...], ...]

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def num_microbatches(self) -> int:
        return self.config.num_microbatches

    @property
    def virtual_stages(self) -> int:
        return self.config.virtual_stages

    @property
    def num_stages(self) -> int:
        return self.config.num_stages

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def chunk_of(self, stage: int) -> int:
        return stage // self.pp

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def format(self) -> str:
        """Human-readable per-rank programs (what `llmopt`'s debug output prints)."""
        lines = []
        for rank, acts in enumerate(self.actions):
            lines.append(f"rank {rank}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)


def _gpipe_order(pp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    return [("F", i, rank) for i in range(m)] + [("B", i, rank) for i in range(m)]


def _1f1b_order(pp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    # Warm up with just enough forwards to fill the pipe downstream, then alternate: at most
    # pp - rank activations are ever held (the reason 1F1B exists).
    warmup = min(pp - rank - 1, m)
    order = [("F", i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i, rank), ("B", i, rank)]
    order += [("B", i, rank) for i in range(m - warmup, m)]
    return order


def _interleaved_table(pp: int, m: int, v: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in forward order: groups of pp micro-batches sweep all chunks.

    When pp does not divide m the last group is enlarged to take the remainder (size pp..2pp-1):
    unlike a short last group (which deadlocks with this warm-up rule, as the simulator shows),
    it always runs, and with a remainder of 1 it still reaches the ideal bubble; larger
    remainders cost extra bubble (see docs/benchmarks/pipeline.md).
    """
    table: list[tuple[int, int]] = []
    first = 0
    while first < m:
        last = m if first + 2 * pp > m else first + pp
        table += [(mb, c) for c in range(v) for mb in range(first, last)]
        first = last
    return table


def _interleaved_order(pp: int, m: int, v: int, rank: int) -> list[tuple[str, int, int]]:
    table = _interleaved_table(pp, m, v)
    total = len(table)
    fwd = [("F", mb, c * pp + rank) for mb, c in table]
    bwd = [("B", mb, (v - 1 - c) * pp + rank) for mb, c in table]
    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = fwd[:warmup]
    emitted = set(order)
    nxt = warmup
    for op, mb, stage in bwd:
        # 1F1B steady state: one forward, then one backward. A longer last group (pp does not
        # divide m) needs a few extra forwards before its first backward on the last chunk.
        steady = nxt < total
        while steady or ("F", mb, stage) not in emitted:
            order.append(fwd[nxt])
            emitted.add(fwd[nxt])
            nxt += 1
            steady = False
        order.append((op, mb, stage))
    return order


def _insert_communication(
    pp: int, num_stages: int, orders: list[list[tuple[str, int, int]]]
) -> tuple[tuple[Action, ...], ...]:
    # 1. What each rank sends, in its compute order, per destination channel.
    channels: dict[tuple[int, int], deque[tuple[str, int, int]]] = {}
    for rank, order in enumerate(orders):
        for op, mb, stage in order:
            if op == "F" and stage < num_stages - 1 and (stage + 1) % pp != rank:
                channels.setdefault((rank, (stage + 1) % pp), deque()).append(("act", mb, stage))
            if op == "B" and stage > 0 and (stage - 1) % pp != rank:
                channels.setdefault((rank, (stage - 1) % pp), deque()).append(("grad", mb, stage))
    # 2. Each rank's program: RECVs (hoisted in channel order) + compute + SENDs.
    programs = []
    for rank, order in enumerate(orders):
        received: set[tuple[str, int, int]] = set()
        program: list[Action] = []
        for op, mb, stage in order:
            if op == "F" and stage > 0 and (stage - 1) % pp != rank:
                need, src = ("act", mb, stage - 1), (stage - 1) % pp
            elif op == "B" and stage < num_stages - 1 and (stage + 1) % pp != rank:
                need, src = ("grad", mb, stage + 1), (stage + 1) % pp
            else:
                need, src = None, None
            if need is not None and need not in received:
                queue = channels.get((src, rank), deque())
                if need not in queue:
                    raise ScheduleError(f"rank {rank} needs {need} that rank {src} never sends")
                while True:
                    kind, qmb, qstage = queue.popleft()
                    if kind == "act":
                        program.append(Action("RECV_F", qmb, qstage + 1, src))
                    else:
                        program.append(Action("RECV_B", qmb, qstage - 1, src))
                    received.add((kind, qmb, qstage))
                    if (kind, qmb, qstage) == need:
                        break
            program.append(Action(op, mb, stage))
            if op == "F" and stage < num_stages - 1 and (stage + 1) % pp != rank:
                program.append(Action("SEND_F", mb, stage, (stage + 1) % pp))
            if op == "B" and stage > 0 and (stage - 1) % pp != rank:
                program.append(Action("SEND_B", mb, stage, (stage - 1) % pp))
        programs.append(tuple(program))
    leftover = {ch: list(q) for ch, q in channels.items() if q}
    if leftover:
        raise ScheduleError(f"messages sent but never received: {leftover}")
    return tuple(programs)


def build_schedule(
    name: str, pp: int, num_microbatches: int, virtual_stages: int = 1
) -> PipelineSchedule:
    """Each rank's ordered action list for `name` with pp ranks, m micro-batches, v chunks."""
    config = ScheduleConfig(name, pp, num_microbatches, virtual_stages)
    m, v = num_microbatches, virtual_stages
    if name == "gpipe":
        orders = [_gpipe_order(pp, m, r) for r in range(pp)]
    elif name == "1f1b":
        orders = [_1f1b_order(pp, m, r) for r in range(pp)]
    else:
        orders = [_interleaved_order(pp, m, v, r) for r in range(pp)]
    return PipelineSchedule(config, _insert_communication(pp, config.num_stages, orders))
