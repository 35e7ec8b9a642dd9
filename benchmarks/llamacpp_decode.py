"""The fused CPU step vs llama.cpp's own C++ benchmark on one GGUF file (issue 25).

llama.cpp: `llama-bench` (C++, no Python in its loop), `--repack 0` because its AMX/repacked
CPU paths die with SIGILL on the development VMs; tests pp<P> (a P-token prompt in one batch)
and tg<N> (N one-token steps), from an empty context, its own warm-up run first.
llmopt: `FusedModel` over `load_model(gguf, dtype="auto")`, i.e. the file's own blocks (the
packaged SmolLM2: Q4_1 layers and the tied Q8_0 embedding/head, nothing dequantized), timed the
same way: pp = one step of P tokens (logits of the last), tg = N one-token steps from an empty
paged cache (a warm-up pass first). Plus what llama-bench has no test for: a decode step of S
sequences at once (each at a context of C tokens), reported as aggregate tokens/s.

Plus `llmopt generate` itself (default flags, a fresh process per run, the decode tokens/s it
reports) against the same repetition's llama-bench tg<N>: the issue's "generate at batch 1" row.

Each repetition runs llama-bench then llmopt for every thread count (interleaved, so a shared
machine slows both alike); medians are kept, and the median of the per-repetition ratios
("paired ratio": both sides of a pair saw nearly the same load). Both sides are timed by the wall clock; llmopt's
CPU time per token is reported too (on a loaded machine it is the steadier figure). The load
average before and after each part goes into the JSON.

    python benchmarks/llamacpp_decode.py --llama-bench PATH/llama-bench --threads 1,2 \\
        --repeats 3 --out runs/llamacpp_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch


class Paged:
    """A paged cache and reusable step metadata for `streams` sequences of up to `max_len`."""

    def __init__(self, fused: Any, streams: int, max_len: int, block_size: int = 16) -> None:
        blocks = -(-max_len // block_size)
        self.bs = block_size
        self.k = torch.zeros(fused.kv_shape(streams * blocks * block_size))
        self.v = torch.zeros_like(self.k)
        self.tables = torch.arange(streams * blocks, dtype=torch.int32).view(streams, blocks)

    def slots(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.tables[seq, pos // self.bs].long() * self.bs + pos % self.bs


def run_prompt(fused: Any, tokens: torch.Tensor) -> tuple[float, float]:
    """(wall, cpu) seconds of one step feeding `tokens` to an empty sequence."""
    n = tokens.numel()
    cache = Paged(fused, 1, n)
    pos = torch.arange(n)
    seq = torch.zeros(n, dtype=torch.long)
    meta = (tokens, pos, cache.slots(seq, pos), torch.tensor([0, n]), torch.tensor([n]),
            cache.tables, torch.tensor([n - 1]))  # fmt: skip
    t0, c0 = time.perf_counter(), time.process_time()
    fused.forward_tensors(*meta, cache.k, cache.v, cache.bs)
    return time.perf_counter() - t0, time.process_time() - c0


def run_decode(fused: Any, streams: int, context: int, steps: int) -> tuple[float, float]:
    """(wall, cpu) seconds of `steps` decode steps of `streams` sequences, each sequence first
    prefilled (untimed) with `context` tokens; context 0 starts from an empty cache."""
    cache = Paged(fused, streams, context + steps)
    seqs = torch.arange(streams)
    gen = torch.Generator().manual_seed(0)
    vocab = fused.layout.shape["vocab"]
    if context:
        seq = seqs.repeat_interleave(context)
        pos = torch.arange(context).repeat(streams)
        fused.forward_tensors(
            torch.randint(vocab, (streams * context,), generator=gen), pos, cache.slots(seq, pos),
            torch.arange(streams + 1) * context, torch.full((streams,), context), cache.tables,
            torch.arange(streams) * context + context - 1, cache.k, cache.v, cache.bs,
        )  # fmt: skip
    tokens = torch.randint(vocab, (steps, streams), generator=gen)
    starts, rows = torch.arange(streams + 1), torch.arange(streams)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        pos = torch.full((streams,), context + i)
        fused.forward_tensors(tokens[i], pos, cache.slots(seqs, pos), starts, pos + 1,
                              cache.tables, rows, cache.k, cache.v, cache.bs)  # fmt: skip
    return time.perf_counter() - t0, time.process_time() - c0


def ours(fused: Any, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """tokens/s (wall) and CPU ms per token of each llmopt test."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(fused.layout.shape["vocab"], (args.pp,), generator=gen)
    out = {}
    wall, cpu = run_prompt(fused, prompt)
    out[f"pp{args.pp}"] = (args.pp / wall, 1e3 * cpu / args.pp)
    wall, cpu = run_decode(fused, 1, 0, args.tg)
    out[f"tg{args.tg}"] = (args.tg / wall, 1e3 * cpu / args.tg)
    n = args.streams * args.stream_steps
    wall, cpu = run_decode(fused, args.streams, args.context, args.stream_steps)
    out[f"decode x{args.streams} @{args.context}"] = (n / wall, 1e3 * cpu / n)
    return out


