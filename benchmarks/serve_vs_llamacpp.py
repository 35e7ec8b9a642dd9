"""Serving race on loopback: `llmopt serve` vs llama.cpp's C++ `llama-server`, same GGUF.

What users deploy is `llama-server` (parallel slots, continuous batching), so that is the
anchor, started with `-np STREAMS` slots, `-t/-tb THREADS`, and `--no-repack` (llama.cpp's
AMX/repacked path dies with SIGILL on the development VMs). `llmopt serve` gets the same GGUF
(its weights as the file has them), `--threads THREADS` and `--max-num-seqs STREAMS`.

Build llama-server from the llama.cpp sources that the llama-cpp-python 0.3.36 sdist vendors
(never in CI, ~11 min on 2 cores), then pass its path with --llama-server:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-server -j2

Method: for each thread count both servers are started (on one core with --threads 1: both
pinned to core 0, the load generator to core 1), then for each round and each stream count
both are driven by `llmopt.serve.bench` (same prompts from benchmarks/data/race_prompts.txt,
greedy, --max-tokens each, EOS ignored), alternating which goes first. Figures are medians
over the rounds. Achieved weight bandwidth is tokens/s x bytes read per token (1 stream) and
decode steps/s x bytes per step (16 streams), beside the machine's measured copy bandwidth.

    python benchmarks/serve_vs_llamacpp.py --llama-server PATH/llama-server --threads 1,2 \\
        --streams 1,16 --rounds 3 --out runs/serve_vs_llamacpp.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from _report import run_info, save_figure, table, write_report

PROMPTS = Path(__file__).with_name("data") / "race_prompts.txt"
SERVERS = ("llmopt", "llama-server")


def read_prompts(path: Path = PROMPTS) -> list[str]:
    lines = path.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(argv: list[str], cores: str | None) -> list[str]:
    return ["taskset", "-c", cores, *argv] if cores and shutil.which("taskset") else argv


def start_server(argv: list[str], threads: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_ready(name: str, proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Poll /v1/models until it answers; a server that exits or hangs ends the run, saying why."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] or ["(no output)"]
            raise SystemExit(f"{name} exited with {proc.returncode} before serving: {tail}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"{name} did not answer {url}/v1/models within {timeout:.0f} s (log: {log})")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def commands(args, gguf: Path, threads: int, ports: dict[str, int]) -> dict[str, list[str]]:
    slots = max(args.streams)
    ctx = slots * args.ctx_per_slot
    return {
        "llmopt": [
            "llmopt", "serve", "--model", args.model, "--served-model-name", "race",
            "--port", str(ports["llmopt"]), "--threads", str(threads),
            "--max-num-seqs", str(slots),
        ],
        "llama-server": [
            args.llama_server, "-m", str(gguf), "-a", "race", "--host", "127.0.0.1",
            "--port", str(ports["llama-server"]), "-np", str(slots), "-c", str(ctx),
            "-t", str(threads), "-tb", str(threads), "--no-repack", "--no-webui",
        ],
    }  # fmt: skip


def bytes_per_step(model_name: str) -> int:
    """Weight bytes one decode step reads in `llmopt serve` (the fused layout of the GGUF)."""
    from llmopt.infer.fast import weight_bytes_for
    from llmopt.models.loading import load_model

    return weight_bytes_for(load_model(model_name, dtype="auto"))


def race(args, threads: int, prompts: list[str], console) -> list[dict[str, Any]]:
    from llmopt.models.registry import resolve
    from llmopt.serve.bench import run_bench

    gguf = resolve(args.model)
    ports = {name: free_port() for name in SERVERS}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    argv = commands(args, gguf, threads, ports)
    server_cores, client_cores = ("0", "1") if threads == 1 and os.cpu_count() > 1 else (None, None)
    logs = {k: args.out.with_name(f"{args.out.stem}.t{threads}.{k}.log") for k in SERVERS}
    procs = {k: start_server(pinned(argv[k], server_cores), threads, logs[k]) for k in SERVERS}
    if client_cores:
        os.sched_setaffinity(0, {int(client_cores)})
    rows = []
    try:
        for k in SERVERS:
            wait_ready(k, procs[k], urls[k], logs[k], args.startup_timeout)
            run_bench(urls[k], [1], 2, 60.0, prompts=prompts, max_tokens=4)  # warm-up
        for rnd in range(args.rounds):
            for i, streams in enumerate(args.streams):
                order = SERVERS if (rnd + i) % 2 == 0 else SERVERS[::-1]
                for k in order:
                    requests = max(args.requests_per_stream * streams, args.min_requests)
                    report = run_bench(
                        urls[k], [streams], requests, args.time_limit,
                        prompts=prompts, max_tokens=args.max_tokens,
                    )  # fmt: skip
                    row = {"server": k, "threads": threads, "round": rnd, **report["levels"][0]}
                    rows.append(row)
                    console.print(
                        f"t{threads} round {rnd} {k:13s} {streams:2d} streams: "
                        f"{row['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                        f"{(row['ttft_p50_s'] or 0) * 1000:.0f} ms, errors {row['errors']}"
                    )
    finally:
        for proc in procs.values():
            stop(proc)
        os.sched_setaffinity(0, set(range(os.cpu_count())))
    return rows


def medians(rows: list[dict]) -> list[dict]:
    out = []
    keys = sorted({(r["threads"], r["concurrency"], r["server"]) for r in rows})
    for threads, streams, server in keys:
        mine = [r for r in rows if (r["threads"], r["concurrency"], r["server"]) == (threads, streams, server)]  # fmt: skip
        med = {
            k: statistics.median([r[k] for r in mine if r[k] is not None] or [0.0])
            for k in ("output_tokens_per_s", "ttft_p50_s", "itl_p50_s", "tpot_mean_s")
        }
        out.append({"threads": threads, "streams": streams, "server": server, "rounds": len(mine),
                    "errors": sum(r["errors"] for r in mine), **med})  # fmt: skip
    for r in out:
        ref = next(x for x in out if x["server"] == "llama-server" and
                   (x["threads"], x["streams"]) == (r["threads"], r["streams"]))  # fmt: skip
        r["tok_s_vs_llama_server"] = r["output_tokens_per_s"] / ref["output_tokens_per_s"]
        r["ttft_vs_llama_server"] = (
            r["ttft_p50_s"] / ref["ttft_p50_s"] if ref["ttft_p50_s"] else None
        )
    return out


def plot(summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for server in SERVERS:
        for threads in sorted({r["threads"] for r in summary}):
            mine = [r for r in summary if r["server"] == server and r["threads"] == threads]
            x = [r["streams"] for r in mine]
            label = f"{server} t{threads}"
            a.plot(x, [r["output_tokens_per_s"] for r in mine], marker="o", label=label)
            b.plot(x, [r["ttft_p50_s"] * 1000 for r in mine], marker="o", label=label)
    a.set(xscale="log", xlabel="concurrent streams", ylabel="output tokens/s", title="throughput")
    b.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms", title="TTFT p50")
    a.legend()
    b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", default=shutil.which("llama-server"),
                        help="path of the llama-server binary (see the module docstring)")  # fmt: skip
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--ctx-per-slot", type=int, default=512)
    parser.add_argument("--time-limit", type=float, default=180.0, help="seconds per level")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=Path("runs/serve_vs_llamacpp.json"))
    args = parser.parse_args()
    try:
        args.threads = [int(t) for t in args.threads.split(",")]
        args.streams = [int(s) for s in args.streams.split(",")]
    except ValueError:
        parser.error("--threads and --streams are comma-separated integers")
    if not args.llama_server or not Path(args.llama_server).is_file():
        parser.error(f"--llama-server {args.llama_server!r} is not a file; build it (see --help)")
    if min(args.threads + args.streams) < 1 or args.rounds < 1 or args.max_tokens < 1:
        parser.error("--threads, --streams, --rounds and --max-tokens must be >= 1")
    from rich.console import Console

    from llmopt.peaks import measure_peaks

    console = Console()
    prompts = read_prompts()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    peaks = {t: measure_peaks("cpu", copy_mib=256, threads=t).bytes_per_s for t in args.threads}
    rows = []
    for threads in args.threads:
        rows += race(args, threads, prompts, console)
    load_after = os.getloadavg()
    summary = medians(rows)
    step_bytes = bytes_per_step(args.model)
    for r in summary:
        if r["server"] == "llmopt":
            steps_per_s = r["output_tokens_per_s"] / r["streams"]  # every stream decodes each step
            r["weight_GB_per_s"] = steps_per_s * step_bytes / 1e9
            r["copy_GB_per_s"] = peaks[r["threads"]] / 1e9
    title = f"{args.model}: llmopt serve vs llama-server, {args.max_tokens} tokens/request"
    columns = ["threads", "streams", "server", "rounds", "err", "out tok/s", "TTFT p50 ms",
               "ITL p50 ms", "tok/s vs llama-server", "TTFT vs llama-server", "weights GB/s",
               "copy GB/s"]  # fmt: skip
    cells = [
        [
            str(r["threads"]),
            str(r["streams"]),
            r["server"],
            str(r["rounds"]),
            str(r["errors"]),
            f"{r['output_tokens_per_s']:.1f}",
            f"{r['ttft_p50_s'] * 1000:.0f}",
            f"{r['itl_p50_s'] * 1000:.1f}",
            f"{r['tok_s_vs_llama_server']:.2f}x",
            f"{r['ttft_vs_llama_server']:.2f}x" if r["ttft_vs_llama_server"] else "-",
            f"{r['weight_GB_per_s']:.1f}" if "weight_GB_per_s" in r else "-",
            f"{r['copy_GB_per_s']:.1f}" if "copy_GB_per_s" in r else "-",
        ]  # fmt: skip
        for r in summary
    ]
    console.print(table(title, columns, cells))
    console.print(f"load average before {load_before}, after {load_after}")
    payload = {
        "run": run_info(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "commands": {
            t: commands(args, Path("GGUF"), t, {k: 0 for k in SERVERS}) for t in args.threads
        },
        "weight_bytes_per_step": step_bytes,
        "copy_bytes_per_s": peaks,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "summary": summary,
        "rounds": rows,
    }
    write_report(console, args.out, payload)
    plot(summary, args.out.with_suffix(".png"), title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
