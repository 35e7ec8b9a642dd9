"""Collectives of one training step, per process group, as pure functions of the plan.

`collectives()` lists, for one rank, every collective it joins in a step: process group
(tp, cp, ep, pp, dp, edp), operation (all-reduce, all-gather, reduce-scatter, send, recv,
all-to-all), phase
(forward, backward, recompute, step), number of calls and payload bytes per call. The training
engine can be checked against it call for call. Payload conventions (what NCCL is handed):
all-reduce = the tensor, all-gather = the gathered output, reduce-scatter = the unscattered
input, all-to-all = the rank's whole input, send/recv = the message. Bytes a rank puts on the
wire per call: all-reduce 2(n-1)/n·payload (ring), all-gather / reduce-scatter / all-to-all
(n-1)/n·payload, send = payload, recv = 0.

Rank order is Megatron's (tp fastest, then cp, dp, pp): a TP group crosses nodes iff
tp > gpus_per_node, CP iff tp·cp > gpus_per_node, DP iff tp·cp·dp > gpus_per_node, and PP
neighbours iff the whole model-replica grid tp·cp·dp·pp spans more than one node.

A ring collective (all-reduce, all-gather, reduce-scatter) whose group has k members on each
node runs k rings at once (NCCL's channels), each leaving the node through a different GPU's
NIC, so it crosses the network at k NICs' bandwidth (capped by NVLink, which carries every
rank's whole ring traffic): NVIDIA measures 192 GB/s all-reduce bus bandwidth across DGX-A100
nodes with 8 x 200 Gb/s NICs, 24 GB/s per NIC (NVIDIA/nccl#812, NVIDIA/nccl-tests#119). A
point-to-point send uses its own GPU's NIC.

What is counted per micro-batch and layer: TP (Megatron), without sequence parallelism two
all-reduces of the b·s·h activation forward and two backward; with it two all-gathers and two
reduce-scatters each way; full recomputation repeats the forward ones. The vocab-parallel
embedding adds a forward all-reduce (SP: reduce-scatter, backward all-gather); the output layer
a backward all-reduce of its input gradient (SP: forward all-gather, backward reduce-scatter)
and three fp32 all-reduces of per-token scalars in the cross-entropy; with SP, one all-reduce
per step of the partial norm-weight gradients. CP passes K/V blocks round a ring
(`llmopt.plan.ring`, what `llmopt.parallel.context_parallel` does): cp-1 sends and receives
of one block forward (again under full recomputation), cp-1 of a block with its gradients
backward and one last hop of the gradients home. MoE blocks (routed experts, ep>1) dispatch
their tokens' top_k copies to the experts' ranks and combine them back by all-to-all over the
EP group, forward and backward (and again under full recomputation): payload = the rank's
whole input (`llmopt.plan.dispatch.call_payload_bytes`), wire (ep-1)/ep of it. PP sends each micro-batch's activation
(its sequence shard under SP, as Megatron-Core; without SP the whole activation unless
`Workload.pp_scatter_gather`, Narayanan's split over TP ranks) forward and its
gradient backward at each of the v chunk boundaries; with tied embeddings and pp>1 the first and
last stages swap their embedding gradients once per step (send + recv). DP over dp·cp ranks: ZeRO-0 all-reduces
gradients once per step; ZeRO-1 (distributed optimizer) reduce-scatters gradients and
all-gathers updated bf16 weights once per step; ZeRO-2 reduce-scatters each micro-batch's
gradients (they are sharded, so accumulation happens in the shard) and all-gathers weights
once — or, with the "step" gradient policy (grid key gacc), accumulates full-size gradients
locally and reduce-scatters once per step; ZeRO-3 all-gathers each block's weights before its forward and again before its
backward and reduce-scatters gradients, every micro-batch, while the non-block weights
(embedding, final norm, head) are gathered once and kept for the step. With tied embeddings
split over pipeline stages, ZeRO-2/3 reduce-scatter the embedding/head gradient once per step,
after the stages have summed it. This is what `llmopt.parallel.zero.data_parallel` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.dispatch import call_payload_bytes, ep_of, moe_layers_per_stage
from llmopt.plan.experts import expert_dp, expert_params_per_rank
from llmopt.plan.grid import Grid, to_grid
from llmopt.plan.hardware import Cluster
from llmopt.plan.memory import (
    ACT_BYTES,
    RC_FULL,
    grad_policy,
    layer_params_per_rank,
    stage_params,
)
from llmopt.plan.ring import kv_block_bytes
from llmopt.plan.split import rank_layers
from llmopt.plan.workload import STATE_BYTES, Workload

OPS = ("all-reduce", "all-gather", "reduce-scatter", "send", "recv", "all-to-all")
# DeepSpeed's ZeRO-3 (Workload.sharding == "deepspeed") is priced as if each rank's data-parallel
# traffic crossed the network on its own NIC only. Fitted, not derived: the calibration rows
# 11-16 (Narayanan et al. 2021 Table 2, DeepSpeed ZeRO-3 on 384-2240 DGX-A100s) are
# communication-bound at ~16-20 GB/s per GPU, one NIC's rate; priced with all 8 rails they
# would run 1.5-4.6x faster than measured.
DEEPSPEED_RAILS = 1


@dataclass(frozen=True)
class Collectives:
    """One kind of collective on one rank of every plan in a grid (arrays over plans)."""

    group: str  # tp | cp | pp | dp
    op: str
    phase: str  # forward | backward | recompute | step
    stage: str  # all | first | last | not_first | not_last: pipeline stages that issue it
    calls: np.ndarray  # per step
    payload_bytes: np.ndarray  # per call
    group_size: np.ndarray
    inter_node: np.ndarray  # bool
    # members of the group on one node: the NICs a ring collective crosses the network with
    per_node: np.ndarray | int = 1

    @property
    def wire_bytes_per_call(self) -> np.ndarray:
        n = self.group_size.astype(np.float64)
        if self.op == "all-reduce":
            return 2 * (n - 1) / n * self.payload_bytes
        if self.op in ("all-gather", "reduce-scatter", "all-to-all"):
            return (n - 1) / n * self.payload_bytes
        if self.op == "send":
            return self.payload_bytes * 1.0
        return self.payload_bytes * 0.0

    @property
    def wire_bytes(self) -> np.ndarray:
        return self.calls * self.wire_bytes_per_call

    def seconds_per_call(self, cluster: Cluster) -> np.ndarray:
        """Ring bandwidth term plus a tree-like latency term (log2 n steps; 2× for all-reduce).
        Across nodes a ring collective runs on `per_node` NICs at once, up to NVLink's rate."""
        intra, inter = cluster.intra_node, cluster.inter_node
        rails = 1 if self.op in ("send", "recv") else np.maximum(self.per_node, 1)
        net = np.minimum(rails * inter.bytes_per_s, intra.bytes_per_s)
        bw = np.where(self.inter_node, net, intra.bytes_per_s)
        lat = np.where(self.inter_node, inter.latency_us, intra.latency_us) * 1e-6
        steps = np.ceil(np.log2(np.maximum(self.group_size, 2)))
        if self.op == "all-reduce":
            steps = 2 * steps
        elif self.op in ("send", "recv"):
            steps = np.ones_like(steps)
        active = self.group_size > 1
        return np.where(active, steps * lat + self.wire_bytes_per_call / bw, 0.0)