def generate_cli(model: str, threads: int, tokens: int) -> float:
    """Decode tokens/s that `llmopt generate` itself reports, default flags (the fused path),
    as a user runs it: a fresh process, `--threads`, greedy, EOS ignored so every run decodes
    `tokens` tokens."""
    argv = [sys.executable, "-m", "llmopt", "generate", "--model", model, "--threads",
            str(threads), "--max-new-tokens", str(tokens), "--ignore-eos", "--json",
            "--prompt", "The old lighthouse keeper climbed the stairs at dusk and"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=True)
    return float(json.loads(done.stdout)["decode_tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="packaged name or GGUF path")
    parser.add_argument("--llama-bench", help="llama-bench binary (default: $LLAMA_BENCH, PATH)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--pp", type=int, default=64, help="prompt tokens of the pp test")
    parser.add_argument("--tg", type=int, default=64, help="one-token steps of the tg test")
    parser.add_argument("--streams", type=int, default=16, help="sequences per decode step")
    parser.add_argument("--context", type=int, default=128, help="their context before timing")
    parser.add_argument("--stream-steps", type=int, default=16, help="timed multi-stream steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/llamacpp_decode.json")
    args = parser.parse_args()
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads {args.threads!r} must be comma-separated integers")
    if min(threads) < 1 or min(args.pp, args.tg, args.streams, args.stream_steps) < 1:
        parser.error("--threads, --pp, --tg, --streams and --stream-steps must be >= 1")
    if args.repeats < 1 or args.context < 0:
        parser.error("--repeats must be >= 1 and --context >= 0")
    from _llamacpp import llama_bench, llama_bench_binary
    from rich.console import Console
    from rich.table import Table

    from llmopt.artifacts import atomic_write_json
    from llmopt.infer.fast import FusedModel
    from llmopt.models.loading import load_model, resolve_spec

    binary = llama_bench_binary(args.llama_bench)
    kind, path = resolve_spec(args.model)
    if kind != "gguf":
        parser.error(f"--model {args.model!r} is not a GGUF file; llama-bench reads GGUF only")
    console = Console()
    model = load_model(path, dtype="auto")
    runners = {n: FusedModel(model, threads=n) for n in threads}
    for n in threads:  # warm-up: page the weights in, size the step buffers
        run_decode(runners[n], args.streams, 8, 2)
        run_prompt(runners[n], torch.arange(args.pp))
    samples: dict[tuple[int, str, str], list[float]] = {}
    info: dict[str, Any] = {}
    load = [list(os.getloadavg())]
    for rep in range(args.repeats):
        for n in threads:
            records = llama_bench(binary, str(path), n, n_prompt=args.pp, n_gen=args.tg)
            for r in records:
                test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
                samples.setdefault((n, test, "llama.cpp"), []).append(r["avg_ts"])
                info = {k: r[k] for k in ("build_commit", "model_type", "model_size", "type_k")}
            torch.set_num_threads(n)
            for test, (tok_s, cpu_ms) in ours(runners[n], args).items():
                samples.setdefault((n, test, "llmopt"), []).append(tok_s)
                samples.setdefault((n, test, "llmopt cpu ms/token"), []).append(cpu_ms)
            # `llmopt generate` as a user runs it, against the same llama-bench tg
            cli = f"generate CLI tg{args.tg}"
            samples.setdefault((n, cli, "llmopt"), []).append(generate_cli(str(path), n, args.tg))
            samples.setdefault((n, cli, "llmopt cpu ms/token"), []).append(float("nan"))
            samples.setdefault((n, cli, "llama.cpp"), []).append(
                samples[(n, f"tg{args.tg}", "llama.cpp")][-1]
            )
            load.append(list(os.getloadavg()))
            console.print(f"repetition {rep + 1}, {n} thread(s) done; load {load[-1]}")
    nbytes = runners[threads[0]].bytes_per_token
    results = []
    for (n, test, side), values in sorted(samples.items()):
        if side != "llmopt":
            continue
        ref = samples.get((n, test, "llama.cpp"))
        tok_s = statistics.median(values)
        # each repetition ran both sides back to back: their ratio drifts less with the load
        paired = [a / b for a, b in zip(values, ref)] if ref else None
        results.append({
            "threads": n,
            "test": test,
            "llmopt_tokens_per_s": tok_s,
            "llmopt_samples": values,
            "llmopt_cpu_ms_per_token": statistics.median(samples[(n, test, "llmopt cpu ms/token")]),
            "llamacpp_tokens_per_s": statistics.median(ref) if ref else None,
            "llamacpp_samples": ref,
            "ratio": tok_s / statistics.median(ref) if ref else None,
            "paired_ratio": statistics.median(paired) if paired else None,
            "paired_ratios": paired,
        })  # fmt: skip
    table = Table(
        title=f"{path.name}: llmopt fused step vs llama-bench {info.get('build_commit', '')} "
        f"(--repack 0), median of {args.repeats}"
    )
    columns = ("threads", "test", "llama.cpp tok/s", "llmopt tok/s", "ratio", "paired ratio",
               "llmopt CPU ms/tok")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for r in results:
        ref = r["llamacpp_tokens_per_s"]
        table.add_row(
            str(r["threads"]),
            r["test"],
            f"{ref:.1f}" if ref else "-",
            f"{r['llmopt_tokens_per_s']:.1f}",
            f"{r['ratio']:.2f}x" if r["ratio"] else "-",
            f"{r['paired_ratio']:.2f}x" if r["paired_ratio"] else "-",
            f"{r['llmopt_cpu_ms_per_token']:.2f}"
            if r["llmopt_cpu_ms_per_token"] == r["llmopt_cpu_ms_per_token"]
            else "-",
        )
    console.print(table)
    console.print(
        f"weights read per token: llmopt {nbytes / 1e6:.1f} MB, llama.cpp "
        f"{info.get('model_size', 0) / 1e6:.1f} MB (the file's tensors); load average {load}"
    )
    report = {
        "model": str(path),
        "llama_bench": info,
        "llmopt_bytes_per_token": nbytes,
        "llmopt_weight_formats": runners[threads[0]].kinds,
        "args": vars(args),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": load,
        "results": results,
    }
    atomic_write_json(args.out, report)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
