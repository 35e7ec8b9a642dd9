"""A bounded load generator for OpenAI-compatible servers (`llmopt bench serve`).

For each concurrency level, that many clients stream /v1/completions back to back until
`requests` are done or `time_limit` runs out. Per request it records TTFT (first streamed
text), ITL (gaps between text chunks), TPOT ((latency - TTFT) / (tokens - 1)); per level,
output tokens/s and requests/s over the level's wall time. Tokens are counted from the
`usage` trailer when the server sends one, else one per text chunk.

Loopback only: this is a benchmark, not a way to load someone else's service.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import statistics
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from llmopt.errors import LlmoptError

MAX_CONCURRENCY = 256
MAX_REQUESTS = 100_000


class BenchError(LlmoptError, ValueError):
    """Bad benchmark input (non-loopback URL, out-of-range limits)."""


def check_loopback(url: str) -> str:
    """The base URL without a trailing slash, if its host resolves only to loopback."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise BenchError(f"--url {url!r} must look like http://127.0.0.1:PORT")
    try:
        infos = socket.getaddrinfo(parsed.hostname, parsed.port or 80, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise BenchError(f"cannot resolve {parsed.hostname!r}: {exc}") from exc
    addresses = {info[4][0] for info in infos}
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise BenchError(
            f"refusing to load {parsed.hostname!r} ({', '.join(sorted(addresses))}): "
            "bench serve only targets loopback hosts (127.0.0.0/8, ::1, localhost)"
        )
    return url.rstrip("/")


@dataclass
class RequestStats:
    ttft: float
    latency: float
    tokens: int
    itl: list[float] = field(default_factory=list)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(stats: list[RequestStats], errors: int, wall: float, concurrency: int) -> dict:
    ttft = [s.ttft for s in stats]
    itl = [g for s in stats for g in s.itl]
    tpot = [(s.latency - s.ttft) / (s.tokens - 1) for s in stats if s.tokens > 1]
    tokens = sum(s.tokens for s in stats)
    return {
        "concurrency": concurrency,
        "requests": len(stats),
        "errors": errors,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(stats) / wall if wall > 0 else 0.0,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p90_s": _pct(ttft, 0.9),
        "ttft_p99_s": _pct(ttft, 0.99),
        "latency_p50_s": _pct([s.latency for s in stats], 0.5),
        "latency_p99_s": _pct([s.latency for s in stats], 0.99),
        "itl_p50_s": _pct(itl, 0.5),
        "itl_p90_s": _pct(itl, 0.9),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else None,
    }


async def _one(client, url: str, body: dict) -> RequestStats:
    start = time.perf_counter()
    first = last = None
    chunks, usage_tokens, itl = 0, None, []
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:200]
            raise RuntimeError(f"HTTP {resp.status_code}: {text}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:  # the server failed the request mid-stream
                raise RuntimeError(f"stream error: {event['error'].get('message')}")
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            choices = event.get("choices") or []
            if choices and choices[0].get("text"):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    itl.append(now - last)
                last = now
                chunks += 1
    end = time.perf_counter()
    if first is None:
        first = end
    return RequestStats(first - start, end - start, usage_tokens or chunks, itl)


async def run_level(
    url: str,
    model: str,
    concurrency: int,
    requests: int,
    time_limit: float,
    prompts: list[str],
    max_tokens: int,
) -> dict:
    import httpx

    counter = iter(range(requests))
    stats: list[RequestStats] = []
    errors: list[str] = []
    retried = [0]
    deadline = time.perf_counter() + time_limit

    async def client_loop(client) -> None:
        for i in counter:
            if time.perf_counter() >= deadline:
                return
            body = {
                "model": model,
                "prompt": prompts[i % len(prompts)],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            try:
                try:
                    stats.append(await _one(client, url, body))
                except httpx.RemoteProtocolError:
                    # the server closed a kept-alive connection before answering (llama-server
                    # does at times): what a client does is resend once on a new connection
                    retried[0] += 1
                    stats.append(await _one(client, url, body))
            except (RuntimeError, httpx.HTTPError, json.JSONDecodeError) as exc:
                errors.append(str(exc))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(time_limit + 60)
    start = time.perf_counter()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    out = summarize(stats, len(errors), time.perf_counter() - start, concurrency)
    out["first_errors"] = errors[:3]
    out["retried"] = retried[0]
    return out


def served_model(url: str) -> str:
    """The first model the server lists; a server that is not there is a one-line error."""
    import httpx

    try:
        response = httpx.get(url + "/v1/models", timeout=30)
        data = response.json()
        return data["data"][0]["id"]
    except httpx.HTTPError as exc:
        raise BenchError(
            f"--url {url}: no server answers there ({exc}); start `llmopt serve` "
            "first or check the port"
        ) from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(
            f"--url {url}: /v1/models did not list a model (HTTP "
            f"{response.status_code}); pass --model"
        ) from None


def check_reachable(url: str) -> None:
    """Fail in one line, before the first level, when nothing listens at `url`."""
    import httpx

    try:
        httpx.get(url + "/health", timeout=10)
    except httpx.HTTPError as exc:
        raise BenchError(
            f"--url {url}: no server answers there ({exc}); start `llmopt serve` "
            "first or check the port"
        ) from None


def run_bench(
    url: str,
    concurrencies: list[int],
    requests: int,
    time_limit: float,
    *,
    prompts: list[str],
    max_tokens: int,
    model: str | None = None,
) -> dict:
    """Run every concurrency level in turn; the report (one row per level)."""
    url = check_loopback(url)
    if not concurrencies or any(not 1 <= c <= MAX_CONCURRENCY for c in concurrencies):
        raise BenchError(f"--concurrency {concurrencies} must be in [1, {MAX_CONCURRENCY}]")
    if not 1 <= requests <= MAX_REQUESTS:
        raise BenchError(f"--requests {requests} must be in [1, {MAX_REQUESTS}]")
    if not 0 < time_limit <= 86400:
        raise BenchError(f"--time-limit {time_limit} must be in (0, 86400] seconds")
    if max_tokens < 1:
        raise BenchError(f"--max-tokens {max_tokens} must be >= 1")
    check_reachable(url)
    model = model or served_model(url)
    rows = [
        asyncio.run(run_level(url, model, c, requests, time_limit, prompts, max_tokens))
        for c in concurrencies
    ]
    return {"url": url, "model": model, "max_tokens": max_tokens, "levels": rows}


def plot(report: dict, path) -> None:
    """Output tokens/s and TTFT/ITL p50 against concurrency, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from llmopt.artifacts import atomic_save_figure

    rows = report["levels"]
    conc = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(conc, [r["output_tokens_per_s"] for r in rows], marker="o")
    a.set(xscale="log", xlabel="concurrent streams", ylabel="output tokens/s", title="throughput")
    for key, label in (("ttft_p50_s", "TTFT p50"), ("itl_p50_s", "ITL p50")):
        b.plot(conc, [(r[key] or 0) * 1000 for r in rows], marker="o", label=label)
    b.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms", title="latency")
    b.legend()
    fig.suptitle(f"{report['model']} @ {report['url']}")
    fig.tight_layout()
    atomic_save_figure(fig, path)
    plt.close(fig)
