"""`llmopt generate`: text generation from the command line (thin layer over `generate`)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from llmopt import cli_args, jsonout
from llmopt.dtypes import DTYPES


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text with a model (KV cache, sampling, --draft)",
        description="Generate a continuation of --prompt (or a chat reply with --chat). Greedy by "
        "default; --temperature > 0 samples (with --top-k/--top-p, reproducible with --seed).",
    )
    add_model_arguments(parser, dtype="auto")
    parser.add_argument(
        "--prompt", required=True, help="prompt text (the user message with --chat)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (1 = off)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    parser.add_argument("--system", default=None, help="system message for --chat")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token"
    )
    parser.add_argument(
        "--no-stream", action="store_true", help="print the text at the end, not token by token"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (no stream)")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="decode with the eager model instead of the fast C++ decode step (the default "
        "where its kernels build)",
    )
    parser.add_argument(
        "--int8-head",
        action="store_true",
        help="fast path: read the output head as per-row INT8 (4x fewer bytes, not exact)",
    )
    try:
        from llmopt.infer.speculative import add_speculative_arguments
    except ImportError:  # speculative decoding is optional for plain generation
        pass
    else:
        add_speculative_arguments(parser)
    parser.set_defaults(func=run, check=check_args)


def check_model_args(args: argparse.Namespace) -> None:
    """--model/--threads (shared with eval and profile): `--threads 0` is not "the default"."""
    cli_args.text(args, "model")
    cli_args.integer(args, "threads", 1)


def check_args(args: argparse.Namespace) -> None:
    """Everything `generate` can refuse before loading a model."""
    from llmopt.infer.sampling import SamplingParams

    check_model_args(args)
    cli_args.text(args, "prompt", empty=True)
    cli_args.text(args, "system", empty=True)
    cli_args.integer(args, "max_new_tokens", 0)
    cli_args.number(args, "temperature", 0.0)
    cli_args.number(args, "top_p", 0.0, 1.0, above=True)
    cli_args.integer(args, "top_k", 0)
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.system is not None and not args.chat:
        raise cli_args.ArgumentError("--system only applies with --chat")
    if args.eager and args.int8_head:
        raise cli_args.ArgumentError("--int8-head applies to the fast decode path; drop --eager")
    if getattr(args, "draft", None) is not None:
        cli_args.text(args, "draft")
        cli_args.integer(args, "gamma", 1)


def add_model_arguments(parser: argparse.ArgumentParser, dtype: str = "float32") -> None:
    """--model/--dtype/--threads, shared with `llmopt eval` and `profile` (float32 by default);
    `generate` defaults to auto (a quantized GGUF's blocks as the file holds them)."""
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="packaged name (smollm2-135m), .gguf file, HF directory or `llmopt quantize` output",
    )
    cli_args.add_dtype(
        parser,
        default=dtype,
        choices=cli_args.LOAD_DTYPES if dtype == "auto" else DTYPES,
        help="weight/compute dtype"
        + (
            "; auto keeps a quantized GGUF's blocks as the file holds them"
            if dtype == "auto"
            else ""
        ),
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


class TextStream:
    """Prints decoded text as tokens arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer, out=None) -> None:
        self.tokenizer = tokenizer
        self.out = out or sys.stdout  # looked up now: sys.stdout may be swapped after import
        self.ids: list[int] = []
        self.printed = ""

    def __call__(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens
            return
        self.out.write(text[len(self.printed) :])
        self.out.flush()
        self.printed = text


def decode_rates(timing: dict[str, Any]) -> dict[str, Any]:
    """JSON fields from `generate(stats=...)`: path, prefill and decode (prefill excluded) rates."""
    prefill_s, decode_s = timing["prefill_s"], timing["decode_s"]
    decoded = timing["decode_tokens"]
    return {
        "decode_path": timing["path"],
        "fallback_reason": timing["fallback_reason"],
        "prefill_s": round(prefill_s, 6),
        "prefill_tokens_per_s": round(timing["prefill_tokens"] / prefill_s, 2)
        if prefill_s > 0
        else None,
        "decode_s": round(decode_s, 6),
        "decode_tokens_per_s": round(decoded / decode_s, 2) if decoded and decode_s > 0 else None,
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from llmopt.infer.generate import generate
    from llmopt.infer.sampling import SamplingParams
    from llmopt.models.loading import load_model, load_tokenizer

    check_args(args)  # also run by `llmopt.cli.main`; here for callers of run() itself
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=cli_args.load_dtype(args.dtype))
    load_s = time.perf_counter() - t0
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt_text = tokenizer.apply_chat_template(messages)
    else:
        prompt_text = args.prompt
    prompt_ids = tokenizer.encode(prompt_text, add_bos=tokenizer.add_bos)
    eos = None if args.ignore_eos else tokenizer.eos_token_ids  # generation_config's list
    speculative = getattr(args, "draft", None)
    stream = None if args.json or args.no_stream or speculative else TextStream(tokenizer)
    t0 = time.perf_counter()
    stats: dict[str, Any] = {}
    timing: dict[str, Any] = {}
    if speculative:
        from llmopt.infer.speculative import run_speculative_from_args

        ids, stats = run_speculative_from_args(args, model, tokenizer, prompt_ids, sampling)
    else:
        ids = generate(
            model,
            prompt_ids,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            seed=args.seed,
            eos_token_id=eos,
            on_token=stream,
            fast=False if args.eager else None,
            int8_head=args.int8_head,
            stats=timing,
        )
    seconds = time.perf_counter() - t0
    text = tokenizer.decode(ids, skip_special_tokens=True)
    stopped = "eos" if eos and ids and ids[-1] in eos else "length"
    if args.json:
        result: dict[str, Any] = {
            "model": args.model,
            "prompt": prompt_text,
            "prompt_tokens": len(prompt_ids),
            "text": text,
            "token_ids": ids,
            "new_tokens": len(ids),
            "stop_reason": stopped,
            "load_s": round(load_s, 3),
            "generate_s": round(seconds, 3),
            "tokens_per_s": round(len(ids) / seconds, 2) if seconds > 0 else None,
        }
        if timing:
            result.update(decode_rates(timing))
        if stats:
            result["speculative"] = stats
        print(jsonout.dumps(result, indent=2))
        return 0
    if stream is None:
        sys.stdout.write(text)
    sys.stdout.write("\n")
    rate = f"{len(ids) / seconds:.1f} tok/s" if seconds > 0 else "n/a"
    if timing and timing["decode_tokens"] and timing["decode_s"] > 0:
        rate += (
            f" (decode {timing['decode_tokens'] / timing['decode_s']:.1f} tok/s {timing['path']})"
        )
    print(
        f"[{len(prompt_ids)} prompt + {len(ids)} new tokens, {rate}, stop: {stopped}, "
        f"load {load_s:.1f}s]",
        file=sys.stderr,
    )
    if stats:
        print(jsonout.dumps(stats, indent=2), file=sys.stderr)
    return 0
