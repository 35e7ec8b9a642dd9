"""Serving race on loopback: `llmopt serve` vs `llama_cpp.server`, same GGUF, threads, requests.

Both servers are started here, on free loopback ports, with the same thread count (llmopt:
OMP_NUM_THREADS / torch threads; llama.cpp: --n_threads and --n_threads_batch), and both stay up
for the whole run. Each concurrency level is then driven by `llmopt.serve.bench` (the engine of
`llmopt bench serve`) against one server and then the other, alternating which goes first, so
drifting load on a shared machine hits both alike. Same prompts, same max_tokens, greedy,
bounded by --requests and --time-limit per level. One warm-up request per server first.

    python benchmarks/serve_vs_llamacpp.py --threads 2 --concurrency 1,4,16 --requests 16 \\
        --out runs/serve_vs_llamacpp.json

Writes the JSON report and a PNG (tokens/s and TTFT p50 against concurrency, both servers).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _report import run_info, save_figure, table, write_report


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, argv: list[str], threads: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    out = log.open("w")
    return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(name: str, proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Poll /v1/models until it answers; a server that exits or hangs ends the run, saying why."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise SystemExit(f"{name} exited with {proc.returncode} before serving: {tail[0]}")
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


def llamacpp_settings(gguf: Path, threads: int, n_ctx: int, port: int, extra: bool) -> list[str]:
    """llama_cpp.server's command line. Its app serialises completions behind one lock on a
    single `Llama` (llama-cpp-python's server has no parallel slots), so concurrent requests
    queue; `interrupt_requests` (default True) would end a running stream whenever another
    request arrives, so it is turned off: every request runs to max_tokens. Started through
    _llamacpp.py, which turns llama.cpp's extra buffer types (AMX, repacking) off unless
    `extra`: AMX faults on the development VM."""
    return [
        sys.executable, str(Path(__file__).with_name("_llamacpp.py")),
        *(["--extra-bufts"] if extra else []), "--",
        "--model", str(gguf), "--model_alias", "smollm2-135m",
        "--host", "127.0.0.1", "--port", str(port),
        "--n_ctx", str(n_ctx), "--n_batch", "512",
        "--n_threads", str(threads), "--n_threads_batch", str(threads),
        "--interrupt_requests", "False",
    ]  # fmt: skip


def llmopt_settings(model: str, port: int, max_seqs: int) -> list[str]:
    return [
        sys.executable, "-m", "llmopt", "serve", "--model", model,
        "--served-model-name", "smollm2-135m", "--port", str(port),
        "--max-num-seqs", str(max_seqs),
    ]  # fmt: skip


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for server in ("llmopt", "llama.cpp"):
        mine = [r for r in rows if r["server"] == server]
        conc = [r["concurrency"] for r in mine]
        a.plot(conc, [r["output_tokens_per_s"] for r in mine], marker="o", label=server)
        b.plot(conc, [(r["ttft_p50_s"] or 0) * 1000 for r in mine], marker="o", label=server)
    a.set(xscale="log", xlabel="concurrent streams", ylabel="output tokens/s", title="throughput")
    b.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms", title="TTFT p50")
    a.legend()
    b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=16, help="requests per level and server")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per level")
    parser.add_argument("--n-ctx", type=int, default=2048, help="llama.cpp context")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument(
        "--llamacpp-extra-bufts", action="store_true", help="let llama.cpp use AMX/repacking"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/serve_vs_llamacpp.json"))
    args = parser.parse_args()
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency {args.concurrency!r} must be comma-separated integers")
    if args.threads < 1 or args.requests < 1 or args.max_tokens < 1 or min(levels) < 1:
        parser.error("--threads, --requests, --max-tokens and every level must be >= 1")
    from _llamacpp import require_llama_cpp

    require_llama_cpp("llama_cpp.server")
    from rich.console import Console

    from llmopt.models.registry import resolve
    from llmopt.serve.bench import run_bench
    from llmopt.serve.bench_cli import DEFAULT_PROMPTS

    console = Console()
    gguf = resolve(args.model)
    ports = {"llmopt": free_port(), "llama.cpp": free_port()}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    argv = {
        "llmopt": llmopt_settings(args.model, ports["llmopt"], max(levels)),
        "llama.cpp": llamacpp_settings(
            gguf, args.threads, args.n_ctx, ports["llama.cpp"], args.llamacpp_extra_bufts
        ),
    }
    logs = {k: args.out.with_name(f"{args.out.stem}.{k.replace('.', '')}.log") for k in argv}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    procs = {k: start_server(k, argv[k], args.threads, logs[k]) for k in argv}
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    try:
        for k in procs:
            wait_ready(k, procs[k], urls[k], logs[k], args.startup_timeout)
            run_bench(urls[k], [1], 1, 60.0, prompts=list(DEFAULT_PROMPTS), max_tokens=4)
        for i, c in enumerate(levels):
            order = ["llmopt", "llama.cpp"][:: 1 if i % 2 == 0 else -1]
            for k in order:
                console.print(f"{k}: {c} concurrent streams")
                report = run_bench(
                    urls[k], [c], args.requests, args.time_limit,
                    prompts=list(DEFAULT_PROMPTS), max_tokens=args.max_tokens,
                )  # fmt: skip
                rows.append({"server": k, **report["levels"][0]})
    finally:
        for proc in procs.values():
            stop(proc)
    load_after = os.getloadavg()
    for r in rows:
        ref = next(x for x in rows if x["server"] == "llama.cpp" and x["concurrency"] == r["concurrency"])  # fmt: skip
        r["tokens_per_s_vs_llamacpp"] = r["output_tokens_per_s"] / ref["output_tokens_per_s"]
        ttft, ref_ttft = r["ttft_p50_s"], ref["ttft_p50_s"]
        r["ttft_p50_vs_llamacpp"] = ttft / ref_ttft if ttft and ref_ttft else None

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    title = (
        f"{args.model}: llmopt serve vs llama_cpp.server, {args.threads} threads, "
        f"{args.max_tokens} tokens/request"
    )
    columns = ["streams", "server", "reqs", "err", "tokens", "out tok/s", "TTFT p50 ms",
               "ITL p50 ms", "TPOT ms", "tok/s vs llama.cpp", "TTFT vs llama.cpp"]  # fmt: skip
    cells = [
        [str(r[k]) for k in ("concurrency", "server", "requests", "errors", "output_tokens")]
        + [f"{r['output_tokens_per_s']:.1f}"]
        + [ms(r[k]) for k in ("ttft_p50_s", "itl_p50_s", "tpot_mean_s")]
        + [f"{r['tokens_per_s_vs_llamacpp']:.2f}x"]
        + [f"{r['ttft_p50_vs_llamacpp']:.2f}x" if r["ttft_p50_vs_llamacpp"] else "-"]
        for r in rows
    ]
    console.print(table(title, columns, cells))
    console.print(f"load average before {load_before}, after {load_after}")
    payload = {
        "run": run_info(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "gguf": gguf.name,
        "commands": {k: " ".join(v) for k, v in argv.items()},
        "load_average_before": load_before,
        "load_average_after": load_after,
        "levels": rows,
    }
    write_report(console, args.out, payload)
    plot(rows, args.out.with_suffix(".png"), title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
