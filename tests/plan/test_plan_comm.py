"""Collective counts and bytes per process group: exact formulas an engine trace must match."""

from __future__ import annotations

import numpy as np
import pytest

from llmopt.models.presets import get_preset
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.comm import collectives_for, summarize
from llmopt.plan.grid import to_grid
from llmopt.plan.hardware import get_cluster
from llmopt.plan.memory import layer_params_per_rank, stage_params
from llmopt.plan.timing import comm_bytes_per_gpu, step_time
from llmopt.plan.workload import Workload

MODEL = get_preset("llama-3-70b")
CLUSTER = get_cluster("dgx-h100", 8)
WORK = Workload()


def _totals(par: ParallelPlan, work: Workload = WORK, stage: str = "last"):
    return summarize(collectives_for(MODEL, work, CLUSTER, par, stage=stage))


def test_tp_sequence_parallel_counts_and_bytes():
    par = ParallelPlan(
        tp=8, pp=8, dp=1, sequence_parallel=True, micro_batch=2, num_microbatches=512
    )
    rows = collectives_for(MODEL, WORK, CLUSTER, par, stage="first")
    act = 2 * 4096 * 8192 * 2  # micro-batch x seq x hidden x bf16
    layers = 80 // 8
    fwd_ag = [
        r for r in rows if (r["group"], r["op"], r["phase"]) == ("tp", "all-gather", "forward")
    ]
    assert len(fwd_ag) == 1
    assert fwd_ag[0]["calls"] == 2 * layers * 512
    assert fwd_ag[0]["payload_bytes"] == act
    assert fwd_ag[0]["link"] == "intra_node"
    assert fwd_ag[0]["wire_bytes"] == pytest.approx(fwd_ag[0]["calls"] * act * 7 / 8)
    # With SP the only TP all-reduce is the per-step one of the partial norm-weight gradients
    # (2 norms per layer, fp32); the embedding uses a reduce-scatter.
    ar = [r for r in rows if r["op"] == "all-reduce" and r["group"] == "tp"]
    assert [(r["phase"], r["calls"], r["payload_bytes"]) for r in ar] == [
        ("step", 1, 2 * layers * 8192 * 4)
    ]


def test_tp_without_sp_uses_all_reduce_and_full_recompute_repeats_forward():
    base = dict(tp=8, pp=8, dp=1, micro_batch=1, num_microbatches=1024)
    plain = _totals(ParallelPlan(**base), stage="first")
    full = _totals(ParallelPlan(recompute="full", **base), stage="first")
    per_layer_mb = 10 * 1024
    # Forward 2 + backward 2 per layer and micro-batch, plus the embedding's forward all-reduce.
    assert plain[("tp", "all-reduce")]["calls"] == 4 * per_layer_mb + 1024
    assert full[("tp", "all-reduce")]["calls"] == 6 * per_layer_mb + 1024


def test_tp16_crosses_nodes_and_sends_more_inter_node_bytes():
    inside = ParallelPlan(
        tp=8, pp=8, dp=1, sequence_parallel=True, micro_batch=1, num_microbatches=1024
    )
    across = ParallelPlan(
        tp=16, pp=4, dp=1, sequence_parallel=True, micro_batch=1, num_microbatches=1024
    )
    rows_in = collectives_for(MODEL, WORK, CLUSTER, inside)
    rows_x = collectives_for(MODEL, WORK, CLUSTER, across)
    assert {r["link"] for r in rows_in if r["group"] == "tp"} == {"intra_node"}
    assert {r["link"] for r in rows_x if r["group"] == "tp"} == {"inter_node"}
    b_in = comm_bytes_per_gpu(MODEL, WORK, CLUSTER, to_grid(inside))["inter_node"][0]
    b_x = comm_bytes_per_gpu(MODEL, WORK, CLUSTER, to_grid(across))["inter_node"][0]
    assert b_x > 100 * b_in
    t_in = step_time(MODEL, WORK, CLUSTER, to_grid(inside))
    t_x = step_time(MODEL, WORK, CLUSTER, to_grid(across))
    # 8 ranks of each TP16 group per node: its rings cross the network on 8 NICs (8 x 40 GB/s),
    # a little below NVLink's 360 GB/s, so TP across nodes costs more but not 8x more
    assert t_x["tp_comm_exposed"][0] > 1.1 * t_in["tp_comm_exposed"][0]
    assert t_x["total"][0] > t_in["total"][0]


