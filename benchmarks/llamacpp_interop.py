"""llama.cpp interop: llama-cpp-python loads our GGUF export and decodes greedily like llmopt.

Exports a model (default SmolLM2-135M) with `llmopt.export.export_gguf` in each requested type,
loads the file in llama.cpp (through llama-cpp-python), and compares, prompt by prompt, its
greedy tokens (fed our token ids, so tokenizers cannot differ) with llmopt's own greedy decode
of the same file, and the logits both give at the prompt's last position. A file llama.cpp
refuses is reported as not loaded with its error. Exits 1 if a file does not load or F16 disagrees.

    python benchmarks/llamacpp_interop.py --types f16 q8_0 q4_0 q4_1 q4_k \\
        --out runs/llamacpp_interop.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import run_info, table, write_report

PROMPTS = (
    "The capital of France is",
    "In the beginning God created",
    "def fibonacci(n):",
)


def llamacpp_greedy(llm: Any, prompt_ids: list[int], n: int) -> tuple[list[int], Any]:
    """(n greedy tokens, logits at the prompt's last position) from a loaded llama.cpp model."""
    from _llamacpp import last_logits

    llm.reset()
    llm.eval(prompt_ids)
    first = last_logits(llm)
    out = [int(first.argmax())]
    while len(out) < n:
        llm.eval([out[-1]])
        out.append(int(last_logits(llm).argmax()))
    return out, first


def load_llamacpp(path: Path, n_ctx: int, threads: int) -> tuple[Any, str | None]:
    """(Llama or None, the error llama.cpp gave when it refused the file)."""
    from llama_cpp import Llama

    try:
        return Llama(str(path), n_ctx=n_ctx, n_threads=threads, verbose=False), None
    except (ValueError, RuntimeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--types", nargs="+", default=["f16", "q8_0", "q4_0", "q4_1", "q4_k"])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/llamacpp_interop.json")
    parser.add_argument(
        "--llamacpp-extra-bufts", action="store_true", help="let llama.cpp use AMX/repacking"
    )
    args = parser.parse_args()
    if args.tokens < 1 or args.threads < 1:
        parser.error("--tokens and --threads must be >= 1")
    from _llamacpp import require_llama_cpp, set_extra_buffers

    llama_cpp = require_llama_cpp()
    set_extra_buffers(args.llamacpp_extra_bufts)

    import torch
    from rich.console import Console

    from llmopt.export.gguf import export_gguf
    from llmopt.infer.generate import generate
    from llmopt.models.loading import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    console = Console()
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    n_ctx = max(len(ids) for ids in prompts) + args.tokens + 8
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in args.types:
            start = time.perf_counter()
            path = export_gguf(model, Path(tmp) / f"{qtype}.gguf", tokenizer, qtype=qtype)
            export_s = time.perf_counter() - start
            mib = f"{path.stat().st_size / 2**20:.1f}"
            llm, error = load_llamacpp(path, n_ctx, args.threads)
            if llm is None:
                results.append({"type": qtype, "loads": False, "error": error})
                rows.append((qtype, mib, "no", "-", "-", "-", error[:60]))
                continue
            ours_model = load_model(path)
            for prompt, ids in zip(PROMPTS, prompts, strict=True):
                ours = generate(ours_model, ids, max_new_tokens=args.tokens, fast=False)
                with torch.inference_mode():
                    ours_logits = ours_model(torch.tensor([ids]), last_only=True)[0, -1]
                theirs, their_logits = llamacpp_greedy(llm, ids, args.tokens)
                equal = next(
                    (i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b),
                    len(ours),
                )
                diff = float((ours_logits - torch.from_numpy(their_logits)).abs().max())
                results.append(
                    {
                        "type": qtype,
                        "loads": True,
                        "prompt": prompt,
                        "ours": ours,
                        "llamacpp": theirs,
                        "greedy_equal_prefix": equal,
                        "identical": ours == theirs,
                        "max_abs_logit_diff": diff,
                        "logit_scale": float(ours_logits.abs().max()),
                        "file_bytes": path.stat().st_size,
                        "export_s": round(export_s, 2),
                    }
                )
                rows.append(
                    (qtype, mib, "yes", prompt, f"{equal}/{args.tokens}", f"{diff:.3g}", "")
                )
            del llm
    console.print(
        table(
            f"llama.cpp {llama_cpp.__version__} greedy vs llmopt, {args.tokens} tokens "
            f"({args.model})",
            ["type", "MiB", "loads", "prompt", "greedy equal", "max |logit diff|", "error"],
            rows,
        )
    )
    report = {"run": run_info(), "llama_cpp": llama_cpp.__version__, "args": vars(args)}
    write_report(console, args.out, {**report, "results": results})
    # F16 must decode identically; quantized types only must load (llama.cpp rounds activations
    # to 8 bits in its Q8_0/Q4 dot products, llmopt keeps them fp32, so near-ties may flip)
    strict = [r for r in results if r["type"] == "f16"]
    loaded = all(r["loads"] for r in results)
    return 0 if loaded and (not strict or all(r["identical"] for r in strict)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
