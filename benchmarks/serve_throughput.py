"""Serving engine targets, measured side by side in one process on one model:

1. aggregate decode throughput of N concurrent streams (continuous batching over the paged
   cache) vs our own batch-1 decode rate (`llmopt.infer.generate`); target >= 8x at N=16,
2. TTFT of a request whose 512-token system prompt is in the prefix cache vs the same request
   with prefix caching off; target >= 5x shorter,
3. KV blocks allocated vs needed (ceil(tokens / block size) per live request), sampled every
   step of the N-stream run, against preallocating every request to the model context.

    python benchmarks/serve_throughput.py --model smollm2-135m --streams 16 --new-tokens 32
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from llmopt.artifacts import atomic_write_json


def _decode_rate_batch1(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """Decode tokens per wall second and per CPU second of `generate` (first token excluded)."""
    from llmopt.infer.generate import generate

    stamps: list[tuple[float, float]] = []

    def stamp(_: int) -> None:
        stamps.append((time.perf_counter(), time.process_time()))

    generate(model, prompt, max_new_tokens=new_tokens, on_token=stamp)
    n = len(stamps) - 1
    return n / (stamps[-1][0] - stamps[0][0]), n / (stamps[-1][1] - stamps[0][1])


def _engine(model, blocks: int, block_size: int, streams: int, prefix: bool = True):
    from llmopt.infer.batch import EngineConfig, ServingEngine

    cfg = EngineConfig(
        num_blocks=blocks, block_size=block_size, max_num_seqs=streams, max_batched_tokens=2048,
        prefix_caching=prefix,
    )  # fmt: skip
    return ServingEngine(model, cfg)


def decode_throughput(model, prompts, new_tokens: int, block_size: int) -> dict:
    """Aggregate decode tokens/s once every stream has its first token, + block accounting."""
    from llmopt.infer.batch import SamplingParams

    engine = _engine(model, 4096, block_size, len(prompts))
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while any(not r.output for r in reqs):
        engine.step()
    start_tokens = sum(len(r.output) for r in reqs)
    worst, samples = 0.0, []
    start, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        live = list(engine.scheduler.running)
        needed = sum(engine.blocks.blocks_for(r.num_tokens) for r in live)
        samples.append((engine.blocks.num_used, needed))
        worst = max(worst, engine.blocks.num_used / max(needed, 1))
        engine.step()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(r.output) for r in reqs) - start_tokens
    ctx_blocks = len(prompts) * engine.blocks.blocks_for(model.config.max_seq_len)
    return {
        "streams": len(prompts),
        "decode_tokens": tokens,
        "decode_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "tokens_per_cpu_s": tokens / cpu,
        "blocks_used_max": max(u for u, _ in samples),
        "blocks_needed_max": max(n for _, n in samples),
        "allocated_over_needed_worst": worst,
        "blocks_if_preallocated_to_context": ctx_blocks,
    }


def prefix_ttft(model, system: list[int], questions: list[list[int]], block_size: int) -> dict:
    """TTFT of questions[1:] after questions[0] warmed the shared system prompt."""
    from llmopt.infer.batch import SamplingParams

    out = {}
    for prefix in (False, True):
        engine = _engine(model, 512, block_size, 4, prefix)
        engine.generate([system + questions[0]], SamplingParams(max_tokens=1))
        times, cpus = [], []
        for i, q in enumerate(questions[1:]):
            start, cpu = time.perf_counter(), time.process_time()
            req = engine.add_request(f"q{i}", system + q, SamplingParams(max_tokens=1))
            while not req.output:
                engine.step()
            times.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        key = "cached" if prefix else "uncached"
        out[key] = sorted(times)[len(times) // 2]
        out[key + "_cpu"] = sorted(cpus)[len(cpus) // 2]
        if prefix:
            out["prefix_hit_tokens"] = req.num_prefix_hit_tokens
    out["ttft_cut"] = out["uncached"] / out["cached"]
    out["ttft_cut_cpu"] = out["uncached_cpu"] / out["cached_cpu"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("runs/serve_throughput.json"))
    args = parser.parse_args()
    from llmopt.models.loading import load_model, load_tokenizer

    torch.manual_seed(0)
    model, tok = load_model(args.model), load_tokenizer(args.model)
    topics = ["the sea", "mountains", "a city", "a forest", "the desert", "winter", "a river",
              "the stars", "a library", "a train", "a garden", "the moon", "an island",
              "a market", "a storm", "a bridge"]  # fmt: skip
    prompts = [
        tok.encode(f"Write a story about {topics[i % len(topics)]} number {i}.")
        for i in range(args.streams)
    ]
    # batch-1 before and after the batched run: the machine is shared, so average the two
    before = _decode_rate_batch1(model, prompts[0], args.new_tokens)
    batched = decode_throughput(model, prompts, args.new_tokens, args.block_size)
    after = _decode_rate_batch1(model, prompts[1], args.new_tokens)
    base = (before[0] + after[0]) / 2
    base_cpu = (before[1] + after[1]) / 2
    filler = "You are a careful assistant. Follow the policy below exactly. " * 200
    system = tok.encode(filler)[: args.system_tokens]
    questions = [tok.encode(f" Question {i}: what is {i} plus {i}?") for i in range(3)]
    ttft = prefix_ttft(model, system, questions, args.block_size)
    report = {
        "model": args.model,
        "machine": f"{platform.machine()} {platform.processor()} torch {torch.__version__}, {torch.get_num_threads()} threads",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "batch1_tokens_per_s": base,
        "batch1_before_after": [before, after],
        "batched": batched,
        "batch1_tokens_per_cpu_s": base_cpu,
        "speedup": batched["tokens_per_s"] / base,
        "speedup_cpu": batched["tokens_per_cpu_s"] / base_cpu,
        "load_average": list(os.getloadavg()),
        "prefix": ttft,
    }
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; wall | CPU-time figures"
    )
    print(f"batch-1 decode ({args.model}, llmopt.infer.generate): {base:.2f} tok/s | "
          f"{base_cpu:.2f} tok/CPU-s")  # fmt: skip
    print(f"{args.streams} streams, continuous batching: {batched['tokens_per_s']:.2f} tok/s "
          f"= {report['speedup']:.1f}x | {batched['tokens_per_cpu_s']:.2f} tok/CPU-s = "
          f"{report['speedup_cpu']:.1f}x (target >= 8x)")  # fmt: skip
    print(f"TTFT with a {len(system)}-token system prompt: uncached {ttft['uncached'] * 1000:.0f} ms, "
          f"cached {ttft['cached'] * 1000:.0f} ms = {ttft['ttft_cut']:.1f}x cut | CPU "
          f"{ttft['uncached_cpu'] * 1000:.0f} vs {ttft['cached_cpu'] * 1000:.0f} ms = "
          f"{ttft['ttft_cut_cpu']:.1f}x (target >= 5x)")  # fmt: skip
    print(f"KV blocks: max used {batched['blocks_used_max']} vs needed {batched['blocks_needed_max']} "
          f"(worst ratio {batched['allocated_over_needed_worst']:.2f}); preallocating to context: "
          f"{batched['blocks_if_preallocated_to_context']}")  # fmt: skip
    atomic_write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
