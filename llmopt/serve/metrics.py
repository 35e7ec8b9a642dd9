"""Serving metrics in the Prometheus text exposition format (no client library needed).

The engine thread records (`observe_*`), the HTTP thread renders; plain ints/floats and
appends to bounded structures are safe enough across the two under the GIL, and a scrape
that reads a value one step old is fine.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter, deque

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Cumulative-bucket histogram (Prometheus `le` semantics)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        total = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            total += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {total}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return lines


class ServingMetrics:
    def __init__(self, window_s: float = 10.0) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.finished: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()

    def observe_tokens(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.generation_tokens += n
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        recent = [(t, n) for t, n in self._recent if t >= now - self.window_s]
        return sum(n for _, n in recent) / self.window_s if recent else 0.0

    def render(self, gauges: dict[str, tuple[float, str]]) -> str:
        """The exposition text: `gauges` maps name -> (value, help) for the engine's state."""
        lines: list[str] = []
        gauges = dict(gauges)
        gauges["llmopt_generation_tokens_per_second"] = (
            self.tokens_per_second(),
            f"Generated tokens per second over the last {self.window_s:g} s.",
        )
        for name, (value, help_text) in gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value:g}"]
        counters = {
            "llmopt_prompt_tokens_total": (
                self.prompt_tokens,
                "Prompt tokens of accepted requests.",
            ),
            "llmopt_generation_tokens_total": (self.generation_tokens, "Tokens generated."),
        }
        for name, (value, help_text) in counters.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        for name, counter, help_text in (
            ("llmopt_requests_finished_total", self.finished, "Finished requests by reason."),
            ("llmopt_requests_rejected_total", self.rejected, "Refused requests by HTTP status."),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            lines += [f'{name}{{reason="{k}"}} {v}' for k, v in sorted(counter.items())]
        lines += self.ttft.render("llmopt_time_to_first_token_seconds", "Time to first token.")
        lines += self.itl.render("llmopt_inter_token_latency_seconds", "Time between tokens.")
        return "\n".join(lines) + "\n"
