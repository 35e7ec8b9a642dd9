"""Batch-1 decode race: llmopt's fast INT4 path vs llama.cpp (llama-cpp-python) on one GGUF.

llama.cpp runs the packaged SmolLM2-135M Q4_1 GGUF as is (Q4_1 blocks of 32, Q8_0 tied
head). llmopt loads the same file (dequantised), quantizes it RTN INT4 g128 and decodes with
`llmopt.infer.fast` (fused layout, one C++ call per token), with the head in fp32 and as INT8.
Same prompt, same number of new tokens, same thread count; runs are interleaved and the median
kept, so a shared machine slows every side alike. Decode excludes prefill on both sides.

    python benchmarks/llamacpp_decode.py --threads 1,2 --out runs/llamacpp_decode.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def time_llamacpp(llm, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, seconds for new_tokens - 1 greedy decode steps)."""
    import numpy as np

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t0
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return prefill, time.perf_counter() - t0


def time_fast(model, prompt: list[int], new_tokens: int, int8_head: bool) -> tuple[float, float]:
    from llmopt.infer.generate import generate

    stats: dict = {}
    generate(model, prompt, max_new_tokens=new_tokens, fast=True, int8_head=int8_head, stats=stats)
    assert stats["path"] == "fast" and stats["decode_tokens"] == new_tokens - 1
    return stats["prefill_s"], stats["decode_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/llamacpp_decode.json")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if any(t < 1 for t in threads) or args.new_tokens < 2 or args.repeats < 1:
        raise SystemExit("--threads must be >= 1, --new-tokens >= 2, --repeats >= 1")
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit(
            "llama-cpp-python is not installed: pip install -c constraints.txt llama-cpp-python"
        ) from None
    from decode import measure_read_bandwidth  # this directory is on sys.path
    from rich.console import Console
    from rich.table import Table

    from llmopt.artifacts import atomic_write_json
    from llmopt.compress.quant.apply import quantize_model
    from llmopt.data.corpus import load_text
    from llmopt.infer.fast import FastDecoder
    from llmopt.models.loading import load_model, load_tokenizer
    from llmopt.models.registry import resolve

    console = Console()
    gguf = resolve(args.model)
    tokenizer = load_tokenizer(args.model)
    prompt = tokenizer.encode(load_text("corpus:web-bible", max_chars=20_000))[: args.prompt_tokens]
    q4 = quantize_model(load_model(args.model), bits=4, group_size=128)
    ctx = len(prompt) + args.new_tokens + 8
    results = []
    for n in threads:
        torch.set_num_threads(n)
        bandwidth = measure_read_bandwidth(n)
        llm = Llama(model_path=str(gguf), n_ctx=ctx, n_threads=n, n_batch=512, verbose=False)
        runners = {
            "llama.cpp Q4_1": lambda p, k, llm=llm: time_llamacpp(llm, p, k),
            "llmopt-fast int4": lambda p, k: time_fast(q4, p, k, False),
            "llmopt-fast int4+int8head": lambda p, k: time_fast(q4, p, k, True),
        }
        for fn in runners.values():  # warm-up
            fn(prompt[:16], 4)
        samples: dict[str, list] = {key: [] for key in runners}
        for _ in range(args.repeats):
            for key, fn in runners.items():
                samples[key].append(fn(prompt, args.new_tokens))
        for key in runners:
            decode = statistics.median(s[1] for s in samples[key])
            prefill = statistics.median(s[0] for s in samples[key])
            if key.startswith("llama"):
                nbytes = gguf.stat().st_size  # every tensor once (the Q8_0 head included)
            else:
                dec = FastDecoder(q4, len(prompt) + 1, int8_head=key.endswith("int8head"))
                nbytes = dec.bytes_per_token
            tok_s = (args.new_tokens - 1) / decode
            results.append(
                {
                    "impl": key,
                    "threads": n,
                    "decode_tokens_per_s": tok_s,
                    "prefill_tokens_per_s": len(prompt) / prefill,
                    "bytes_per_token": nbytes,
                    "memory_read_bandwidth_GB_per_s": bandwidth / 1e9,
                    "roofline_fraction": tok_s * nbytes / bandwidth,
                }
            )
        del llm
    for r in results:
        ref = next(
            x for x in results if x["threads"] == r["threads"] and x["impl"].startswith("llama")
        )
        r["vs_llamacpp"] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
    table = Table(
        title=f"{args.model} batch-1 decode vs llama.cpp, prompt {len(prompt)}, "
        f"{args.new_tokens} new tokens, median of {args.repeats}"
    )
    for col in ("impl", "threads", "decode tok/s", "prefill tok/s", "MB/token", "of roofline",
                "vs llama.cpp"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r["impl"],
            str(r["threads"]),
            f"{r['decode_tokens_per_s']:.1f}",
            f"{r['prefill_tokens_per_s']:.0f}",
            f"{r['bytes_per_token'] / 1e6:.0f}",
            f"{100 * r['roofline_fraction']:.0f}%",
            f"{r['vs_llamacpp']:.2f}x",
        )
    console.print(table)
    report = {
        "model": args.model,
        "gguf": gguf.name,
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "results": results,
    }
    atomic_write_json(args.out, report)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