def layout(cluster: Cluster, grid: Grid) -> dict[str, np.ndarray]:
    """Whether each group's traffic crosses the inter-node network (Megatron rank order)."""
    g = cluster.gpus_per_node
    tp, cp, dp, pp = grid["tp"], grid["cp"], grid["dp"], grid["pp"]
    return {
        "tp": tp > g,
        "cp": tp * cp > g,
        "dp": tp * cp * dp > g,
        "pp": tp * cp * dp * pp > g,
    }


def members_per_node(cluster: Cluster, grid: Grid) -> dict[str, np.ndarray]:
    """Ranks of one TP, CP and DP (over dp·cp) group that share a node (Megatron rank order:
    a CP or DP group strides over the tp ranks below it)."""
    g = cluster.gpus_per_node
    tp, cp, dp = grid["tp"], grid["cp"], grid["dp"]
    below = np.maximum(g // tp, 1)
    return {"tp": np.minimum(tp, g), "cp": np.minimum(cp, below), "dp": np.minimum(dp * cp, below)}


def collectives(
    model: ModelConfig, work: Workload, cluster: Cluster, grid: Grid
) -> list[Collectives]:
    """Every collective of one step on one rank, for each plan of `grid` (module docstring)."""
    tp, cp, dp, pp = grid["tp"], grid["cp"], grid["dp"], grid["pp"]
    mb, m, v, sp, rc = grid["mb"], grid["m"], grid["v"], grid["sp"] == 1, grid["rc"]
    inter = layout(cluster, grid)
    rails = members_per_node(cluster, grid)
    if work.sharding == "deepspeed":  # fitted, see DEEPSPEED_RAILS
        rails["dp"] = np.full_like(rails["dp"], DEEPSPEED_RAILS)
    from llmopt.plan.memory import layers_per_stage

    n_layers = layers_per_stage(model, pp, v)
    s_local = work.seq_len / cp
    tokens = mb * s_local
    act = tokens * model.hidden_size * ACT_BYTES
    w_bytes, g_bytes, _ = STATE_BYTES[work.state_bytes]
    if work.fp8_param_gather and work.precision == "fp8":
        w_bytes = 1  # FP8 weights gathered (cast on the shard before the all-gather)
    out: list[Collectives] = []

    def add(group, op, phase, stage, calls, payload, size, crosses):
        calls = np.where(size > 1, calls, 0) * np.ones_like(payload)
        per_node = rails.get(group, 1)
        out.append(
            Collectives(group, op, phase, stage, calls, payload * 1.0, size, crosses, per_node)
        )

    # Tensor parallel.
    per_mb = 2 * n_layers * m
    no_sp, with_sp = np.where(sp, 0, per_mb), np.where(sp, per_mb, 0)
    for phase, active in (("forward", 1), ("backward", 1), ("recompute", rc == RC_FULL)):
        add("tp", "all-reduce", phase, "all", no_sp * active, act, tp, inter["tp"])
        add("tp", "all-gather", phase, "all", with_sp * active, act, tp, inter["tp"])
        add("tp", "reduce-scatter", phase, "all", with_sp * active, act, tp, inter["tp"])
    add("tp", "all-reduce", "forward", "first", np.where(sp, 0, m), act, tp, inter["tp"])
    add("tp", "reduce-scatter", "forward", "first", np.where(sp, m, 0), act, tp, inter["tp"])
    add("tp", "all-gather", "backward", "first", np.where(sp, m, 0), act, tp, inter["tp"])
    add("tp", "all-gather", "forward", "last", np.where(sp, m, 0), act, tp, inter["tp"])
    add("tp", "all-reduce", "backward", "last", np.where(sp, 0, m), act, tp, inter["tp"])
    add("tp", "reduce-scatter", "backward", "last", np.where(sp, m, 0), act, tp, inter["tp"])
    add("tp", "all-reduce", "forward", "last", 3 * m, tokens * 4.0, tp, inter["tp"])
    # Sequence parallel: each TP rank saw a different slice of the sequence, so the gradients of
    # the replicated norm weights are partial; one coalesced all-reduce per step (Megatron's
    # finalize_model_grads), the last stage including the final norm.
    norms = 2 * n_layers * model.hidden_size * g_bytes
    sp_calls = np.where(sp, 1, 0)
    add("tp", "all-reduce", "step", "not_last", sp_calls, norms, tp, inter["tp"])
    add(
        "tp",
        "all-reduce",
        "step",
        "last",
        sp_calls,
        norms + model.hidden_size * g_bytes,
        tp,
        inter["tp"],
    )

    # Context parallel: ring attention's point-to-point passes of one K/V block (this rank's
    # s/cp tokens, its TP rank's heads: `ring.kv_block_bytes`), per layer and micro-batch.
    block = kv_block_bytes(model, grid, work.seq_len)
    hops = n_layers * m * (cp - 1)
    for op in ("send", "recv"):
        add("cp", op, "forward", "all", hops, block, cp, inter["cp"])
        add("cp", op, "recompute", "all", hops * (rc == RC_FULL), block, cp, inter["cp"])
        add("cp", op, "backward", "all", hops, 2 * block, cp, inter["cp"])  # K/V + dK/dV
        add("cp", op, "backward", "all", n_layers * m, block, cp, inter["cp"])  # dK/dV home

    # Expert parallel: dispatch + combine all-to-alls of each MoE block on this stage, forward,
    # backward and again under full recomputation (`dispatch.calls_per_microbatch`).
    ep, etp = ep_of(grid)
    n_first, _, n_last = rank_layers(model, pp, v)
    if model.moe is not None:
        a2a = call_payload_bytes(model, grid, tokens)
        ep_crosses = etp * ep > cluster.gpus_per_node
        first_moe, last_moe = moe_layers_per_stage(model, n_first, n_last, v)
        for kind, blocks in (("not_last", first_moe), ("last", last_moe)):
            for phase, per_block in (("forward", 2), ("backward", 2), ("recompute", 2)):
                on = (rc == RC_FULL) if phase == "recompute" else 1
                add("ep", "all-to-all", phase, kind, blocks * m * per_block * on, a2a, ep,
                    ep_crosses)  # fmt: skip

    # Pipeline parallel, per micro-batch: each of the v chunks sends its output forward except
    # the model's last chunk (last stage), and its input gradient backward except the model's
    # first chunk (first stage); receives mirror that.
    msg = act / np.where(sp | work.pp_scatter_gather, tp, 1)  # SP sends its sequence shard
    inner, edge = (v - 1) * m, m
    add("pp", "send", "forward", "all", inner, msg, pp, inter["pp"])
    add("pp", "send", "forward", "not_last", edge, msg, pp, inter["pp"])
    add("pp", "recv", "forward", "all", inner, msg, pp, inter["pp"])
    add("pp", "recv", "forward", "not_first", edge, msg, pp, inter["pp"])
    add("pp", "send", "backward", "all", inner, msg, pp, inter["pp"])
    add("pp", "send", "backward", "not_first", edge, msg, pp, inter["pp"])
    add("pp", "recv", "backward", "all", inner, msg, pp, inter["pp"])
    add("pp", "recv", "backward", "not_last", edge, msg, pp, inter["pp"])

    # Tied embeddings split over pipeline stages: the first stage's embedding and the last
    # stage's output layer share a weight, so once per step they swap and add their gradients.
    if model.tie_embeddings:
        emb_grad = model.vocab_size * model.hidden_size / tp * g_bytes
        for stage in ("first", "last"):
            add("pp", "send", "step", stage, 1, emb_grad, pp, inter["pp"])
            add("pp", "recv", "step", stage, 1, emb_grad, pp, inter["pp"])

    # Data parallel / ZeRO over dp·cp ranks, on each stage's own parameters ("not_last": the
    # first stage when pp>1, with the embedding; "last": the last or only stage).
    first_p, last_p = stage_params(model, grid)
    block_p = n_layers * layer_params_per_rank(model, tp)
    d = dp * cp
    z = grid["zero"]
    # A tied embedding split over stages must be summed across them before it is sharded:
    # under ZeRO-2/3 its unit (embedding / final norm + head) is reduce-scattered once per step.
    tied_split = model.tie_embeddings & (pp > 1)
    once = grad_policy(grid) == 1  # ZeRO-2/3 "step" policy: one reduce-scatter per step
    # Routed experts are data-parallel over their own ranks (edp = tp·cp·dp / (etp·ep), strided
    # by etp·ep: `experts.expert_dp`), a separate group with its own NICs per node.
    local_experts = expert_params_per_rank(model, grid)
    edp = expert_dp(grid)
    edp_rails = np.minimum(edp, np.maximum(cluster.gpus_per_node // (ep * etp), 1))
    for kind, params, layers in (("not_last", first_p, n_first), ("last", last_p, n_last)):
        experts = layers * local_experts
        params = params - experts
        root = params - block_p  # embedding, final norm, head: the non-block parameters
        crosses = inter["dp"]
        if model.moe is not None:
            rails["edp"] = edp_rails
            _expert_collectives(add, kind, experts, edp, crosses, z, m, once, w_bytes, g_bytes)
        add("dp", "all-reduce", "step", kind, (z == 0) * 1, params * g_bytes, d, crosses)
        add("dp", "reduce-scatter", "backward", kind, (z == 1) * 1, params * g_bytes, d, crosses)
        rs_calls = np.where(once, 1, m) * (z >= 2)
        add("dp", "reduce-scatter", "backward", kind, rs_calls, block_p * g_bytes, d, crosses)
        root_rs = np.where(tied_split | once, 1, m) * (z >= 2)
        add("dp", "reduce-scatter", "backward", kind, root_rs, root * g_bytes, d, crosses)
        add(
            "dp",
            "all-gather",
            "step",
            kind,
            ((z == 1) | (z == 2)) * 1,
            params * w_bytes,
            d,
            crosses,
        )
        # ZeRO-3: blocks gathered before every micro-batch's forward and backward; the root
        # unit once, at its first use, kept until the update (FSDP2 keeps its root unsharded).
        add("dp", "all-gather", "forward", kind, (z == 3) * m, block_p * w_bytes, d, crosses)
        add("dp", "all-gather", "forward", kind, (z == 3) * 1, root * w_bytes, d, crosses)
        add("dp", "all-gather", "backward", kind, (z == 3) * m, block_p * w_bytes, d, crosses)
    return out


def _expert_collectives(add, kind, experts, edp, crosses, z, m, once, w_bytes, g_bytes) -> None:
    """The routed experts' data-parallel traffic over their edp ranks: ZeRO-0 all-reduces
    gradients per step, 1 reduce-scatters and gathers once per step, 2 reduce-scatters per
    micro-batch (or once); under ZeRO-3 the local experts are gathered once, at their first
    use, and kept for the step like the root unit (the pricing before issue 27's split into
    dense and expert groups; whether Megatron-FSDP regathers experts per micro-batch is not
    settled by any calibration row)."""
    add("edp", "all-reduce", "step", kind, (z == 0) * 1, experts * g_bytes, edp, crosses)
    rs_calls = np.where(z == 1, 1, np.where(once, 1, m) * (z >= 2))
    add("edp", "reduce-scatter", "backward", kind, rs_calls, experts * g_bytes, edp, crosses)
    gather_step = ((z == 1) | (z == 2)) * 1
    add("edp", "all-gather", "step", kind, gather_step, experts * w_bytes, edp, crosses)
    add("edp", "all-gather", "forward", kind, (z == 3) * 1, experts * w_bytes, edp, crosses)


def _rails(c: Collectives) -> float:
    return 1.0 if c.op in ("send", "recv") else float(np.maximum(np.asarray(c.per_node), 1).flat[0])


def applies(kind: str, stage: str, pp: np.ndarray | int) -> np.ndarray:
    """Whether a collective of stage kind `kind` is issued by the 'first' or 'last' pipeline
    stage (with pp=1 the one stage is both)."""
    single = np.asarray(pp) == 1
    if kind in ("all", stage):
        return np.ones_like(single)
    if kind in ("first", "last"):  # the other end: only when it is the same stage
        return single
    if kind == f"not_{stage}":
        return np.zeros_like(single)
    return ~single  # not_first seen from the last stage, not_last from the first


def collectives_for(
    model: ModelConfig, work: Workload, cluster: Cluster, par: ParallelPlan, stage: str = "first"
) -> list[dict]:
    """The collectives one rank of pipeline stage `stage` ('first' or 'last') issues per step,
    as plain dicts with nonzero call counts — what an engine trace should match exactly.

    A pipeline stage that is both first and last (pp=1) issues both sets. An interior stage
    issues what the 'first' list shows for TP plus v·m pipeline sends and receives each way.
    """
    if stage not in ("first", "last"):
        raise ValueError(f"stage={stage!r}; choose 'first' or 'last'")
    rows = []
    for c in collectives(model, work, cluster, to_grid(par)):
        if not bool(applies(c.stage, stage, par.pp)):
            continue
        calls = int(c.calls[0])
        if calls == 0:
            continue
        rows.append(
            {
                "group": c.group,
                "op": c.op,
                "phase": c.phase,
                "calls": calls,
                "payload_bytes": float(c.payload_bytes[0]),
                "group_size": int(c.group_size[0]),
                "link": "inter_node" if bool(c.inter_node[0]) else "intra_node",
                "wire_bytes": float(c.wire_bytes[0]),
                # across nodes: the bytes this rank's own NIC carries (1/k of a ring's with k
                # of the group's ranks per node; a send's whole message)
                "network_bytes": float(c.wire_bytes[0]) / _rails(c)
                if bool(c.inter_node[0])
                else 0.0,
            }
        )
    return rows


def summarize(rows: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """Totals per (group, op): calls, payload bytes and wire bytes per step."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        t = out.setdefault((r["group"], r["op"]), {"calls": 0, "bytes": 0.0, "wire_bytes": 0.0})
        t["calls"] += r["calls"]
        t["bytes"] += r["calls"] * r["payload_bytes"]
        t["wire_bytes"] += r["wire_bytes"]
    return out