def test_ring_collective_across_nodes_uses_one_nic_per_member_on_the_node():
    """A DP all-reduce whose group has k ranks per node runs k rings on k NICs (NVIDIA measures
    192 GB/s across DGX-A100 nodes with 8 x 200 Gb/s NICs); a send uses its own NIC."""
    from llmopt.plan.comm import Collectives

    net, nvl = CLUSTER.inter_node.bytes_per_s, CLUSTER.intra_node.bytes_per_s
    one = np.ones(3)

    k = np.array([1, 4, 8])
    c = Collectives("dp", "all-reduce", "step", "all", one, one * 8e9, one * 64, one > 0, k)
    wire = c.wire_bytes_per_call
    lat = 12 * CLUSTER.inter_node.latency_us * 1e-6  # 2 x log2(64) steps
    expected = wire / np.minimum(k * net, nvl) + lat
    assert c.seconds_per_call(CLUSTER) == pytest.approx(expected)
    send = Collectives("pp", "send", "step", "all", one, one * 8e9, one * 2, one > 0, k)
    assert send.seconds_per_call(CLUSTER) == pytest.approx(8e9 / net + lat / 12)
    grid = to_grid(ParallelPlan(tp=1, pp=1, dp=64, micro_batch=1, num_microbatches=1))
    from llmopt.plan.comm import members_per_node

    assert members_per_node(CLUSTER, grid)["dp"][0] == 8


def test_zero2_has_no_forward_gather_zero3_does():
    base = dict(tp=8, pp=1, dp=8, sequence_parallel=True, micro_batch=1, num_microbatches=128)
    params = float(np.max(stage_params(MODEL, to_grid(ParallelPlan(**base)))))
    for z in (0, 1, 2, 3):
        rows = collectives_for(MODEL, WORK, CLUSTER, ParallelPlan(zero_stage=z, **base))
        fwd = [r for r in rows if r["group"] == "dp" and r["phase"] == "forward"]
        if z < 3:
            assert fwd == []
        else:
            # Blocks gathered before every micro-batch; the root unit (embedding, final norm,
            # head) once, kept gathered for the step (as the engine and FSDP2 do).
            assert [(r["op"], r["calls"]) for r in fwd] == [("all-gather", 128), ("all-gather", 1)]
            blocks = MODEL.num_layers * float(layer_params_per_rank(MODEL, np.array(8)))
            assert fwd[0]["payload_bytes"] == pytest.approx(2 * blocks)  # bf16 weights
            assert fwd[1]["payload_bytes"] == pytest.approx(2 * (params - blocks))
            assert {r["link"] for r in fwd} == {"inter_node"}


def test_zero3_moves_one_and_a_half_times_ddp_bytes():
    """ZeRO paper: DDP all-reduce 2Ψ vs ZeRO-3 all-gather x2 + reduce-scatter = 3Ψ (bf16 grads),
    less the root unit (embedding, head: 2% of a 70B model) that is not re-gathered for
    backward because it stays gathered from forward."""
    work = Workload(state_bytes="zero")
    base = dict(tp=8, pp=1, dp=8, sequence_parallel=True, micro_batch=128, num_microbatches=1)
    ddp = _totals(ParallelPlan(zero_stage=0, **base), work)
    z3 = _totals(ParallelPlan(zero_stage=3, **base), work)
    ddp_wire = sum(v["wire_bytes"] for (g, _), v in ddp.items() if g == "dp")
    z3_wire = sum(v["wire_bytes"] for (g, _), v in z3.items() if g == "dp")
    grid = to_grid(ParallelPlan(zero_stage=3, **base))
    psi = float(np.max(stage_params(MODEL, grid)))
    root = psi - MODEL.num_layers * float(layer_params_per_rank(MODEL, np.array(8)))
    assert z3_wire / ddp_wire == pytest.approx((3 * psi - root) / (2 * psi), rel=1e-12)
    assert z3_wire / ddp_wire == pytest.approx(1.5, rel=0.02)


