"""Steady state of continuous (in-flight) batching on one replica, and what it gives the
deployment: output tokens/s, TTFT, ITL/TPOT and the limit that bounds them.

Model: B sequences decode together; every iteration each emits one token (E with speculative
decoding) and, on average, the prompts of the requests that replace finished ones are
prefilled in the same iterations (B·I/O prompt tokens per decode round, chunked to
max_num_tokens per iteration). The running batch B is capped by what the KV cache holds at
full length and by max_num_seqs; below the cap, C closed-loop clients keep
B = C·O·ITL / (TTFT + O·ITL) decoding (each spends its TTFT waiting), and a request rate R
keeps B = R·O·ITL(B) (Little's law). A request's TTFT is half an iteration of alignment plus
the iterations that carry its prompt, plus the queue: clients beyond the cap wait (C − B)/X
for a slot (closed loop), and an open stream waits the M/D/1 time ρ/(2(1−ρ)) iterations at
utilisation ρ.

At a request rate the figures reported are those of the benchmark replayed iteration by
iteration (`simulate.py`: the scheduler's interleave of prompts and decodes, Poisson queueing,
medians over requests and streamed chunks); the steady state above still gives the bound.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from llmopt.models.config import ModelConfig
from llmopt.plan.hardware import Cluster
from llmopt.plan.serve.capacity import capacity
from llmopt.plan.serve.engines import ENGINE_PROFILES
from llmopt.plan.serve.explain import bound_of, explain
from llmopt.plan.serve.result import ServeEstimate
from llmopt.plan.serve.scenario import Load, Scenario
from llmopt.plan.serve.simulate import simulate
from llmopt.plan.serve.step import StepCost, step_cost


@dataclass(frozen=True)
class Round:
    """One decode round: every running sequence advances by `tokens` (1, or E drafted)."""

    seconds: float
    tokens: float
    step: StepCost  # the target iteration (verification when speculating)
    iterations: float  # engine iterations the round's tokens are spread over


def decode_round(model: ModelConfig, cluster: Cluster, sc: Scenario, batch: float) -> Round:
    """Time for `batch` sequences to each advance one round, prefill of replacements included."""
    i, o, k = sc.input_len, sc.output_len, sc.spec_tokens
    e = sc.tokens_per_round
    ctx = i + o / 2
    prefill = batch * e * i / o
    tokens = batch * (k + 1) + prefill
    n = max(1.0, tokens / sc.max_num_tokens)  # iterations the round's tokens need
    step = step_cost(
        model, cluster, sc, batch / n, ctx, prefill / n, i / 2, batch * e / o / n, k + 1
    )
    seconds = n * step.total_s
    if k:
        plain = step_cost(model, cluster, sc, batch, ctx).total_s
        seconds += k * sc.spec_draft_cost * plain
    return Round(seconds, e, step, n)


def _prefill_s(model: ModelConfig, cluster: Cluster, sc: Scenario, batch: float) -> float:
    """Iterations that carry one new prompt beside `batch` decoding sequences."""
    i, ctx = sc.input_len, sc.input_len + sc.output_len / 2
    chunks = math.ceil((i + batch) / sc.max_num_tokens)
    step = step_cost(model, cluster, sc, batch, ctx, i / chunks, i / 2, 1.0 / chunks)
    return chunks * step.total_s


def _ttft_s(model: ModelConfig, cluster: Cluster, sc: Scenario, batch: float, rnd: Round) -> float:
    """Half an iteration of alignment (none when alone) plus the iterations of the prompt."""
    align = rnd.seconds / rnd.iterations / 2 * max(0.0, 1 - 1 / max(batch, 1.0))
    front = ENGINE_PROFILES[sc.engine].request_s
    return front + align + _prefill_s(model, cluster, sc, batch)


def _closed_loop_batch(
    model: ModelConfig, cluster: Cluster, sc: Scenario, clients: float, cap: int
) -> float:
    """Sequences decoding when `clients` each wait TTFT, then decode O tokens, then resubmit:
    B = C·O·ITL / (TTFT + O·ITL) below the cap (a fixed point; B moves ITL and TTFT); at or
    above the cap every slot is busy and the rest of the clients queue."""
    if clients >= cap:
        return float(cap)
    batch = clients
    for _ in range(30):
        rnd = decode_round(model, cluster, sc, batch)
        decode = sc.output_len * rnd.seconds / rnd.tokens
        new = clients * decode / (_ttft_s(model, cluster, sc, batch, rnd) + decode)
        if abs(new - batch) < 1e-9 * clients:
            break
        batch = (batch + new) / 2
    return batch


def _rate_batch(
    model: ModelConfig, cluster: Cluster, sc: Scenario, rate: float, cap: int
) -> tuple[float, bool]:
    """Running batch B solving B = rate·O·ITL(B) by bisection; (cap, True) when overloaded."""

    def excess(b: float) -> float:
        r = decode_round(model, cluster, sc, b)
        return rate * sc.output_len * r.seconds / r.tokens - b

    if excess(cap) > 0:
        return float(cap), True
    lo, hi = 1e-6, float(cap)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return hi, False


def estimate(model: ModelConfig, cluster: Cluster, sc: Scenario) -> ServeEstimate:
    """Continuous-batching steady state of `sc` (see the module docstring)."""
    cap = capacity(model, cluster.gpu, sc)
    load: Load = sc.load.split(sc.replicas)
    overloaded = False
    if load.kind == "offline":
        batch = float(cap.max_batch)
    elif load.kind == "concurrency":
        batch = _closed_loop_batch(model, cluster, sc, load.value, cap.max_batch)
    else:
        batch, overloaded = _rate_batch(model, cluster, sc, load.value, cap.max_batch)
    rnd = decode_round(model, cluster, sc, batch)
    itl = rnd.seconds / rnd.tokens
    per_replica_tps = batch / itl
    req_rate = per_replica_tps / sc.output_len
    ttft: float | None
    if load.kind == "offline":
        ttft = None
    else:
        ttft = _ttft_s(model, cluster, sc, batch, rnd)
        if load.kind == "concurrency" and load.value >= cap.max_batch:
            ttft += (load.value - batch) / req_rate
        elif load.kind == "rate":
            full = decode_round(model, cluster, sc, cap.max_batch)
            rho = min(
                load.value / (cap.max_batch / (full.seconds / full.tokens) / sc.output_len), 1
            )
            ttft = math.inf if overloaded or rho >= 1 else ttft + rho / (2 * (1 - rho)) * itl
    sim = None
    if load.kind == "rate":  # the benchmark's medians, from a replay of its requests
        sim = simulate(
            model, cluster, sc, cap.kv_tokens, load.value, math.ceil(sc.num_requests / sc.replicas)
        )
        batch, itl, ttft = sim.mean_batch, sim.median_itl_s, sim.median_ttft_s
        per_replica_tps, req_rate = sim.output_tokens_per_s, sim.request_rate
        rnd = decode_round(model, cluster, sc, max(batch, 1.0))
    est = ServeEstimate(
        model=model.name,
        gpu=cluster.gpu.name,
        scenario=sc,
        capacity=cap,
        batch=batch,
        itl_s=itl,
        ttft_s=ttft,
        output_tokens_per_s=per_replica_tps * sc.replicas,
        request_rate=req_rate * sc.replicas,
        step=rnd.step,
        bound="",
        overloaded=overloaded,
        simulation=sim,
    )
    est = dataclasses.replace(est, bound=bound_of(est, load))
    return dataclasses.replace(est, explanation=explain(model, cluster, est, load))
