"""Sentences that say why a plan ranks where it does, and why another was rejected.

Explanations are computed, not templated opinions: every trade-off quoted (recompute, ZeRO
stage, TP placement) comes from evaluating the plan's neighbours with the same cost model.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.parallel.plan import RECOMPUTES, ParallelPlan
from llmopt.plan.comm import collectives_for
from llmopt.plan.frameworks import refusal
from llmopt.plan.grid import to_grid
from llmopt.plan.hardware import GIB, Cluster
from llmopt.plan.rules import format_constraints, msg_at, search_space_reasons
from llmopt.plan.search import (
    Plan,
    SearchResult,
    build_grid,
    evaluate,
    plan_at,
    plan_of_rank,
    ranked,
)
from llmopt.plan.workload import STATE_BYTES, Workload, optimizer_bytes_per_param

MFU_FORMULA = {
    "causal": "3 x tokens x (layers x (2 x active matmul weights + 2 x s x heads x head_dim) + "
    "2 x h x V): causal attention, the half flash attention computes",
    "megatron": "3 x tokens x (layers x (2 x active matmul weights + 4 x s x heads x head_dim) + "
    "2 x h x V): full s^2 attention, Megatron's 72Bslh^2(1+s/6h+V/12lh) generalised",
    "palm": "6 x N(active, no embedding) + 12 x L x heads x head_dim x s per token (PaLM)",
}


def mfu_formula(work: Workload) -> str:
    """How the printed MFU is counted (`--flops-convention`) and against which peak."""
    peak = "dense FP8 peak" if work.precision == "fp8" else "dense bf16 peak"
    return (
        f"MFU = model FLOPs per step / (step time x GPUs x {peak}), model FLOPs "
        f"({work.flops_convention}) = {MFU_FORMULA[work.flops_convention]}; HFU adds "
        "recomputed FLOPs."
    )


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def _variant(
    model: ModelConfig,
    work: Workload,
    cluster: Cluster,
    par: ParallelPlan,
    grad_reduce: str = "microbatch",
    **changes,
) -> Plan | None:
    try:
        alt = dataclasses.replace(par, **changes)
    except ValueError:
        return None
    if alt.zero_stage < 2:
        grad_reduce = "microbatch"  # stages 0-1 reduce once per step whatever the policy
    ev = evaluate(model, work, cluster, to_grid(alt, grad_reduce=grad_reduce))
    return plan_at(ev, 0)


def _excluded(framework: str, model: ModelConfig, alt: Plan) -> str:
    why = refusal(framework, model, alt.parallel, alt.grad_reduce)
    return f"; excluded by --framework {framework}: {why}" if why else ""


def explain(
    model: ModelConfig,
    work: Workload,
    cluster: Cluster,
    plan: Plan,
    runner_up: Plan | None = None,
    top: Plan | None = None,
    framework: str = "llmopt",
) -> list[str]:
    """Why this plan: placement of each group, memory, bubble, recompute and ZeRO trade-offs
    (naming the `framework` rule that excludes an alternative); compared with the runner-up
    (for the top plan) or with the top plan (for the others)."""
    p = plan.parallel
    g = cluster.gpus_per_node
    out: list[str] = []
    t = plan.step_time_s
    if p.tp > 1:
        where = (
            f"inside a node on {cluster.intra_node.name}"
            if p.tp <= g
            else f"across {p.tp // g} nodes over {cluster.inter_node.name}"
        )
        out.append(
            f"TP={p.tp} keeps its per-layer collectives ("
            + ("2 all-gathers + 2 reduce-scatters" if p.sequence_parallel else "2 all-reduces")
            + f" per layer per micro-batch, forward and again backward) {where}; they cost "
            f"{t['tp_comm_exposed']:.2f} s of the "
            f"{t['total']:.2f} s step."
        )
    else:
        out.append(
            "No tensor parallelism: every GPU runs whole layers, so no per-layer collectives."
        )
    if p.pp > 1:
        span = "spans nodes" if p.tp * p.cp * p.dp * p.pp > g else "stays inside a node"
        bubble = (p.pp - 1) / (p.virtual_stages * p.num_microbatches)
        sched = p.schedule + (f" with v={p.virtual_stages}" if p.virtual_stages > 1 else "")
        out.append(
            f"PP={p.pp} {span}: only point-to-point activations cross between stages "
            f"({t['pp_p2p']:.2f} s); the {sched} bubble (p-1)/(v*m) = {bubble:.1%} costs "
            f"{t['pp_bubble']:.2f} s."
        )
    d = p.dp * p.cp
    if d > 1:
        link = (cluster.inter_node if p.tp * p.cp * p.dp > g else cluster.intra_node).name
        rails = min(d, max(g // p.tp, 1))
        if p.tp * p.cp * p.dp > g and rails > 1:
            link += f" ({rails} ranks per node: its rings cross on {rails} NICs at once)"
        out.append(
            f"Data parallelism over {d} ranks ({'dp' if p.cp == 1 else 'dp x cp'}) reduces "
            f"gradients over {link}; {t['dp_comm_exposed']:.2f} s of it is not hidden behind "
            "backward."
        )
    if p.cp > 1:
        out.append(
            f"Context parallelism CP={p.cp} splits each sequence into {p.cp} zig-zag chunk "
            f"pairs (ring attention: {p.cp - 1} K/V passes per layer, "
            f"{t['cp_comm_exposed']:.2f} s of them exposed), cutting activations {p.cp}x."
        )
    m = plan.memory_bytes
    zero_text = {
        0: "no ZeRO (every rank keeps full states)",
        1: f"ZeRO-1 shards optimizer states over {d} ranks",
        2: f"ZeRO-2 shards optimizer states and gradients over {d} ranks",
        3: f"ZeRO-3 shards weights, gradients and optimizer states over {d} ranks",
    }[p.zero_stage]
    usable = m["total"] if not plan.fits else None
    out.append(
        f"Memory per GPU: weights {_gib(m['params'])}, gradients {_gib(m['grads'])}, optimizer "
        f"{_gib(m['optimizer'])} ({zero_text}, {work.state_bytes} convention "
        f"{sum(STATE_BYTES[work.state_bytes][:2]) + optimizer_bytes_per_param(work.moments)} "
        f"B/param{', bf16 Adam moments' if work.moments == 'bf16' else ''}), activations "
        f"{_gib(m['activations'])} (recompute={p.recompute}, micro-batch {p.micro_batch}), "
        f"other {_gib(m['other'])}; total {_gib(m['total'])} of "
        f"{cluster.gpu.hbm_gib * (1 - cluster.gpu.allocator_margin):.1f} GiB usable"
        + (" -- does NOT fit." if usable else ".")
    )
    # Recompute trade-off, from the neighbours of this plan.
    for rc in RECOMPUTES:
        if rc == p.recompute:
            continue
        alt = _variant(model, work, cluster, p, plan.grad_reduce, recompute=rc)
        if alt is None:
            continue
        dt = alt.step_time_s["total"] - t["total"]
        dm = alt.memory_bytes["total"] - m["total"]
        fit = "fits" if alt.fits else "does not fit"
        out.append(
            f"recompute={rc} would change step time by {dt:+.2f} s ({dt / t['total']:+.1%}) "
            f"and memory by {dm / GIB:+.1f} GiB ({fit}){_excluded(framework, model, alt)}."
        )
    if d > 1:
        for z in range(4):
            if z == p.zero_stage:
                continue
            alt = _variant(model, work, cluster, p, plan.grad_reduce, zero_stage=z)
            if alt is None:
                continue
            dt = alt.step_time_s["total"] - t["total"]
            dm = alt.memory_bytes["total"] - m["total"]
            m_ = p.num_microbatches
            extra = {
                0: " (all-reduce of full gradients once per step)",
                1: " (reduce-scatter gradients, all-gather weights once per step)",
                2: f" (reduce-scatters gradients every micro-batch: {m_} per step)"
                if plan.grad_reduce == "microbatch"
                else " (full gradients accumulated, reduce-scattered once per step)",
                3: f" (all-gathers weights before forward and backward of each of {m_} "
                "micro-batches)",
            }[z]
            out.append(
                f"ZeRO-{z}{extra}: {dt:+.2f} s per step, {dm / GIB:+.1f} GiB per GPU"
                f"{'' if alt.fits else ', does not fit'}{_excluded(framework, model, alt)}."
            )
    if d > 1 and p.zero_stage >= 2:
        other = "step" if plan.grad_reduce == "microbatch" else "microbatch"
        alt = _variant(model, work, cluster, p, other)
        how = {
            "microbatch": f"reduce-scatters gradients every micro-batch ({p.num_microbatches} "
            "per step) into 1/dp shards",
            "step": "accumulates full-size gradients over the micro-batches and "
            "reduce-scatters once per step",
        }
        line = f"Gradient policy grad_reduce={plan.grad_reduce}: {how[plan.grad_reduce]}"
        if alt is not None:
            dt = alt.step_time_s["total"] - t["total"]
            dm = alt.memory_bytes["total"] - m["total"]
            line += (
                f"; grad_reduce={other} ({how[other].split(' (')[0]}) would change step time "
                f"by {dt:+.2f} s and memory by {dm / GIB:+.1f} GiB"
                f"{'' if alt.fits else ' (does not fit)'}{_excluded(framework, model, alt)}"
            )
        out.append(line + ".")
    cb = plan.comm_bytes
    if cb:
        out.append(
            f"Each GPU sends {cb['intra_node'] / 1e9:.1f} GB over {cluster.intra_node.name} and "
            f"{cb['inter_node'] / 1e9:.1f} GB over the network per step."
        )
    per_gpu = plan.tokens_per_s / plan.parallel.world_size
    bf16 = "" if plan.mfu_bf16_peak is None else f" ({plan.mfu_bf16_peak:.1%} of the bf16 peak)"
    out.append(
        f"Predicted {plan.tokens_per_s:,.0f} tokens/s ({per_gpu:,.0f} per GPU), MFU "
        f"{plan.mfu:.1%}{bf16}, HFU {plan.hfu:.1%}. " + mfu_formula(work)
    )
    if runner_up is not None:
        dt = runner_up.step_time_s["total"] - t["total"]
        r = runner_up.parallel
        out.append(
            f"Runner-up {r.short()}, zero_stage={r.zero_stage}, recompute={r.recompute}, "
            f"mb={r.micro_batch} is {dt / t['total']:+.1%} slower."
        )
    if top is not None and plan.rank is not None:
        dt = t["total"] / top.step_time_s["total"] - 1
        out.append(
            f"Ranked #{plan.rank}: {dt:+.1%} step time versus the top plan "
            "(plans within 1 % are ties, ordered by lower ZeRO stage, less recompute, no CP)."
        )
    return out


def why_not(
    model: ModelConfig,
    work: Workload,
    cluster: Cluster,
    constraints: dict[str, int],
    result: SearchResult,
) -> list[str]:
    """Why the top plan does not have these settings: the rank the ranking itself gives the
    best such plan, or each rule (structural, framework, memory, --require) that rejects them."""
    grid = build_grid(model, work, cluster, constraints)
    spec = format_constraints(constraints)
    if len(grid["tp"]) == 0:
        n = cluster.num_gpus
        for key in ("tp", "pp", "dp", "cp"):
            if key in constraints and n % constraints[key]:
                return [f"{spec}: {key}={constraints[key]} does not divide the {n} GPUs."]
        return [
            f"{spec}: no mapping exists: the GPU count {n} must factor as tp*pp*dp*cp with dp "
            f"dividing the global batch {work.global_batch} and micro-batch dividing the "
            "per-replica batch."
        ]
    full, best = result.evaluation, result.plans[0]
    order = ranked(full)
    match = np.ones(len(order), dtype=bool)
    for key, value in constraints.items():
        match &= full.grid[key][order] == value
    if match.any():
        rank = int(np.argmax(match)) + 1
        plan = plan_of_rank(model, work, cluster, result, rank)
        total = plan.step_time_s["total"]
        slower = total / best.step_time_s["total"] - 1
        lines = [
            f"{spec}: best such plan ({plan.parallel.short()}, "
            f"zero_stage={plan.parallel.zero_stage}, "
            f"recompute={plan.parallel.recompute}, mb={plan.parallel.micro_batch}) is valid and "
            f"ranks #{rank} by {full.objective}, {slower:+.1%} step time versus the top plan."
        ]
        diffs = {
            k: plan.step_time_s[k] - best.step_time_s[k] for k in plan.step_time_s if k != "total"
        }
        worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
        lines.append(
            "Where the time goes versus the top plan: "
            + ", ".join(f"{k} {v:+.2f} s" for k, v in worst if abs(v) > 1e-4)
            + "."
        )
        cb = (plan.comm_bytes or {}).get("inter_node", 0.0)
        lines.append(
            f"It sends {cb / 1e9:.1f} GB per GPU per step over the network versus "
            f"{best.comm_bytes.get('inter_node', 0.0) / 1e9:.1f} GB for the top plan."
        )
        return lines
    ev = evaluate(model, work, cluster, grid, False, full.framework, full.objective, full.requires)
    outside = search_space_reasons(model, work, grid)
    in_space = ev.valid.copy()
    for _, mask in outside:
        in_space &= ~mask
    if in_space.any():
        return [
            f"{spec}: valid, but outside the plans searched (--where); drop --where to rank it."
        ]
    ev.reasons.extend(outside)
    lines = [f"{spec}: rejected, no plan with these settings is valid (rules that reject every "
             "variant first):"]  # fmt: skip
    found: list[tuple[int, str]] = []
    for msg, mask in ev.reasons:
        if not mask.any():
            continue
        j = int(np.flatnonzero(mask)[0])
        prefix = ""
        if "{mem_gib}" in msg:
            # the leanest variant that only memory rejects (else any that memory rejects)
            k = np.flatnonzero(mask & ev.structural)
            k = k if len(k) else np.flatnonzero(mask)
            j = int(k[np.argmin(ev.memory["total"][k])])
            every = bool((mask | ~ev.structural).all())
            prefix = "even the leanest variant " if every else "the leanest variant that misses "
        text = msg_at(msg, grid, j, mem_gib=f"{ev.memory['total'][j] / GIB:.1f}")
        found.append(
            (int(mask.sum()), f"  - {prefix}{text} ({int(mask.sum())} of {len(mask)} variants)")
        )
    found.sort(key=lambda f: -f[0])
    lines += [line for _, line in found]
    memory_only = ev.structural & ~ev.memory["fits"]
    if memory_only.any() and not (ev.structural & ev.memory["fits"]).any():
        from llmopt.plan.fits import fits_with

        fix = fits_with(model, work, cluster, constraints, ev)
        lines.append(fix or "  No single switch (bf16 gradients, more recompute, a higher ZeRO "
                     "stage, micro-batch 1) makes them fit.")  # fmt: skip
    return lines


def link_report(
    model: ModelConfig, work: Workload, cluster: Cluster, par: ParallelPlan
) -> list[dict]:
    """Per group, op and phase: link crossed, calls and wire GB per GPU per step (last stage)."""
    rows = collectives_for(model, work, cluster, par, stage="last")
    merged: dict[tuple[str, str, str], dict] = {}
    for r in rows:
        key = (r["group"], r["op"], r["phase"], r["link"])
        e = merged.setdefault(key, {k: r[k] for k in ("group", "op", "phase", "link")})
        e.setdefault("calls", 0)
        e.setdefault("wire_gb", 0.0)
        e["calls"] += r["calls"]
        e["wire_gb"] += r["wire_bytes"] / 1e9
    return list(merged.values())
