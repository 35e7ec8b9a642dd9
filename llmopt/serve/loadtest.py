"""A bounded load-and-fault test of `llmopt serve` on loopback (issue 30, item 4).

`run_load_test` drives a server at `url` with `streams` concurrent streaming clients doing
`per_stream` requests each (`llmopt.serve.bench.run_level`), and alongside them clients that
disconnect mid-stream and bodies larger than the server's limit; then it waits for the engine
to go idle and reads /metrics. The report holds the latency percentiles, the errors, and the
KV blocks still referenced once every request is done (leaked blocks: must be 0) with the
metric deltas that must account for every request. `serve_in_thread` runs the real app under
uvicorn in this process (the tests and `benchmarks/serve_load.py` use both).

Bounded: a fixed number of requests, a time limit, and only 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator

from llmopt.serve.bench import check_loopback, run_level

LOAD_PROMPTS = (
    "In the beginning God created the heavens and the earth.",
    "The quick brown fox jumps over the lazy dog.",
    "Explain how a steam engine turns heat into motion.",
    "List the planets of the solar system.",
)
_SAMPLE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def read_metrics(url: str) -> dict[str, float]:
    """/metrics as {name or name{labels}: value}."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            key = match["name"] + (f"{{{match['labels']}}}" if match["labels"] else "")
            out[key] = float(match["value"])
    return out


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


async def _disconnect(client, url: str, model: str) -> bool:
    """Open a long stream, read its first token, go away; True if a token came first."""
    body = {"model": model, "prompt": LOAD_PROMPTS[0], "max_tokens": 200, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                return resp.status_code == 200
    return False


async def _oversize(client, url: str, model: str, nbytes: int) -> int:
    body = json.dumps({"model": model, "prompt": "x" * nbytes, "max_tokens": 1})
    resp = await client.post(url + "/v1/completions", content=body.encode())
    return resp.status_code


async def _faults(url: str, model: str, disconnects: int, oversize: int, nbytes: int):
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        gone = await asyncio.gather(*(_disconnect(client, url, model) for _ in range(disconnects)))
        codes = await asyncio.gather(
            *(_oversize(client, url, model, nbytes) for _ in range(oversize))
        )
    return list(gone), list(codes)


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    """The metrics once no request is running or waiting (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(url)
        idle = not (m.get("llmopt_running_requests") or m.get("llmopt_queue_depth"))
        if (idle and not m.get("llmopt_unfinished_requests")) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def run_load_test(
    url: str,
    model: str,
    *,
    streams: int = 64,
    per_stream: int = 4,
    max_tokens: int = 8,
    disconnects: int = 8,
    oversize: int = 4,
    oversize_bytes: int = 9 << 20,
    time_limit: float = 300.0,
) -> dict:
    """The load and the faults, concurrently; the report (see the module doc)."""
    url = check_loopback(url)
    before = read_metrics(url)
    start = time.perf_counter()

    async def both():
        return await asyncio.gather(
            run_level(url, model, streams, streams * per_stream, time_limit, list(LOAD_PROMPTS),
                      max_tokens),
            _faults(url, model, disconnects, oversize, oversize_bytes),
        )  # fmt: skip

    level, (gone, codes) = asyncio.run(both())
    after = wait_idle(url)
    finished = {
        reason: _delta(after, before, f'llmopt_requests_finished_total{{reason="{reason}"}}')
        for reason in ("stop", "length", "abort", "error", "invalid")
    }
    return {
        "streams": streams,
        "requests": level["requests"],
        "errors": level["errors"],
        "first_errors": level["first_errors"],
        "wall_s": time.perf_counter() - start,
        "latency_p50_s": level["latency_p50_s"],
        "latency_p99_s": level["latency_p99_s"],
        "ttft_p50_s": level["ttft_p50_s"],
        "ttft_p99_s": level["ttft_p99_s"],
        "output_tokens": level["output_tokens"],
        "output_tokens_per_s": level["output_tokens_per_s"],
        "disconnects": sum(gone),
        "oversize_status": sorted(set(codes)),
        "finished": finished,
        "rejected_413": _delta(after, before, 'llmopt_requests_rejected_total{reason="413"}'),
        "leaked_kv_blocks": after.get("llmopt_kv_blocks_used", 0.0),
        "unfinished_requests": after.get("llmopt_unfinished_requests", 0.0),
    }


@contextlib.contextmanager
def serve_in_thread(worker, tokenizer, name: str, **app_options) -> Iterator[str]:
    """The real app (`create_app`) under uvicorn on 127.0.0.1:<free port> in a thread; yields
    its base URL; stops the server (and drains the worker) on exit."""
    import uvicorn

    from llmopt.serve.app import create_app

    app = create_app(worker.start(), tokenizer, name, **app_options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
