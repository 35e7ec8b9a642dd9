"""GGUF exports in llama.cpp itself: tokenization, F16 greedy text, and Q4_K_M quality.

For each architecture a tiny random model with a real tokenizer (the vocabularies llama.cpp
ships for its own tokenizer tests, rebuilt by llmopt from `models/ggml-vocab-*.gguf`; Gemma 2
uses the Llama SentencePiece vocabulary, the only Gemma-style one there) plus SmolLM2-135M is
exported to F16 with `export_gguf` and served by `llama-server` (127.0.0.1, `--no-repack`):
- tokenization: `/tokenize` of a multilingual check text (and llama.cpp's pre-tokenizer check
  text) must equal llmopt's ids, with and without BOS;
- greedy: `/completion` from our prompt ids, temperature 0, must produce llmopt's greedy
  tokens on the same F16 weights;
- with `--kl`: SmolLM2 as our `q4_k` and as `llama-quantize F16 -> Q4_K_M` of the same F16
  file: per-tensor types compared, and KL(F16 || quantized) of each on Bible text (llmopt's
  forward on the dequantised weights, identical for both files).
Exit 1 when any tokenization or F16 greedy text differs, or our KL exceeds llama.cpp's by 5%.

    python benchmarks/gguf_llamacpp.py --bin LLAMA_CPP/build/bin --quantize BUILD/bin/llama-quantize \\
        --vocab-dir LLAMA_CPP/models --kl --out runs/gguf_llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _report import run_info, table, write_report

CHECK = (
    "Hello world! Héllo wörld — naïve café, Straße; ¿Qué tal? 1234567 3.14159 $5,000\n"
    "Привет, мир! Καλημέρα κόσμε. 你好，世界！我想在apple工作。こんにちは世界、カタカナ。"
    "안녕하세요 세계. مرحبا بالعالم. नमस्ते दुनिया। שלום עולם. Xin chào thế giới. 🚀🦙✅ "
    "\t tabs\t\tand   spaces   \n\n\ndef f(x):\n    return x**2  # I'm can't we'll 'RE\n"
)
PROMPT = "The capital of France is"
# (name, our architecture, llama.cpp vocabulary file, config changes)
CASES = [
    ("llama (Llama 3 BPE)", "llama", "llama-bpe", {}),
    ("qwen2 (Qwen2 BPE)", "qwen2", "qwen2", {"attention_bias": True, "num_kv_heads": 4}),
    ("qwen3 (Qwen2 BPE)", "qwen3", "qwen2", {"head_dim": 32}),
    ("mistral (Llama 2 SPM)", "mistral", "llama-spm", {"sliding_window": 4096}),
    ("phi3 (Phi-3 SPM)", "phi3", "phi-3", {"sliding_window": 2047}),
    (
        "gemma2 (Llama 2 SPM)",
        "gemma2",
        "llama-spm",
        {
            "head_dim": 32,
            "tie_embeddings": True,
            "sliding_window": 4096,
            "full_attention_every": 2,
            "attn_softcap": 50.0,
            "final_softcap": 30.0,
            "query_pre_attn_scalar": 32,
        },
    ),
]


def vocab_tokenizer(path: Path):
    from gguf import GGUFReader

    from llmopt.models.tokenizer import Tokenizer

    fields = {k: f.contents() for k, f in GGUFReader(path).fields.items()}
    return Tokenizer.from_gguf_metadata({k: v for k, v in fields.items() if k.startswith("tok")})


def tiny_model(arch: str, vocab: int, changes: dict[str, Any], seed: int = 0):
    import torch

    from llmopt.models import ModelConfig, build_model

    shape = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4)
    shape.update(num_kv_heads=2, max_seq_len=512)
    config = ModelConfig(
        name=f"tiny-{arch}", vocab_size=vocab, architecture=arch, **{**shape, **changes}
    )
    model = build_model(config, seed=None)
    model.init_weights(seed=seed, std=0.08)  # peaked enough that greedy choices are not ties
    if config.architecture == "gemma2":
        # Gemma multiplies embeddings by sqrt(hidden): undo it, else the tied head just
        # repeats the input token and greedy text would test nothing
        with torch.no_grad():
            model.embed_tokens.weight.mul_(config.hidden_size**-0.5)
    return model.eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def llama_server(binary: Path, model: Path, threads: int, timeout: float = 180.0):
    """A llama-server on a free loopback port; yields a JSON POST function."""
    port = free_port()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--no-repack", "-t", str(threads), "-c", "512", "-np", "1", "--no-webui"]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def post(path: str, payload: dict) -> dict:
        request = urllib.request.Request(
            base + path, json.dumps(payload).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-1500:]
                raise RuntimeError(f"llama-server exited ({proc.returncode}) on {model}:\n{tail}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not come up within {timeout:.0f}s")
            time.sleep(0.5)
        yield post
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def f16_rounded(model):
    """Our model with every weight rounded to fp16 and back: the F16 file's weights."""
    import copy

    import torch

    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(p.half().float())
    return out


