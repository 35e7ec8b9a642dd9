"""Pipeline schedules as data: dependencies, deadlock freedom, memory and bubble, no processes."""

from __future__ import annotations

import dataclasses

import pytest

from llmopt.parallel.pipeline.schedule import (
    Action,
    ScheduleError,
    build_schedule,
)
from llmopt.parallel.pipeline.simulate import DeadlockError, simulate, theoretical_bubble
from llmopt.parallel.pipeline.timeline import render_png, render_text

CONFIGS = (
    [("gpipe", pp, m, 1) for pp in (1, 2, 3, 4, 8) for m in range(1, 2 * pp + 3)]
    + [("1f1b", pp, m, 1) for pp in (1, 2, 3, 4, 8) for m in range(1, 2 * pp + 3)]
    + [
        ("interleaved", pp, m, v)
        for pp in (2, 3, 4, 8)
        for v in (2, 3, 4)
        for m in range(pp, 3 * pp + 2)
    ]
)


@pytest.mark.parametrize("name,pp,m,v", CONFIGS)
def test_every_schedule_runs_each_compute_once_without_deadlock(name, pp, m, v):
    schedule = build_schedule(name, pp, m, v)
    result = simulate(schedule)  # raises on any unmet dependency, FIFO mismatch or deadlock
    for rank in range(pp):
        computes = schedule.compute_actions(rank)
        expected = {(op, mb, c * pp + rank) for op in "FB" for mb in range(m) for c in range(v)}
        assert {(a.op, a.mb, a.stage) for a in computes} == expected
        assert len(computes) == len(expected)
    # Every tensor that crosses ranks is sent once and received once.
    sends = sum(a.op.startswith("SEND") for acts in schedule.actions for a in acts)
    recvs = sum(a.op.startswith("RECV") for acts in schedule.actions for a in acts)
    assert sends == recvs == (2 * m * (pp * v - 1) if pp > 1 else 0)
    assert result.makespan > 0


@pytest.mark.parametrize("pp,m", [(pp, m) for pp in (1, 2, 4, 8) for m in (1, pp, 2 * pp + 1)])
def test_gpipe_holds_all_micro_batches_and_1f1b_at_most_pp(pp, m):
    gpipe = simulate(build_schedule("gpipe", pp, m))
    assert gpipe.peak_in_flight == tuple([m] * pp)
    one_f_one_b = simulate(build_schedule("1f1b", pp, m))
    # rank r holds at most pp - r activations: the first stage is the one that bounds memory.
    assert one_f_one_b.peak_in_flight == tuple(min(pp - r, m) for r in range(pp))
    assert max(one_f_one_b.peak_in_flight) <= pp


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 4), (4, 9), (8, 16), (3, 1)])
def test_bubble_matches_p_minus_1_over_m_plus_p_minus_1(name, pp, m):
    result = simulate(build_schedule(name, pp, m), t_fwd=1.0, t_bwd=2.0)
    expected = (pp - 1) / (m + pp - 1)
    assert theoretical_bubble(pp, m) == pytest.approx(expected)
    for bubble in result.bubble:  # exact up to float rounding: uniform stages, free comm
        assert bubble == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "pp,m,v", [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2)]
)
def test_interleaved_bubble_matches_the_interleaved_formula(pp, m, v):
    result = simulate(build_schedule("interleaved", pp, m, v), t_fwd=1.0, t_bwd=2.0)
    expected = (pp - 1) / (v * m + pp - 1)
    for bubble in result.bubble:
        assert bubble == pytest.approx(expected, abs=1e-12)
    plain = simulate(build_schedule("1f1b", pp, m)).mean_bubble
    assert result.mean_bubble < plain  # the point of interleaving


def test_interleaved_with_indivisible_m_runs_no_worse_than_1f1b():
    # m = 2pp+1: the enlarged last group costs some bubble but the schedule is valid.
    for pp in (2, 4):
        m = 2 * pp + 1
        result = simulate(build_schedule("interleaved", pp, m, 2))
        assert result.mean_bubble <= (pp - 1) / (m + pp - 1) + 1e-12


def test_uneven_stage_time_grows_the_bubble():
    base = simulate(build_schedule("1f1b", 4, 8), t_fwd=1.0, t_bwd=2.0, t_comm=0.0)
    slow = simulate(build_schedule("1f1b", 4, 8), t_fwd=1.0, t_bwd=2.0, t_comm=0.5)
    assert slow.makespan > base.makespan
    assert slow.mean_bubble > base.mean_bubble


