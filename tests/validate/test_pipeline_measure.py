"""Measured bubbles: the executor's recorded events and idle fractions on real processes."""

from __future__ import annotations

import pytest
import torch

from llmopt.models import ModelConfig, build_model
from llmopt.parallel.pipeline.schedule import Action, build_schedule
from llmopt.parallel.pipeline.simulate import Event, simulate
from llmopt.validate.pipeline_measure import measure_bubble
from tests.dist_helpers import run_distributed


def test_measure_bubble_on_known_events():
    f, b = Action("F", 0, 0), Action("B", 0, 0)
    events = [[Event(f, 0.0, 1.0), Event(b, 3.0, 5.0)], [Event(f, 1.0, 2.0), Event(b, 2.0, 4.0)]]
    measured = measure_bubble(events, [(0.0, 5.0), (0.5, 4.0)])
    assert measured.makespan == 5.0
    assert measured.busy == (3.0, 3.0)
    assert measured.bubble == (0.4, 0.4)
    # The simulator on the same schedule gives the same numbers for pp=2, m=1.
    sim = simulate(build_schedule("gpipe", 2, 1), t_fwd=1.0, t_bwd=2.0)
    assert sim.bubble == (0.5, 0.5)  # (p-1)/(m+p-1) = 1/2


T_FWD, T_BWD = 0.03, 0.06


def _delayed_worker(rank: int, world: int, name: str, m: int):
    import torch.distributed as dist

    from llmopt.parallel.comm import CommCounter, Group
    from llmopt.parallel.pipeline.executor import PipelineExecutor
    from llmopt.parallel.pipeline.stage import split_model
    from llmopt.validate.pipeline_measure import add_uniform_delay

    cfg = ModelConfig("d", 32, 16, 32, 2, num_heads=2, num_kv_heads=2, max_seq_len=8)
    stages = [add_uniform_delay(s, T_FWD, T_BWD) for s in split_model(build_model(cfg), rank, 2)]
    group = Group("pp", (0, 1), rank, dist.group.WORLD, CommCounter())
    executor = PipelineExecutor(stages, build_schedule(name, 2, m), group, record_events=True)
    tokens = torch.zeros(m, 4, dtype=torch.long)
    executor.step(tokens, tokens)  # warm-up
    dist.barrier()
    result = executor.step(tokens, tokens)
    return result.events, (result.start, result.end)


@pytest.mark.dist
def test_measured_bubble_of_uniform_stages_tracks_theory():
    out = run_distributed(_delayed_worker, 2, "1f1b", 4, timeout_s=120)
    events = [e for e, _ in out]
    schedule = build_schedule("1f1b", 2, 4)
    for rank in range(2):  # the executor ran exactly the schedule's compute order
        assert [e.action for e in events[rank]] == schedule.compute_actions(rank)
        assert all(e.end - e.start >= T_FWD for e in events[rank])
    measured = measure_bubble(events, [w for _, w in out])
    theory = 1 / 5  # (p-1)/(m+p-1)
    # Lower bound is hard (a rank cannot beat the dependency chain, minus timer jitter); the
    # upper bound is loose because other jobs share this 2-core machine and delay wake-ups.
    for bubble in measured.bubble:
        assert 0.9 * theory <= bubble <= 1.5 * theory, measured.bubble
