"""Dependency-checked simulated execution of a pipeline schedule.

The model of execution is the executor's: a SEND never blocks (isend), a RECV blocks until the
matching message was sent, messages on one (src, dst) channel arrive in FIFO order, and a
compute runs for a fixed time. If the simulation cannot finish, some rank waits on a message
that is never sent: the schedule would hang on real hardware, and `DeadlockError` says where.

Times are per full stage: a rank's whole forward costs `t_fwd`, so each of its v chunks costs
t_fwd / v. That keeps the per-rank work equal across v and makes bubbles comparable.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from llmopt.parallel.pipeline.schedule import Action, PipelineSchedule, ScheduleError


class DeadlockError(ScheduleError):
    """No rank can make progress but some still have actions left."""


@dataclass(frozen=True)
class Event:
    """A compute action with its start and end time (seconds, or simulated units)."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Bubble:
    """A step's makespan and compute time per rank: the idle fraction the simulator predicts
    and `llmopt.validate.pipeline_measure` measures, defined once for both."""

    makespan: float
    busy: tuple[float, ...]  # compute time per rank

    @property
    def bubble(self) -> tuple[float, ...]:
        """Idle fraction of the step per rank: 1 - busy / makespan."""
        return tuple(1.0 - b / self.makespan for b in self.busy)

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble) / len(self.bubble)


@dataclass(frozen=True)
class SimulationResult(Bubble):
    peak_in_flight: tuple[int, ...]  # max (micro-batch, chunk) activations held per rank
    events: tuple[tuple[Event, ...], ...]


def theoretical_bubble(pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of the step with uniform stages and no comm cost.

    (p-1)/(m+p-1) for GPipe and 1F1B; with v chunks per rank the fill/drain shrinks by v:
    ((p-1)/v) / (m + (p-1)/v) = (p-1)/(v*m + p-1) (Narayanan et al. 2021, Megatron-LM).
    """
    p, m, v = pp, num_microbatches, virtual_stages
    return (p - 1) / (v * m + p - 1)


def simulate(
    schedule: PipelineSchedule,
    t_fwd: float = 1.0,
    t_bwd: float = 2.0,
    t_comm: float = 0.0,
) -> SimulationResult:
    """Run the schedule on an ideal machine, checking every dependency on the way."""
    pp, m, v = schedule.pp, schedule.num_microbatches, schedule.virtual_stages
    num_stages = schedule.num_stages
    dur = {"F": t_fwd / v, "B": t_bwd / v}
    channels: dict[tuple[int, int], deque[tuple[tuple[str, int, int], float]]] = {}
    pointer = [0] * pp
    clock = [0.0] * pp
    busy = [0.0] * pp
    in_flight = [0] * pp
    peak = [0] * pp
    ready: list[dict[tuple[str, int, int], float]] = [{} for _ in range(pp)]
    done: dict[tuple[str, int, int], int] = {}
    events: list[list[Event]] = [[] for _ in range(pp)]

    def fail(rank: int, action: Action, why: str) -> None:
        raise ScheduleError(f"rank {rank} action {action}: {why}")

    def step(rank: int) -> bool:
        """Execute rank's next action if possible; False when it must wait."""
        action = schedule.actions[rank][pointer[rank]]
        op, mb, stage = action.op, action.mb, action.stage
        if not (0 <= mb < m and 0 <= stage < num_stages):
            fail(rank, action, f"micro-batch/stage out of range (m={m}, stages={num_stages})")
        if action.is_compute or op.startswith("SEND"):
            if schedule.rank_of(stage) != rank:
                fail(rank, action, f"stage {stage} lives on rank {schedule.rank_of(stage)}")
        if op == "F" or op == "B":
            if (op, mb, stage) in done:
                fail(rank, action, "runs twice")
            if op == "F":
                need = ("act", mb, stage - 1) if stage > 0 else None
            else:
                if ("F", mb, stage) not in done:
                    fail(rank, action, "backward before its forward")
                need = ("grad", mb, stage + 1) if stage < num_stages - 1 else None
            start = clock[rank]
            if need is not None:
                if need not in ready[rank]:
                    fail(rank, action, f"input {need} was never received")
                start = max(start, ready[rank].pop(need))
            end = start + dur[op]
            clock[rank] = end
            busy[rank] += dur[op]
            done[(op, mb, stage)] = rank
            events[rank].append(Event(action, start, end))
            if op == "F":
                in_flight[rank] += 1
                peak[rank] = max(peak[rank], in_flight[rank])
                if stage < num_stages - 1 and schedule.rank_of(stage + 1) == rank:
                    ready[rank][("act", mb, stage)] = end
            else:
                in_flight[rank] -= 1
                if stage > 0 and schedule.rank_of(stage - 1) == rank:
                    ready[rank][("grad", mb, stage)] = end
        elif op in ("SEND_F", "SEND_B"):
            kind_op = "F" if op == "SEND_F" else "B"
            if (kind_op, mb, stage) not in done:
                fail(rank, action, "sends a tensor that was not computed yet")
            target = stage + 1 if op == "SEND_F" else stage - 1
            if action.peer != schedule.rank_of(target):
                fail(rank, action, f"peer should be rank {schedule.rank_of(target)}")
            channels.setdefault((rank, action.peer), deque()).append(
                (action.message(), clock[rank] + t_comm)
            )
        elif op in ("RECV_F", "RECV_B"):
            queue = channels.get((action.peer, rank))
            if not queue:
                return False
            message, arrival = queue.popleft()
            if message != action.message():
                fail(
                    rank,
                    action,
                    f"channel {action.peer}->{rank} delivers {message} first (FIFO order)",
                )
            clock[rank] = max(clock[rank], arrival)
            ready[rank][message] = arrival
        else:
            fail(rank, action, f"unknown op {op!r}")
        pointer[rank] += 1
        return True

    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for rank in range(pp):
            while pointer[rank] < len(schedule.actions[rank]) and step(rank):
                progressed = True
                remaining -= 1
        if not progressed:
            stuck = [
                f"rank {r} waits at {schedule.actions[r][pointer[r]]}"
                for r in range(pp)
                if pointer[r] < len(schedule.actions[r])
            ]
            raise DeadlockError("pipeline deadlock: " + "; ".join(stuck))
    for op in ("F", "B"):
        for mb in range(m):
            for stage in range(num_stages):
                if (op, mb, stage) not in done:
                    raise ScheduleError(f"{op} of micro-batch {mb} on stage {stage} never runs")
    unread = {ch: [msg for msg, _ in q] for ch, q in channels.items() if q}
    if unread:
        raise ScheduleError(f"messages never received: {unread}")
    return SimulationResult(
        makespan=max(clock),
        busy=tuple(busy),
        peak_in_flight=tuple(peak),
        events=tuple(tuple(e) for e in events),
    )