def check_case(name, model, tokenizer, path, args) -> dict:
    from llmopt.export.gguf.pretokenizers import CHECK_TEXT
    from llmopt.infer.generate import generate

    result: dict[str, Any] = {"case": name, "file_bytes": path.stat().st_size}
    with llama_server(args.bin / "llama-server", path, args.threads) as post:
        for label, text in (("multilingual", CHECK), ("llama.cpp check text", CHECK_TEXT)):
            for bos in (False, True):
                theirs = post("/tokenize", {"content": text, "add_special": bos})["tokens"]
                ours = tokenizer.encode(text, add_bos=bos and tokenizer.add_bos)
                result[f"tokens {label}{' +BOS' if bos else ''}"] = {
                    "equal": ours == theirs,
                    "n": len(ours),
                    "first_diff": next(
                        (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                        None if len(ours) == len(theirs) else min(len(ours), len(theirs)),
                    ),
                }
        prompt = tokenizer.encode(PROMPT, add_bos=tokenizer.add_bos)
        reply = post(
            "/completion",
            {
                "prompt": prompt,
                "n_predict": args.tokens,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "ignore_eos": True,
                "return_tokens": True,
            },
        )
    ours = generate(f16_rounded(model), prompt, max_new_tokens=args.tokens, fast=False)
    theirs = reply["tokens"]
    result["greedy"] = {
        "equal": ours == theirs,
        "ours": ours,
        "llamacpp": theirs,
        "equal_prefix": next(
            (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours)
        ),
        "text_ours": tokenizer.decode(ours),
        "text_llamacpp": reply.get("content"),
    }
    return result


def kl_comparison(model, tokenizer, f16: Path, tmp: Path, args) -> dict:
    """Our q4_k vs llama-quantize's Q4_K_M of the same F16 file: types and KL(F16 || q)."""
    from gguf import GGUFReader

    from llmopt.data.corpus import load_text
    from llmopt.eval.kl import kl_divergence
    from llmopt.export import export_gguf
    from llmopt.models.loading import load_model

    ours_path = export_gguf(model, tmp / "ours-q4_k.gguf", tokenizer, qtype="q4_k")
    theirs_path = tmp / "llamacpp-Q4_K_M.gguf"
    done = subprocess.run(
        [str(args.quantize), str(f16), str(theirs_path), "Q4_K_M", str(args.threads)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode:
        raise RuntimeError(f"llama-quantize failed: {done.stderr[-1500:]}")
    types = [
        {t.name: t.tensor_type.name for t in GGUFReader(p).tensors}
        for p in (ours_path, theirs_path)
    ]
    differ = sorted(n for n in types[1] if types[0].get(n) != types[1][n])
    text = load_text("corpus:web-bible")[: args.kl_chars]
    ids = tokenizer.encode(text)[: args.kl_tokens]
    ref = load_model(f16)
    out: dict[str, Any] = {
        "tensors": len(types[1]),
        "type_mismatches": differ,
        "type_counts": {
            label: {k: list(t.values()).count(k) for k in sorted(set(t.values()))}
            for label, t in zip(("ours", "llama.cpp"), types)
        },
        "tokens": len(ids),
    }
    for label, path in (("ours q4_k", ours_path), ("llama.cpp Q4_K_M", theirs_path)):
        r = kl_divergence(load_model(path), ref, ids, ctx=512)
        out[label] = {
            "kl_mean": r.mean,
            "kl_p99": r.p99,
            "top1": r.top1_agreement,
            "ppl": r.ppl,
            "ref_ppl": r.ref_ppl,
            "file_bytes": path.stat().st_size,
        }
    out["kl_ratio"] = out["ours q4_k"]["kl_mean"] / out["llama.cpp Q4_K_M"]["kl_mean"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", type=Path, required=True, help="llama.cpp's build/bin")
    parser.add_argument("--vocab-dir", type=Path, required=True, help="llama.cpp's models/")
    parser.add_argument("--quantize", type=Path, help="llama-quantize (for --kl)")
    parser.add_argument("--kl", action="store_true", help="SmolLM2 q4_k vs llama.cpp Q4_K_M")
    parser.add_argument("--kl-tokens", type=int, default=4096)
    parser.add_argument("--kl-chars", type=int, default=40_000)
    parser.add_argument("--cases", nargs="*", help="only these architectures (and smollm2)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/gguf_llamacpp.json")
    args = parser.parse_args()
    if not (args.bin / "llama-server").is_file():
        parser.error(f"no llama-server in {args.bin}")
    if args.kl and (args.quantize is None or not args.quantize.is_file()):
        parser.error("--kl needs --quantize PATH/llama-quantize")

    import torch
    from rich.console import Console

    from llmopt.export import export_gguf
    from llmopt.models.loading import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    console = Console()
    results, kl = [], None
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name, arch, vocab, changes in CASES:
            if args.cases and arch not in args.cases:
                continue
            tokenizer = vocab_tokenizer(args.vocab_dir / f"ggml-vocab-{vocab}.gguf")
            model = tiny_model(arch, tokenizer.vocab_size, changes)
            path = export_gguf(model, tmp / f"{arch}.gguf", tokenizer, qtype="f16")
            results.append(check_case(name, model, tokenizer, path, args))
            path.unlink()
        model, tokenizer = load_model("smollm2-135m"), load_tokenizer("smollm2-135m")
        f16 = export_gguf(model, tmp / "smollm2-f16.gguf", tokenizer, qtype="f16")
        results.append(check_case("SmolLM2-135M (real)", model, tokenizer, f16, args))
        if args.kl:
            kl = kl_comparison(model, tokenizer, f16, tmp, args)
    rows = []
    for r in results:
        tok = [v for k, v in r.items() if k.startswith("tokens")]
        rows.append(
            (
                r["case"],
                f"{sum(t['equal'] for t in tok)}/{len(tok)}",
                str(sum(t["n"] for t in tok)),
                f"{r['greedy']['equal_prefix']}/{args.tokens}",
                "yes" if r["greedy"]["equal"] else "no",
            )
        )
    console.print(
        table(
            "llama.cpp (llama-server) reading llmopt's F16 GGUF exports",
            ["model", "tokenizations equal", "ids compared", "greedy equal prefix", "identical"],
            rows,
        )
    )
    ok = all(r["greedy"]["equal"] for r in results) and all(
        v["equal"] for r in results for k, v in r.items() if k.startswith("tokens")
    )
    if kl is not None:
        console.print(
            table(
                f"SmolLM2-135M Q4_K_M: KL(F16 || quantized), {kl['tokens']} Bible tokens, ctx 512",
                ["file", "MiB", "KL mean", "KL p99", "top-1 agree", "ppl (F16)"],
                [
                    (
                        label,
                        f"{kl[label]['file_bytes'] / 2**20:.1f}",
                        f"{kl[label]['kl_mean']:.4f}",
                        f"{kl[label]['kl_p99']:.3f}",
                        f"{kl[label]['top1']:.3f}",
                        f"{kl[label]['ppl']:.2f} ({kl[label]['ref_ppl']:.2f})",
                    )
                    for label in ("ours q4_k", "llama.cpp Q4_K_M")
                ],
            )
        )
        console.print(
            f"tensor types differing from llama-quantize: {len(kl['type_mismatches'])} of "
            f"{kl['tensors']}; KL ratio ours / llama.cpp = {kl['kl_ratio']:.3f}"
        )
        ok = ok and kl["kl_ratio"] <= 1.05
    report = {"run": run_info(), "args": {k: str(v) for k, v in vars(args).items()}}
    write_report(console, args.out, {**report, "results": results, "q4_k_m": kl})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
