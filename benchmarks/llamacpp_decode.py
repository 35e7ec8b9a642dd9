"""Batch-1 decode race on one GGUF: llmopt's fast paths vs llama.cpp Q4_1 vs transformers fp32.

llama.cpp (llama-cpp-python) runs the packaged SmolLM2-135M Q4_1 GGUF as is (Q4_1 blocks of 32,
Q8_0 tied head). llmopt loads the same file (dequantised) and decodes with `llmopt.infer.fast`
(one C++ call per token) in fp32, bf16, and RTN INT4 g128 with the head in fp32 and as INT8;
transformers decodes the same dequantised fp32 weights. Same prompt, same number of new tokens,
same thread count; every repetition runs each side once in turn and the median is kept, so a
shared machine slows every side alike. Decode excludes prefill on every side. Bytes per token
are the weights one step reads (llama.cpp: every tensor of the file once, the Q8_0 embedding as
the head); the roofline is the measured streaming-read bandwidth at that thread count.

    python benchmarks/llamacpp_decode.py --threads 1,2 --out runs/llamacpp_decode.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def time_llamacpp(llm: Any, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds, seconds for new_tokens - 1 greedy decode steps)."""
    from _llamacpp import last_logits

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t0
    token = int(last_logits(llm).argmax())
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = int(last_logits(llm).argmax())
    return prefill, time.perf_counter() - t0


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor in a GGUF file (what one llama.cpp decode step reads, tied head
    included: the embedding is read whole as the output matrix)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers fp32")
    parser.add_argument(
        "--llamacpp-extra-bufts", action="store_true", help="let llama.cpp use AMX/repacking"
    )
    parser.add_argument("--out", default="runs/llamacpp_decode.json")
    args = parser.parse_args()
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads {args.threads!r} must be comma-separated integers")
    if any(t < 1 for t in threads) or args.new_tokens < 2 or args.repeats < 1:
        parser.error("--threads must be >= 1, --new-tokens >= 2, --repeats >= 1")
    from _llamacpp import require_llama_cpp, set_extra_buffers

    llama_cpp = require_llama_cpp()
    set_extra_buffers(args.llamacpp_extra_bufts)
    from decode import (  # this directory is on sys.path
        measure_read_bandwidth,
        time_hf,
        time_ours,
        weight_bytes_per_token,
    )
    from llama_cpp import Llama
    from rich.console import Console
    from rich.table import Table

    from llmopt.artifacts import atomic_write_json
    from llmopt.compress.quant.apply import quantize_model
    from llmopt.data.corpus import load_text
    from llmopt.infer.fast import FastDecoder
    from llmopt.models.loading import load_model, load_tokenizer, save_pretrained
    from llmopt.models.registry import resolve

    console = Console()
    gguf = resolve(args.model)
    tokenizer = load_tokenizer(args.model)
    prompt = tokenizer.encode(load_text("corpus:web-bible", max_chars=20_000))[: args.prompt_tokens]
    fp32 = load_model(args.model)
    models = {
        "fp32": fp32,
        "bf16": load_model(args.model, dtype=torch.bfloat16),
        "int4": quantize_model(fp32, bits=4, group_size=128),
    }
    ours: dict[str, tuple[Any, bool]] = {
        "llmopt-fast fp32": (models["fp32"], False),
        "llmopt-fast bf16": (models["bf16"], False),
        "llmopt-fast int4": (models["int4"], False),
        "llmopt-fast int4+int8head": (models["int4"], True),
    }
    hf = hf_dir = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf_dir = tempfile.TemporaryDirectory()
        save_pretrained(fp32, hf_dir.name)  # the same dequantised weights
        hf = AutoModelForCausalLM.from_pretrained(hf_dir.name, dtype=torch.float32).eval()
    llamacpp_bytes = gguf_tensor_bytes(gguf)
    ctx = len(prompt) + args.new_tokens + 8
    results: list[dict[str, Any]] = []
    load = [list(os.getloadavg())]
    for n in threads:
        torch.set_num_threads(n)
        bandwidth = measure_read_bandwidth(n)
        llm = Llama(
            model_path=str(gguf), n_ctx=ctx, n_threads=n, n_threads_batch=n, n_batch=512,
            verbose=False,
        )  # fmt: skip
        runners: dict[str, Callable[[list[int], int], tuple[float, float]]] = {
            "llama.cpp Q4_1": lambda p, k, llm=llm: time_llamacpp(llm, p, k)
        }
        for key, (model, head8) in ours.items():
            runners[key] = lambda p, k, m=model, h=head8: time_ours(m, p, k, True, h)
        if hf is not None:
            runners["transformers fp32"] = lambda p, k: time_hf(hf, p, k)
        for fn in runners.values():  # warm-up (kernel build, fast layouts)
            fn(prompt[:16], 4)
        samples: dict[str, list[tuple[float, float]]] = {key: [] for key in runners}
        for _ in range(args.repeats):
            for key, fn in runners.items():
                samples[key].append(fn(prompt, args.new_tokens))
        for key in runners:
            decode = statistics.median(s[1] for s in samples[key])
            prefill = statistics.median(s[0] for s in samples[key])
            if key in ours:
                model, head8 = ours[key]
                nbytes = FastDecoder(model, len(prompt) + 1, int8_head=head8).bytes_per_token
            elif key.startswith("llama"):
                nbytes = llamacpp_bytes
            else:
                nbytes = weight_bytes_per_token(fp32)  # the same fp32 weights
            tok_s = (args.new_tokens - 1) / decode
            results.append(
                {
                    "impl": key,
                    "threads": n,
                    "decode_tokens_per_s": tok_s,
                    "prefill_tokens_per_s": len(prompt) / prefill,
                    "decode_s_samples": [s[1] for s in samples[key]],
                    "bytes_per_token": nbytes,
                    "memory_read_bandwidth_GB_per_s": bandwidth / 1e9,
                    "achieved_GB_per_s": tok_s * nbytes / 1e9,
                    "roofline_fraction": tok_s * nbytes / bandwidth,
                }
            )
        del llm
        load.append(list(os.getloadavg()))
    for r in results:
        same = [x for x in results if x["threads"] == r["threads"]]
        ref = next(x for x in same if x["impl"].startswith("llama"))
        r["vs_llamacpp"] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        hf_row = next((x for x in same if x["impl"] == "transformers fp32"), None)
        r["vs_transformers_fp32"] = (
            r["decode_tokens_per_s"] / hf_row["decode_tokens_per_s"] if hf_row else None
        )
    table = Table(
        title=f"{args.model} batch-1 decode vs llama.cpp {llama_cpp.__version__}, prompt "
        f"{len(prompt)}, {args.new_tokens} new tokens, median of {args.repeats}"
    )
    for col in ("impl", "threads", "decode tok/s", "prefill tok/s", "MB/token", "GB/s",
                "of roofline", "vs llama.cpp", "vs HF fp32"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in results:
        vs_hf = r["vs_transformers_fp32"]
        table.add_row(
            r["impl"],
            str(r["threads"]),
            f"{r['decode_tokens_per_s']:.1f}",
            f"{r['prefill_tokens_per_s']:.0f}",
            f"{r['bytes_per_token'] / 1e6:.0f}",
            f"{r['achieved_GB_per_s']:.1f}",
            f"{100 * r['roofline_fraction']:.0f}%",
            f"{r['vs_llamacpp']:.2f}x",
            f"{vs_hf:.2f}x" if vs_hf else "-",
        )
    console.print(table)
    console.print(f"load average (1, 5, 15 min) before and after each thread count: {load}")
    report = {
        "model": args.model,
        "gguf": gguf.name,
        "llama_cpp": llama_cpp.__version__,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "llama_cpp_extra_buffer_types": args.llamacpp_extra_bufts,
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": load,
        "results": results,
    }
    atomic_write_json(args.out, report)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
