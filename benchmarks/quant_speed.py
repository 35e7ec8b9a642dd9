"""Batch-1 decode speed of fp32, bf16, INT8 and INT4 copies of one model, side by side.

All variants run in the same process, interleaved round by round (the machine is shared, so
only ratios within one run are meaningful); each round prefills the same prompt and greedily
decodes `--new-tokens` tokens with a preallocated KV cache through `llmopt.infer.generate`.
The median decode tokens/s over rounds is reported, plus the bytes of the weights read per
token.

    python benchmarks/quant_speed.py --out runs/quant_speed.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _report import run_info, table, write_report

from llmopt.profile.decode_bytes import eager_decode_bytes


def decode_rate(model, prompt: list[int], new_tokens: int) -> float:
    """Decode tokens/s after the prompt (the first token, from the prefill, excluded)."""
    from llmopt.infer.speculative.measure import measure_plain

    return measure_plain(model, prompt, max_new_tokens=new_tokens + 1).decode.rate("wall")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="runs/quant_speed.json")
    args = parser.parse_args(argv)

    from rich.console import Console

    from llmopt.compress.quant.apply import quantize_model
    from llmopt.models.loading import load_model, load_tokenizer

    console = Console()
    base = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    prompt = tokenizer.encode("In the beginning God created the heavens and the earth. Now the")
    variants = {
        "fp32": base,
        "bf16": load_model(args.model, dtype=torch.bfloat16),
        "INT8 per-channel (int8pack)": quantize_model(base, "rtn", 8, -1),
        "INT4 g128 (int4pack)": quantize_model(base, "rtn", 4, 128),
        "INT4 g128 + INT8 lm_head": _int4_with_int8_head(base),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for model in variants.values():  # warm-up: kernel layouts, allocator
        decode_rate(model, prompt, 4)
    for r in range(args.rounds):
        for name, model in variants.items():
            rates[name].append(decode_rate(model, prompt, args.new_tokens))
        console.print(f"round {r + 1}/{args.rounds} done")
    fp32 = statistics.median(rates["fp32"])
    rows, cells = [], []
    for name, model in variants.items():
        med = statistics.median(rates[name])
        wb = eager_decode_bytes(model)
        rows.append({"variant": name, "tok_s": med, "all": rates[name], "weight_bytes": wb})
        cells.append(
            (
                name,
                f"{med:.1f}",
                f"{min(rates[name]):.1f}-{max(rates[name]):.1f}",
                f"{med / fp32:.2f}",
                f"{wb / 2**20:.1f}",
            )
        )
    title = f"Batch-1 greedy decode, {args.model}, {torch.get_num_threads()} threads"
    columns = ("variant", "tok/s (median)", "min-max", "x fp32", "weights MiB")
    console.print(table(title, columns, cells))
    result = {
        "model": args.model,
        **run_info(),
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "rows": rows,
    }
    write_report(console, args.out, result)


def _int4_with_int8_head(base):
    """INT4 g128 body with the (tied, 28M-parameter) LM head as INT8 per-channel."""
    from llmopt.compress.quant.apply import quantize_model
    from llmopt.compress.quant.rtn import rtn_quantize
    from llmopt.compress.quant.targets import replace_with_packed
    from llmopt.models.packed.quant.config import QuantConfig
    from llmopt.models.spec import spec_for

    spec = spec_for(base)
    model = quantize_model(base, "rtn", 4, 128)
    head_cfg = QuantConfig(bits=8, group_size=-1)
    packed = rtn_quantize(spec.top_module(base, "head").weight, 8, -1, False)
    replace_with_packed(model, spec.head, packed, head_cfg)
    return model


if __name__ == "__main__":
    main()