def test_pipeline_sends_per_chunk_boundary():
    par = ParallelPlan(
        tp=4, pp=4, dp=4, sequence_parallel=True, micro_batch=1, num_microbatches=256,
        schedule="interleaved", virtual_stages=2,
    )  # fmt: skip
    msg = 4096 * 8192 * 2 / 4  # SP-sharded activation of one micro-batch
    calls = {}
    for stage in ("first", "last"):
        for r in collectives_for(MODEL, WORK, CLUSTER, par, stage):
            if r["group"] == "pp":
                key = (stage, r["op"], r["phase"])
                calls[key] = calls.get(key, 0) + r["calls"]
                assert r["payload_bytes"] == msg and r["link"] == "inter_node"
    v_m = 2 * 256
    # The model's first chunk has no predecessor, its last chunk no successor.
    assert calls[("first", "send", "forward")] == v_m
    assert calls[("first", "recv", "forward")] == v_m - 256
    assert calls[("first", "send", "backward")] == v_m - 256
    assert calls[("first", "recv", "backward")] == v_m
    assert calls[("last", "send", "forward")] == v_m - 256
    assert calls[("last", "recv", "forward")] == v_m
    assert calls[("last", "send", "backward")] == v_m
    assert calls[("last", "recv", "backward")] == v_m - 256


def test_single_stage_has_no_pipeline_traffic():
    par = ParallelPlan(tp=8, pp=1, dp=8, sequence_parallel=True, num_microbatches=128)
    for stage in ("first", "last"):
        assert not [
            r for r in collectives_for(MODEL, WORK, CLUSTER, par, stage) if r["group"] == "pp"
        ]


def test_vectorised_bytes_equal_the_explicit_list():
    pars = [
        ParallelPlan(tp=4, pp=4, dp=4, sequence_parallel=True, zero_stage=1, num_microbatches=256),
        ParallelPlan(
            tp=2, pp=2, dp=8, cp=2, sequence_parallel=True, zero_stage=3, num_microbatches=64
        ),
        ParallelPlan(tp=8, pp=1, dp=8, zero_stage=2, micro_batch=4, num_microbatches=32),
    ]
    for par in pars:
        rows = collectives_for(
            MODEL, Workload(seq_len=8192, global_batch=1024), CLUSTER, par, "last"
        )
        vec = comm_bytes_per_gpu(
            MODEL, Workload(seq_len=8192, global_batch=1024), CLUSTER, to_grid(par)
        )
        # across nodes a rank's NIC carries `network_bytes`, NVLink the rest of its ring traffic
        net = sum(r["network_bytes"] for r in rows)
        nvl = sum(r["wire_bytes"] for r in rows) - net
        assert float(vec["inter_node"][0]) == pytest.approx(net, rel=1e-12)
        assert float(vec["intra_node"][0]) == pytest.approx(nvl, rel=1e-12)


