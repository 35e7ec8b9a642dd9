"""Plain-text output of `llmopt plan serve` (kept free of heavy imports: the default scenario
answers in well under a second)."""

from __future__ import annotations

from llmopt.plan.serve.result import ServeEstimate
from llmopt.plan.serve.search import ServeSearch


def _ms(x: float | None) -> str:
    if x is None:
        return "n/a (offline)"
    return "unbounded (overloaded)" if x == float("inf") else f"{x * 1e3:.1f} ms"


def summary(est: ServeEstimate) -> list[str]:
    sc, cap = est.scenario, est.capacity
    return [
        f"{est.model} on {est.num_gpus} x {est.gpu}: tp={sc.tp} ep={sc.ep} x{sc.replicas} "
        f"replica(s), {sc.precision} weights, {sc.kv_dtype} KV, {sc.input_len} in / "
        f"{sc.output_len} out, {sc.load}",
        f"  KV capacity      {cap.kv_tokens:,} tokens per replica ({cap.kv_cache_bytes / 2**30:.1f} GiB per GPU)",
        f"  max batch        {cap.max_batch:,} sequences (running: {est.batch:,.0f})",
        f"  TTFT             {_ms(est.ttft_s)}",
        f"  ITL / TPOT       {est.itl_s * 1e3:.2f} ms",
        f"  output tokens/s  {est.output_tokens_per_s:,.0f} ({est.output_tokens_per_s / est.num_gpus:,.0f} per GPU)",
        f"  bound            {est.bound}",
    ]


def print_estimate(est: ServeEstimate) -> None:
    print("\n".join(summary(est)))
    print()
    for line in est.explanation:
        print(f"- {line}")


def print_search(result: ServeSearch, max_itl_ms: float | None, max_ttft_ms: float | None) -> None:
    targets = ", ".join(
        t for t in (
            f"ITL <= {max_itl_ms:g} ms" if max_itl_ms is not None else "",
            f"TTFT <= {max_ttft_ms:g} ms" if max_ttft_ms is not None else "",
        ) if t
    ) or "no latency target"  # fmt: skip
    print(f"layouts meeting {targets}, fastest first:")
    for e in result.ranked:
        ttft = "-" if e.ttft_s is None else _ms(e.ttft_s)
        print(
            f"  tp={e.scenario.tp} ep={e.scenario.ep} x{e.scenario.replicas}: "
            f"{e.output_tokens_per_s:,.0f} tok/s, ITL {e.itl_s * 1e3:.2f} ms, TTFT {ttft}, "
            f"bound {e.bound}"
        )
    for e in result.missed:
        print(
            f"  (misses target) tp={e.scenario.tp} x{e.scenario.replicas}: ITL "
            f"{e.itl_s * 1e3:.2f} ms, TTFT {_ms(e.ttft_s)}"
        )
    for name, reason in result.rejected:
        print(f"  (cannot run) {name}: {reason}")
    if result.best is None:
        print("no layout meets the target; the closest is listed first under 'misses target'")
        return
    print()
    print_estimate(result.best)
