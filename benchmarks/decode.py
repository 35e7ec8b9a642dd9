"""Batch-1 decode and prefill speed: llmopt vs HF transformers `generate`, same weights/threads.

Also measures the machine's memory read bandwidth and reports the fraction of the bandwidth
roofline each run reaches: a batch-1 decode step must read every weight once, so
tokens/s <= bandwidth / bytes of weights. Runs are interleaved (ours, HF, ours, HF, ...) and
the median is kept, so a machine shared with other jobs slows both sides alike.

    python benchmarks/decode.py --threads 2 --out runs/decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def measure_read_bandwidth(threads: int, mbytes: int = 512, repeats: int = 7) -> float:
    """Bytes/s of streaming reads (a sum over a buffer far larger than the caches)."""
    torch.set_num_threads(threads)
    buf = torch.ones(mbytes * 2**20 // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter once (a tied embedding is read as the head)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def time_ours(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds for new_tokens - 1 steps) with llmopt's generate."""
    from llmopt.infer.generate import generate
    from llmopt.models.llama import KVCache

    with torch.inference_mode():
        cache = KVCache.for_model(model, max_len=len(prompt) + 1)
        t0 = time.perf_counter()
        model(torch.tensor([prompt]), cache, last_only=True)
        prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate(model, prompt, max_new_tokens=1)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = generate(model, prompt, max_new_tokens=new_tokens)
    full = time.perf_counter() - t0
    assert len(out) == new_tokens
    return prefill, full - one


def time_hf(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(ids, attention_mask=mask, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        full = time.perf_counter() - t0
    assert out.shape[1] == len(prompt) + new_tokens
    return prefill, full - one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--out", default="runs/decode.json")
    args = parser.parse_args()

    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    from llmopt.data.corpus import load_text
    from llmopt.models.loading import load_model, load_tokenizer, save_pretrained

    torch.set_num_threads(args.threads)
    console = Console()
    bandwidth = measure_read_bandwidth(args.threads)
    console.print(f"memory read bandwidth ({args.threads} threads): {bandwidth / 1e9:.1f} GB/s")
    tokenizer = load_tokenizer(args.model)
    prompt = tokenizer.encode(load_text("corpus:web-bible", max_chars=20_000))[: args.prompt_tokens]
    t0 = time.perf_counter()
    base = load_model(args.model)
    load_s = time.perf_counter() - t0
    hf_dir = None
    if not args.no_hf:
        hf_dir = tempfile.TemporaryDirectory()
        save_pretrained(base, hf_dir.name)  # the same dequantised weights for transformers

    results = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        ours = base if dtype == torch.float32 else load_model(args.model, dtype=dtype)
        runners = {"llmopt": (ours, time_ours)}
        if hf_dir is not None:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(hf_dir.name, dtype=dtype).eval()
            runners["transformers"] = (hf, time_hf)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
        for model, fn in runners.values():  # warm-up
            fn(model, prompt[:16], 4)
        for _ in track(range(args.repeats), description=f"{dtype_name} runs", console=console):
            for name, (model, fn) in runners.items():
                samples[name].append(fn(model, prompt, args.new_tokens))
        for name, (model, _) in runners.items():
            prefill = statistics.median(s[0] for s in samples[name])
            decode = statistics.median(s[1] for s in samples[name])
            tok_s = (args.new_tokens - 1) / decode
            nbytes = weight_bytes_per_token(model)
            results.append(
                {
                    "impl": name,
                    "dtype": dtype_name,
                    "decode_tokens_per_s": tok_s,
                    "prefill_tokens_per_s": len(prompt) / prefill,
                    "weight_bytes_per_token": nbytes,
                    "roofline_tokens_per_s": bandwidth / nbytes,
                    "roofline_fraction": tok_s / (bandwidth / nbytes),
                    "achieved_GB_per_s": tok_s * nbytes / 1e9,
                }
            )
    by_key = {(r["impl"], r["dtype"]): r for r in results}
    for r in results:
        hf = by_key.get(("transformers", r["dtype"]))
        r["speedup_vs_transformers"] = (
            r["decode_tokens_per_s"] / hf["decode_tokens_per_s"] if hf else None
        )

    table = Table(
        title=f"{args.model} batch-1 decode, {args.threads} threads, prompt {len(prompt)}, "
        f"{args.new_tokens} new tokens, median of {args.repeats}"
    )
    for col in ("impl", "dtype", "decode tok/s", "prefill tok/s", "GB/s", "roofline tok/s",
                "of roofline", "vs transformers"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in results:
        speedup = r["speedup_vs_transformers"]
        table.add_row(
            r["impl"],
            r["dtype"],
            f"{r['decode_tokens_per_s']:.1f}",
            f"{r['prefill_tokens_per_s']:.0f}",
            f"{r['achieved_GB_per_s']:.1f}",
            f"{r['roofline_tokens_per_s']:.1f}",
            f"{100 * r['roofline_fraction']:.0f}%",
            f"{speedup:.2f}x" if speedup else "-",
        )
    console.print(table)
    report = {
        "model": args.model,
        "threads": args.threads,
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "memory_read_bandwidth_GB_per_s": bandwidth / 1e9,
        "load_seconds": load_s,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, out)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