@pytest.mark.parametrize("cp,recompute", [(2, "none"), (4, "none"), (4, "full")])
def test_cp_passes_kv_blocks_round_the_ring_each_layer(cp, recompute):
    work = Workload(seq_len=16384, global_batch=64)
    par = ParallelPlan(
        tp=8, pp=1, dp=8 // cp, cp=cp, sequence_parallel=True, micro_batch=1,
        num_microbatches=8, recompute=recompute,
    )  # fmt: skip
    t = _totals(par, work)
    # this rank's s/cp tokens x (K,V) x kv heads per rank (8/8) x head_dim x bf16
    block = 16384 // cp * 2 * 1 * 128 * 2
    passes = 80 * 8  # layers x micro-batches
    fwd = (cp - 1) * (2 if recompute == "full" else 1)  # the recomputed forward passes again
    # backward: cp-1 blocks with their gradients (2 blocks each), then the gradients home
    calls, blocks = fwd + (cp - 1) + 1, fwd + 2 * (cp - 1) + 1
    for op in ("send", "recv"):
        assert t[("cp", op)]["calls"] == calls * passes
        assert t[("cp", op)]["bytes"] == pytest.approx(blocks * block * passes, rel=1e-12)
    assert {k for k in t if k[0] == "cp"} == {("cp", "send"), ("cp", "recv")}
    # a rank puts what it sends on the wire, nothing for what it receives
    assert t[("cp", "send")]["wire_bytes"] == pytest.approx(blocks * block * passes, rel=1e-12)
    assert t[("cp", "recv")]["wire_bytes"] == 0


def test_ep_all_to_all_rows_are_the_dispatchers_calls_and_payload():
    from llmopt.plan.dispatch import call_bytes, calls_per_microbatch
    from llmopt.plan.grid import to_grid

    model = get_preset("mixtral-8x7b")
    work = Workload(seq_len=4096, global_batch=64)
    par = ParallelPlan(tp=2, pp=2, dp=4, ep=4, sequence_parallel=True, num_microbatches=16)
    for stage in ("first", "last"):
        t = summarize(collectives_for(model, work, CLUSTER, par, stage=stage))
        row = t[("ep", "all-to-all")]
        calls = int(calls_per_microbatch(model, False)) * 16 * 16  # 4 x 16 layers x 16 mb
        assert row["calls"] == calls
        payload = 4096 / 2 * 2 * 4096 * 2  # tokens / tp x top_k x hidden x bf16
        assert row["bytes"] == pytest.approx(calls * payload, rel=1e-12)
        intra, inter = call_bytes(model, CLUSTER, to_grid(par), 4096, "alltoall")
        assert row["wire_bytes"] == pytest.approx(calls * float((intra + inter)[0]), rel=1e-12)
    dense = summarize(collectives_for(MODEL, WORK, CLUSTER, ParallelPlan(tp=8, pp=8, dp=16)))
    assert not [k for k in dense if k[0] == "ep"]


def test_ep_rows_count_only_the_stages_moe_blocks():
    import dataclasses

    base = get_preset("mixtral-8x7b")
    # the last 24 of 32 blocks have experts: the first of 2 stages holds 8 of them
    model = base.replace(moe=dataclasses.replace(base.moe, moe_layers=24))
    work = Workload(seq_len=4096, global_batch=64)
    par = ParallelPlan(tp=1, pp=2, dp=4, ep=4, num_microbatches=16)
    first = summarize(collectives_for(model, work, CLUSTER, par, stage="first"))
    last = summarize(collectives_for(model, work, CLUSTER, par, stage="last"))
    assert first[("ep", "all-to-all")]["calls"] == 4 * 8 * 16
    assert last[("ep", "all-to-all")]["calls"] == 4 * 16 * 16


def test_tied_embeddings_swap_gradients_between_first_and_last_stage():
    gpt = get_preset("gpt3-175b")
    work = Workload(seq_len=2048, global_batch=64)
    par = ParallelPlan(tp=8, pp=8, dp=1, sequence_parallel=True, num_microbatches=64)
    grad = 51200 * 12288 / 8 * 4  # vocab-parallel shard of the fp32 gradient
    for stage in ("first", "last"):
        rows = collectives_for(gpt, work, CLUSTER, par, stage)
        step = [r for r in rows if r["phase"] == "step" and r["group"] == "pp"]
        assert sorted(r["op"] for r in step) == ["recv", "send"]
        assert all(r["calls"] == 1 and r["payload_bytes"] == grad for r in step)
    untied = collectives_for(MODEL, WORK, CLUSTER, par.__class__(tp=8, pp=8, num_microbatches=1024))
    assert not [r for r in untied if r["phase"] == "step" and r["group"] == "pp"]
