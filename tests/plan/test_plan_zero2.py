"""ZeRO-2/3 gradient policies: reduce-scatter every micro-batch vs accumulate full gradients
and reduce-scatter once per step — collectives, memory, exposed time, frameworks, why-not."""

from __future__ import annotations

import re

import numpy as np
import pytest

from llmopt.models.presets import get_preset
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.comm import collectives
from llmopt.plan.emit import EmitError, PlannedRun, check
from llmopt.plan.explain import why_not
from llmopt.plan.grid import to_grid
from llmopt.plan.hardware import get_cluster
from llmopt.plan.memory import split_state_bytes, stage_params
from llmopt.plan.rules import ConstraintError, parse_constraints
from llmopt.plan.search import estimate, ranked, search
from llmopt.plan.timing import step_time
from llmopt.plan.workload import Workload

MODEL = get_preset("llama-3-8b")
CLUSTER = get_cluster("dgx-h100", 2)
WORK = Workload(seq_len=4096, global_batch=128)
PLAN = ParallelPlan(tp=2, pp=1, dp=8, sequence_parallel=True, zero_stage=2, micro_batch=2,
                    num_microbatches=8)  # fmt: skip


def _dp_rs_calls(policy: str, plan: ParallelPlan = PLAN) -> int:
    cs = collectives(MODEL, WORK, CLUSTER, to_grid(plan, grad_reduce=policy))
    return sum(
        int(c.calls[0]) for c in cs if c.group == "dp" and c.op == "reduce-scatter"
        and c.stage == "last"
    )  # fmt: skip


@pytest.mark.parametrize("zero", [2, 3])
def test_reduce_scatters_per_step(zero):
    plan = PLAN.replace(zero_stage=zero)
    # block gradients and the root unit (embedding, norm, head): one each per micro-batch...
    assert _dp_rs_calls("microbatch", plan) == 2 * 8
    assert _dp_rs_calls("step", plan) == 2  # ...or one each per step


def test_step_policy_keeps_full_gradients():
    g_full, g_shard = (split_state_bytes(MODEL, stage_params(MODEL, to_grid(PLAN, grad_reduce=p))[1],
                                         to_grid(PLAN, grad_reduce=p), "megatron")["grads"][0]
                       for p in ("step", "microbatch"))  # fmt: skip
    params = stage_params(MODEL, to_grid(PLAN))[1][0]
    assert g_full == pytest.approx(4 * params)  # fp32 main_grad, full size
    assert g_shard == pytest.approx(4 * params / 8)  # sharded over dp=8
    a = estimate(MODEL, WORK, CLUSTER, PLAN, grad_reduce="step")
    b = estimate(MODEL, WORK, CLUSTER, PLAN)
    assert a.memory_bytes["grads"] - b.memory_bytes["grads"] == pytest.approx(4 * params * 7 / 8)
    assert a.grad_reduce == "step" and b.grad_reduce == "microbatch"


def test_exposed_reduce_time_by_hand():
    """Without overlap every reduce-scatter is exposed: the per-micro-batch policy pays m calls
    of the same payload the step policy sends once; the weight all-gather is the same."""
    work = Workload(seq_len=4096, global_batch=128, dp_comm_overlap=False)
    micro = step_time(MODEL, work, CLUSTER, to_grid(PLAN))["dp_comm_exposed"][0]
    once = step_time(MODEL, work, CLUSTER, to_grid(PLAN, grad_reduce="step"))["dp_comm_exposed"][0]
    cs = collectives(MODEL, work, CLUSTER, to_grid(PLAN, grad_reduce="step"))
    rs = sum(float(c.calls[0] * c.seconds_per_call(CLUSTER)[0]) for c in cs
             if c.group == "dp" and c.op == "reduce-scatter" and c.stage == "last")  # fmt: skip
    ag = sum(float(c.calls[0] * c.seconds_per_call(CLUSTER)[0]) for c in cs
             if c.group == "dp" and c.op == "all-gather" and c.stage == "last")  # fmt: skip
    assert once == pytest.approx(rs + ag, rel=1e-9)
    assert micro == pytest.approx(8 * rs + ag, rel=1e-9)


def test_frameworks_name_their_policy():
    big, cluster = get_preset("llama-3-70b"), get_cluster("dgx-h100", 8)
    work = Workload()
    titan = search(big, work, cluster, top_k=3, constraints={"pp": 4, "zero": 3},
                   framework="torchtitan")  # fmt: skip
    assert {p.grad_reduce for p in titan.plans} == {"step"}  # torch.distributed.pipelining
    g = titan.evaluation.grid
    valid = titan.evaluation.valid
    assert not (valid & (g["gacc"] == 0) & (g["zero"] >= 2) & (g["pp"] > 1)).any()
    r = search(MODEL, WORK, CLUSTER, top_k=1, framework="deepspeed")  # every micro-batch
    assert not (r.evaluation.valid & (r.evaluation.grid["gacc"] == 1)).any()
    r = search(MODEL, WORK, CLUSTER, top_k=1)  # the default search ranks both policies
    assert (r.evaluation.valid & (r.evaluation.grid["gacc"] == 1)).any()
    # ...but llmopt's own engine (its run config) reduce-scatters every micro-batch
    step = estimate(MODEL, WORK, CLUSTER, PLAN, grad_reduce="step")
    run = PlannedRun(MODEL, "llama-3-8b", WORK, CLUSTER, step)
    with pytest.raises(EmitError, match="llmopt's engine cannot express grad_reduce=step"):
        check(run, "llmopt")
    check(PlannedRun(MODEL, "llama-3-8b", WORK, CLUSTER, estimate(MODEL, WORK, CLUSTER, PLAN)),
          "llmopt")  # fmt: skip
    assert "grad_reduce=step" in "\n".join(
        estimate(MODEL, WORK, CLUSTER, PLAN.replace(zero_stage=1), grad_reduce="step").rejected
    )


@pytest.mark.parametrize("framework", ["megatron", "torchtitan", "llmopt"])
@pytest.mark.parametrize("spec", ["grad_reduce=step", "zero_stage=2,grad_reduce=microbatch",
                                  "zero_stage=3,grad_reduce=step", "zero_stage=1,grad_reduce=step"])  # fmt: skip
def test_why_not_agrees_with_the_ranking_on_the_policy(framework, spec):
    result = search(MODEL, WORK, CLUSTER, top_k=5, framework=framework)
    order = ranked(result.evaluation)
    g = result.evaluation.grid
    c = parse_constraints(spec)
    line = why_not(MODEL, WORK, CLUSTER, c, result)[0]
    match = np.ones(len(order), dtype=bool)
    for key, value in c.items():
        match &= g[key][order] == value
    found = re.search(r"ranks #(\d+)", line)
    if match.any():
        assert found and int(found.group(1)) == int(np.argmax(match)) + 1, line
    else:
        assert not found and "rejected" in line, line


def test_bad_policy_is_a_one_line_error():
    with pytest.raises(ConstraintError, match="grad_reduce='sometimes'; choose from microbatch"):
        parse_constraints("grad_reduce=sometimes")
    with pytest.raises(ValueError, match="grad_reduce='never'"):
        to_grid(PLAN, grad_reduce="never")