@pytest.mark.parametrize(
    "args,message",
    [
        (("interleaved", 1, 4, 2), "interleaved needs pp >= 2 (got pp=1)"),
        (("interleaved", 4, 3, 2), "num_microbatches=3 < pp=4"),
        (("interleaved", 2, 4, 1), "virtual_stages >= 2 (got 1)"),
        (("1f1b", 2, 4, 2), "virtual_stages=2"),
        (("pipedream", 2, 4, 1), "unknown schedule 'pipedream'; choose from gpipe, 1f1b"),
        (("gpipe", 0, 4, 1), "pp=0 must be a positive integer"),
        (("gpipe", 2, 0, 1), "num_microbatches=0 must be a positive integer"),
    ],
)
def test_bad_configs_are_rejected_with_the_bad_value(args, message):
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_schedule(*args)


def _edit(schedule, rank, actions):
    programs = list(schedule.actions)
    programs[rank] = tuple(actions)
    return dataclasses.replace(schedule, actions=tuple(programs))


def test_simulator_detects_deadlock():
    schedule = build_schedule("1f1b", 2, 2)
    # Rank 0 waits for a gradient before sending any activation: a cycle.
    acts = list(schedule.actions[0])
    recv = next(a for a in acts if a.op == "RECV_B")
    acts.remove(recv)
    acts.insert(0, recv)
    with pytest.raises(DeadlockError, match="rank 0 waits at RECV_B"):
        simulate(_edit(schedule, 0, acts))


def test_simulator_detects_broken_dependencies():
    schedule = build_schedule("gpipe", 2, 2)
    acts = [a for a in schedule.actions[1] if not (a.op == "RECV_F" and a.mb == 1)]
    with pytest.raises(ScheduleError, match="never received"):
        simulate(_edit(schedule, 1, acts))
    acts = list(schedule.actions[1])
    first_b = next(i for i, a in enumerate(acts) if a.op == "B")
    acts.insert(0, acts.pop(first_b))
    with pytest.raises(ScheduleError, match="backward before its forward"):
        simulate(_edit(schedule, 1, acts))
    acts = list(schedule.actions[0]) + [Action("F", 0, 0)]
    with pytest.raises(ScheduleError, match="runs twice"):
        simulate(_edit(schedule, 0, acts))


def test_simulator_detects_fifo_order_mismatch():
    schedule = build_schedule("gpipe", 2, 3)
    acts = list(schedule.actions[1])
    recvs = [i for i, a in enumerate(acts) if a.op == "RECV_F"]
    acts[recvs[0]], acts[recvs[1]] = acts[recvs[1]], acts[recvs[0]]
    with pytest.raises(ScheduleError, match="FIFO order"):
        simulate(_edit(schedule, 1, acts))


def test_text_timeline_shows_fill_and_drain(tmp_path):
    result = simulate(build_schedule("1f1b", 2, 2), t_fwd=1.0, t_bwd=2.0)
    text = render_text(result.events, 2)
    assert text.splitlines() == [
        "rank 0: F0 F1 .  .  B0 B0 .  B1 B1",
        "rank 1: .  F0 B0 B0 F1 B1 B1",
    ]
    png = render_png(result.events, tmp_path / "t.png", pp=2, title="1f1b pp=2 m=2")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(tmp_path.iterdir()) == [png]  # atomic write leaves no temp file


def test_schedule_command_prints_json_and_rejects_bad_configs(tmp_path, capsys):
    import json

    from llmopt.parallel.pipeline.__main__ import main

    png = tmp_path / "s.png"
    assert main(["--schedule", "gpipe", "--pp", "2", "-m", "3", "--json", "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bubble_per_rank"] == pytest.approx([0.25, 0.25])  # (2-1)/(3+2-1)
    assert out["bubble_theory"] == pytest.approx(0.25)
    assert out["peak_in_flight"] == [3, 3]
    assert out["programs"][1][0] == "RECV_F(mb=0,s=1)@0"
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["--schedule", "interleaved", "--pp", "4", "-m", "2", "-v", "2"]) == 2
    assert "num_microbatches=2 < pp=4" in capsys.readouterr().err
