"""Batch-1 decode and prefill speed: llmopt vs HF transformers `generate`, same weights/threads.

Also measures the machine's memory read bandwidth (`llmopt.peaks.read_bytes_per_s`) and
reports the fraction of the bandwidth roofline each run reaches: a batch-1 decode step must
read every weight once, so tokens/s <= bandwidth / bytes of weights. Runs are interleaved
(ours, HF, ours, HF, ...) and the median is kept, so a machine shared with other jobs slows
both sides alike.

    python benchmarks/decode.py --threads 2 --out runs/decode.json

Implementations per weight kind (--dtypes float32,bfloat16,int8,int4,auto; int8 = RTN
per-channel, int4 = RTN g128 of the same weights, auto = the GGUF's own blocks as
`load_model(dtype="auto")` keeps them): llmopt eager, llmopt fast (llmopt.infer.fast: fused
layout, one C++ call per step), fast + INT8 head for quantized weights, and transformers for
float dtypes. `ops/step` counts aten ops one eager step dispatches (1 for the fast path's
single call, which runs 4 GEMVs per layer + the head inside).
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

from llmopt.profile.decode_bytes import eager_decode_bytes


def eager_ops_per_step(model, prompt: list[int]) -> int:
    """aten ops dispatched by one eager decode step (KV-cached, one new token)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from llmopt.models.llama import KVCache

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with torch.inference_mode():
        cache = KVCache.for_model(model, max_len=len(prompt) + 1)
        model(torch.tensor([prompt]), cache, last_only=True)
        with Count():
            model(torch.tensor([[prompt[-1]]]), cache, last_only=True)
    return Count.n


def time_ours(model, prompt: list[int], new_tokens: int, fast: bool, int8_head: bool = False):
    """(prefill seconds, decode seconds for new_tokens - 1 steps) from generate's own timer."""
    from llmopt.infer.generate import generate

    stats: dict = {}
    out = generate(
        model, prompt, max_new_tokens=new_tokens, fast=fast, int8_head=int8_head, stats=stats
    )
    assert len(out) == new_tokens and stats["path"] == ("fused" if fast else "eager")
    return stats["prefill_s"], stats["decode_s"]


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


QUANT = {"int8": (8, -1), "int4": (4, 128)}


def variant_models(name: str, base, model_name: str):
    """(llmopt model, torch dtype for transformers or None) for a --dtypes entry."""
    from llmopt.models.loading import load_model

    if name == "auto":  # the GGUF's own blocks (Q4_1 + Q8_0 head for the packaged model)
        return load_model(model_name, dtype="auto"), None
    if name in QUANT:
        from llmopt.compress.quant.apply import quantize_model

        bits, group = QUANT[name]
        return quantize_model(base, bits=bits, group_size=group), None
    dtype = getattr(torch, name)
    return (base if dtype == torch.float32 else load_model(model_name, dtype=dtype)), dtype


def run_dtype(args, name, base, hf_dir, prompt, bandwidth, console) -> list[dict]:
    """Eager, fast (and fast + INT8 head for quantized weights) and transformers, interleaved."""
    from rich.progress import track

    from llmopt.infer.fast import weight_bytes_for

    ours, hf_dtype = variant_models(name, base, args.model)
    runners = {
        "llmopt-eager": (ours, lambda m, p, n: time_ours(m, p, n, fast=False)),
        "llmopt-fast": (ours, lambda m, p, n: time_ours(m, p, n, fast=True)),
    }
    if name in QUANT:
        runners["llmopt-fast+int8head"] = (
            ours,
            lambda m, p, n: time_ours(m, p, n, fast=True, int8_head=True),
        )
    if hf_dir is not None and hf_dtype is not None:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir.name, dtype=hf_dtype).eval()
        runners["transformers"] = (hf, time_hf)
    samples: dict[str, list[tuple[float, float]]] = {key: [] for key in runners}
    for model, fn in runners.values():  # warm-up (builds kernels and fast layouts)
        fn(model, prompt[:16], 4)
    for _ in track(range(args.repeats), description=f"{name} runs", console=console):
        for key, (model, fn) in runners.items():
            samples[key].append(fn(model, prompt, args.new_tokens))
    results = []
    layers = ours.config.num_layers
    for key, (model, _) in runners.items():
        prefill = statistics.median(s[0] for s in samples[key])
        decode = statistics.median(s[1] for s in samples[key])
        tok_s = (args.new_tokens - 1) / decode
        if key.startswith("llmopt-fast"):
            nbytes = weight_bytes_for(model, int8_head=key.endswith("int8head"))
            ops = 1  # one C++ call: 4 GEMVs per layer + head inside
            kernels = 4 * layers + 1
        else:
            nbytes = eager_decode_bytes(model)
            ops = eager_ops_per_step(model, prompt[:8]) if key == "llmopt-eager" else None
            kernels = ops
        results.append(
            {
                "impl": key,
                "dtype": name,
                "decode_tokens_per_s": tok_s,
                "prefill_tokens_per_s": len(prompt) / prefill,
                "ops_per_step": ops,
                "kernels_per_step": kernels,
                "weight_bytes_per_token": nbytes,
                "roofline_tokens_per_s": bandwidth / nbytes,
                "roofline_fraction": tok_s / (bandwidth / nbytes),
                "achieved_GB_per_s": tok_s * nbytes / 1e9,
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16,int8,int4,auto")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--out", default="runs/decode.json")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from llmopt.data.corpus import load_text
    from llmopt.models.loading import load_model, load_tokenizer, save_pretrained
    from llmopt.peaks import read_bytes_per_s

    torch.set_num_threads(args.threads)
    console = Console()
    bandwidth = read_bytes_per_s(threads=args.threads)
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
        results += run_dtype(args, dtype_name, base, hf_dir, prompt, bandwidth, console)
    hf_fp32 = next(
        (r for r in results if r["impl"] == "transformers" and r["dtype"] == "float32"), None
    )
    for r in results:
        same = next(
            (h for h in results if h["impl"] == "transformers" and h["dtype"] == r["dtype"]), None
        )
        r["speedup_vs_transformers"] = (
            r["decode_tokens_per_s"] / same["decode_tokens_per_s"] if same else None
        )
        r["speedup_vs_transformers_fp32"] = (
            r["decode_tokens_per_s"] / hf_fp32["decode_tokens_per_s"] if hf_fp32 else None
        )

    table = Table(
        title=f"{args.model} batch-1 decode, {args.threads} threads, prompt {len(prompt)}, "
        f"{args.new_tokens} new tokens, median of {args.repeats}"
    )
    for col in ("impl", "dtype", "decode tok/s", "prefill tok/s", "ops/step", "MB/token",
                "GB/s", "roofline tok/s", "of roofline", "vs HF same dtype", "vs HF fp32"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in results:
        speedup, vs32 = r["speedup_vs_transformers"], r["speedup_vs_transformers_fp32"]
        table.add_row(
            r["impl"],
            r["dtype"],
            f"{r['decode_tokens_per_s']:.1f}",
            f"{r['prefill_tokens_per_s']:.0f}",
            str(r["ops_per_step"] or "-"),
            f"{r['weight_bytes_per_token'] / 1e6:.0f}",
            f"{r['achieved_GB_per_s']:.1f}",
            f"{r['roofline_tokens_per_s']:.1f}",
            f"{100 * r['roofline_fraction']:.0f}%",
            f"{speedup:.2f}x" if speedup else "-",
            f"{vs32:.2f}x" if vs32 else "-",
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
