"""llama.cpp interop: llama-cpp-python loads our GGUF export and decodes greedily like llmopt.

Exports a model (default SmolLM2-135M) with `llmopt.export.export_gguf` in each requested type,
loads the file in llama.cpp (through llama-cpp-python), and compares its greedy tokens with
llmopt's own greedy decode of the same file, prompt by prompt. Exits 1 if F16/Q8_0 disagree.

    python benchmarks/llamacpp_interop.py --types f16 q8_0 q4_0 --out runs/llamacpp_interop.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _report import run_info, table, write_report

PROMPTS = (
    "The capital of France is",
    "In the beginning God created",
    "def fibonacci(n):",
)


def llamacpp_greedy(path: Path, prompt_ids: list[int], n: int, threads: int) -> list[int]:
    """Greedy continuation from llama.cpp, fed our token ids (so tokenizers cannot differ)."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=len(prompt_ids) + n + 8, n_threads=threads, verbose=False)
    out = []
    for token in llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) == n:
            break
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--types", nargs="+", default=["f16", "q8_0", "q4_0"])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/llamacpp_interop.json")
    args = parser.parse_args()

    import torch
    from rich.console import Console

    from llmopt.export.gguf import export_gguf
    from llmopt.infer.generate import generate
    from llmopt.models.loading import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    console = Console()
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in args.types:
            start = time.perf_counter()
            path = export_gguf(model, Path(tmp) / f"{qtype}.gguf", tokenizer, qtype=qtype)
            export_s = time.perf_counter() - start
            ours_model = load_model(path)
            for prompt in PROMPTS:
                ids = tokenizer.encode(prompt)
                ours = generate(ours_model, ids, max_new_tokens=args.tokens)
                theirs = llamacpp_greedy(path, ids, args.tokens, args.threads)
                pairs = zip(ours, theirs, strict=False)
                agree = next((i for i, (a, b) in enumerate(pairs) if a != b), len(ours))
                results.append(
                    {
                        "type": qtype,
                        "prompt": prompt,
                        "ours": ours,
                        "llamacpp": theirs,
                        "identical": ours == theirs,
                        "first_divergence": None if ours == theirs else agree,
                        "file_bytes": path.stat().st_size,
                        "export_s": round(export_s, 2),
                    }
                )
                rows.append(
                    (
                        qtype,
                        prompt,
                        f"{path.stat().st_size / 2**20:.1f}",
                        "yes" if ours == theirs else f"no (at {agree})",
                    )
                )
    console.print(
        table(
            f"llama.cpp greedy vs llmopt, {args.tokens} tokens ({args.model})",
            ["type", "prompt", "MiB", "identical"],
            rows,
        )
    )
    write_report(console, args.out, {"run": run_info(), "args": vars(args), "results": results})
    strict = [r for r in results if r["type"] in ("f16", "q8_0")]
    return 0 if all(r["identical"] for r in strict) else 1


if __name__ == "__main__":
    raise SystemExit(main())
