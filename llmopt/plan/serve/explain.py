"""What bounds a serving estimate, said in words: compute, bandwidth, KV capacity,
interconnect, the scheduler's cap or host overhead, with the figures behind it."""

from __future__ import annotations

import math

from llmopt.models.config import ModelConfig
from llmopt.plan.hardware import GIB, Cluster
from llmopt.plan.serve.result import ServeEstimate
from llmopt.plan.serve.scenario import Load

BOUNDS = ("compute", "bandwidth", "KV capacity", "interconnect", "scheduler cap", "host overhead")


def _step_limit(est: ServeEstimate) -> str:
    shares = est.step.shares()
    bandwidth = shares["weight bandwidth"] + shares["KV bandwidth"]
    ranked = {
        "compute": shares["compute"],
        "bandwidth": bandwidth,
        "interconnect": shares["interconnect"],
        "host overhead": shares["host overhead"],
    }
    return max(ranked, key=ranked.__getitem__)


def _demand(load: Load) -> float:
    return math.inf if load.kind == "offline" else load.value


def bound_of(est: ServeEstimate, load: Load) -> str:
    """The limit to raise for more throughput: the batch limit when the load wants more
    sequences than run and the iteration is not compute-bound, else the iteration's."""
    step = _step_limit(est)
    wants_more = est.overloaded or (load.kind != "rate" and _demand(load) > est.capacity.max_batch)
    if wants_more and step != "compute":
        cap = est.capacity
        return "KV capacity" if cap.max_batch_kv <= est.scenario.max_num_seqs else "scheduler cap"
    return step


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def explain(model: ModelConfig, cluster: Cluster, est: ServeEstimate, load: Load) -> list[str]:
    """Sentences: memory, batch, iteration time, the bound and what would move it."""
    sc, cap, st = est.scenario, est.capacity, est.step
    kv_heads = max(1, model.num_kv_heads // sc.tp)
    lines = [
        f"Memory per GPU ({cluster.gpu.hbm_gib:g} GiB): weights {_gib(cap.weight_bytes)} "
        f"({sc.precision}), activation workspace {_gib(cap.activation_bytes)}, runtime "
        f"{_gib(cap.reserved_bytes)}; the KV cache gets {_gib(cap.kv_cache_bytes)} = "
        f"{cap.kv_tokens:,} tokens at {cap.kv_bytes_per_token / 1024:g} KiB/token ({kv_heads} "
        f"of {model.num_kv_heads} KV heads per rank, {sc.kv_dtype}), i.e. {cap.max_batch_kv:,} "
        f"sequences of {sc.input_len}+{sc.output_len} tokens (max batch {cap.max_batch:,}).",
    ]
    per = f" per replica ({sc.replicas} replicas of tp={sc.tp})" if sc.replicas > 1 else ""
    if load.kind == "offline":
        lines.append(f"Offline: the batch fills to {est.batch:,.0f} running sequences{per}.")
    elif load.kind == "concurrency":
        queued = load.value - cap.max_batch
        text = f"Concurrency {load.value:g}{per} keeps {est.batch:,.1f} sequences decoding"
        if queued > 0:
            text += f"; {queued:,.0f} clients wait for a KV slot before their prefill"
        else:
            text += " (the other clients are waiting for their first token)"
        lines.append(text + ".")
    else:
        state = "OVERLOADED: the queue grows without bound" if est.overloaded else "steady"
        lines.append(
            f"Rate {load.value:g} req/s{per} keeps {est.batch:,.1f} sequences running "
            f"(Little's law B = R·O·ITL); {state}."
        )
        sim = est.simulation
        if sim is not None:
            lines.append(
                f"Replayed benchmark ({sim.requests:,} Poisson requests per replica, "
                f"{sc.scheduler} scheduler"
                + (f", {sc.multi_step} decode steps per round" if sc.multi_step > 1 else "")
                + f"): median TTFT {sim.median_ttft_s * 1e3:.1f} ms (p99 "
                f"{sim.p99_ttft_s * 1e3:.1f}), median ITL {sim.median_itl_s * 1e3:.2f} ms (mean "
                f"{sim.mean_itl_s * 1e3:.2f}: prompts take {sim.prefill_time_share:.0%} of the "
                f"busy time), median TPOT {sim.median_tpot_s * 1e3:.2f} ms, "
                f"{sim.output_tokens_per_s:,.0f} output tokens/s over {sim.duration_s:,.1f} s."
            )
    lines.append(
        f"One iteration takes {st.total_s * 1e3:.2f} ms: GEMMs {st.gemm_s * 1e3:.2f} ms (compute "
        f"{st.gemm_compute_s * 1e3:.2f}, weight reads {st.weight_read_s * 1e3:.2f}), attention "
        f"{st.attention_s * 1e3:.2f} ms (compute {st.attn_compute_s * 1e3:.2f}, KV reads "
        f"{st.kv_read_s * 1e3:.2f}), TP all-reduce {st.comm_s * 1e3:.2f} ms, host "
        f"{st.overhead_s * 1e3:.2f} ms."
    )
    lines.append(_bound_sentence(est, load))
    if sc.spec_tokens:
        e = sc.tokens_per_round
        lines.append(
            f"Speculative decoding: {sc.spec_tokens} drafted tokens accepted with α="
            f"{sc.spec_acceptance:g} yield {e:.2f} tokens per verification (Leviathan Eq. 1) at "
            f"a draft cost of {sc.spec_draft_cost:g} target steps each."
        )
    return lines


def _bound_sentence(est: ServeEstimate, load: Load) -> str:
    st, cap, sc = est.step, est.capacity, est.scenario
    b = est.bound
    if b == "KV capacity":
        return (
            f"Bound: KV capacity — the cache holds {cap.max_batch_kv:,} sequences and the "
            f"iteration is not yet compute-bound, so more KV memory (fp8 KV, a smaller weight "
            f"format, higher tp) would raise throughput."
        )
    if b == "scheduler cap":
        return (
            f"Bound: the scheduler's max_num_seqs={sc.max_num_seqs} caps the batch below the "
            f"{cap.max_batch_kv:,} sequences the KV cache could hold."
        )
    if b == "compute":
        full = est.batch >= cap.max_batch and (load.kind == "offline" or load.value > est.batch)
        also = f" (the batch is also at its cap of {cap.max_batch:,} sequences)" if full else ""
        return (
            f"Bound: compute — GEMMs and attention run at the sustained {sc.precision} "
            f"rate{also}; more GPUs or a lower-precision format raise throughput, a larger "
            "batch would not."
        )
    if b == "interconnect":
        return (
            f"Bound: interconnect — TP all-reduces take {st.comm_s / st.total_s:.0%} of each "
            f"iteration; fewer TP ranks and more replicas would cut it."
        )
    if b == "host overhead":
        return (
            f"Bound: host overhead — the fixed {st.overhead_s * 1e3:.1f} ms per iteration "
            "dominates this small batch; a larger batch amortises it."
        )
    tokens = max(st.tokens, 1.0)
    cross = tokens * st.weight_read_s / max(st.gemm_compute_s, 1e-12)
    what = "weights" if st.weight_read_s >= st.kv_read_s else "KV cache"
    return (
        f"Bound: HBM bandwidth — each iteration streams the {what} "
        f"({st.weight_read_s * 1e3:.2f} ms weights, {st.kv_read_s * 1e3:.2f} ms KV); a larger "
        f"batch shares the weight reads (GEMMs turn compute-bound near {cross:,.0f} tokens per "
        "iteration)."
    )
