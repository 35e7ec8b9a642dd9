"""Plain-text output of `llmopt plan serve` (kept free of heavy imports: the default scenario
answers in well under a second)."""

from __future__ import annotations

import os
import sys

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
        f"  KV capacity      {cap.kv_tokens:,} tokens per replica "
        f"({cap.kv_cache_bytes / 2**30:.1f} GiB per GPU)",
        f"  max batch        {cap.max_batch:,} sequences (running: {est.batch:,.0f})",
        f"  TTFT             {_ms(est.ttft_s)}",
        f"  ITL / TPOT       {est.itl_s * 1e3:.2f} ms",
        f"  output tokens/s  {est.output_tokens_per_s:,.0f} "
        f"({est.output_tokens_per_s / est.num_gpus:,.0f} per GPU)",
        f"  bound            {est.bound}",
    ]


def write(lines: list[str]) -> None:
    """Print; a reader that stops early (`| head`) ends the output quietly."""
    try:
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # keep the interpreter's final flush from failing again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def estimate_lines(est: ServeEstimate) -> list[str]:
    return [*summary(est), "", *(f"- {line}" for line in est.explanation)]


def search_lines(
    result: ServeSearch, max_itl_ms: float | None, max_ttft_ms: float | None
) -> list[str]:
    targets = ", ".join(
        t for t in (
            f"ITL <= {max_itl_ms:g} ms" if max_itl_ms is not None else "",
            f"TTFT <= {max_ttft_ms:g} ms" if max_ttft_ms is not None else "",
        ) if t
    ) or "no latency target"  # fmt: skip
    out = [f"layouts meeting {targets}, fastest first:"]
    for e in result.ranked:
        ttft = "-" if e.ttft_s is None else _ms(e.ttft_s)
        out.append(
            f"  tp={e.scenario.tp} ep={e.scenario.ep} x{e.scenario.replicas}: "
            f"{e.output_tokens_per_s:,.0f} tok/s, ITL {e.itl_s * 1e3:.2f} ms, TTFT {ttft}, "
            f"bound {e.bound}"
        )
    for e in result.missed:
        out.append(
            f"  (misses target) tp={e.scenario.tp} x{e.scenario.replicas}: ITL "
            f"{e.itl_s * 1e3:.2f} ms, TTFT {_ms(e.ttft_s)}"
        )
    for name, reason in result.rejected:
        out.append(f"  (cannot run) {name}: {reason}")
    if result.best is None:
        out.append("no layout meets the target; the closest is listed first under 'misses target'")
        return out
    return [*out, "", *estimate_lines(result.best)]
