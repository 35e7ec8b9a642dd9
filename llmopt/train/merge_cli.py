"""`llmopt merge --base M --adapter DIR --out DIR`: fold LoRA adapters into their base model.

The adapter is a PEFT LoRA directory (ours from a checkpoint's `adapter/`, or one `peft` wrote
for the same architecture); the output is a complete HF directory (weights W + (alpha/r) B A in
fp32, the base's tokenizer, generation config) built in a hidden sibling and moved into place
(`llmopt.output_dir`), so neither input, nor a file of the user's in `--out`, is ever
overwritten or deleted. An adapter llmopt trained records a fingerprint of its base's weights:
a base of the same shape but other weights is refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from llmopt.train.lora import (
    LoraError,
    apply_lora,
    check_base,
    lora_modules,
    merged_model,
    read_adapter,
)

KIND = "merge"  # llmopt.output_dir


def merge_adapter(
    base: str, adapter: str | Path, out: str | Path, *, overwrite: bool = False, progress=None
) -> Path:
    """Load `base`, apply the adapter's LoRA, fold it in and write the HF directory `out`.
    `progress(message)` is told each step (loading, checking, folding, writing)."""
    from llmopt.artifacts import OutputPathError
    from llmopt.models.loading import load_model
    from llmopt.output_dir import check_output_dir, output_directory
    from llmopt.train.export import write_hf
    from llmopt.train.shapes import check_dense_linears

    say = progress or (lambda message: None)
    out = Path(out)
    for source in (Path(adapter), Path(base)):
        if source.exists():
            src, dst = source.resolve(), out.resolve()
            if dst == src or src in dst.parents or dst in src.parents:
                raise LoraError(
                    f"--out {out} is or holds the input {source}; choose a new directory"
                )
    try:
        check_output_dir(out, KIND, overwrite=overwrite)
    except OutputPathError as exc:
        raise LoraError(str(exc)) from exc
    settings, tensors = read_adapter(adapter)
    say(f"loading the base {base}")
    model = load_model(base, dtype=torch.float32)
    check_dense_linears(model, base, "--base", "merging an adapter")
    apply_lora(model, settings)
    expected = {f"{p}.{n}.weight" for p in lora_modules(model) for n in ("lora_A", "lora_B")}
    if set(tensors) != expected:
        extra, missing = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise LoraError(
            f"adapter {adapter} does not fit {base}: {len(missing)} missing tensors "
            f"(e.g. {missing[:1]}), {len(extra)} unexpected (e.g. {extra[:1]})"
        )
    for name, value in tensors.items():
        shape = dict(model.named_parameters())[name].shape
        if value.shape != shape:
            raise LoraError(
                f"adapter tensor {name} has shape {tuple(value.shape)}, not {tuple(shape)}"
            )
    say("checking the base against the adapter's fingerprint")
    if not check_base(adapter, model, base):
        print(
            f"llmopt merge: warning: {adapter} records no base fingerprint (not written by "
            f"llmopt); cannot check that it was trained on {base}",
            file=sys.stderr,
        )
    say(f"folding {len(expected) // 2} adapters into the base")
    merged = merged_model(model, tensors)
    say(f"writing {out}")
    try:
        with output_directory(out, KIND, overwrite=overwrite) as stage:
            write_hf(merged, stage, base)
    except OutputPathError as exc:
        raise LoraError(str(exc)) from exc
    return out


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "merge",
        help="fold LoRA adapters into their base model",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--base", required=True, help="base model: packaged name, .gguf, HF dir")
    parser.add_argument("--adapter", required=True, help="PEFT LoRA directory")
    parser.add_argument("--out", required=True, help="output directory (HF layout)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an --out that holds other files, replacing only the merge's own files",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    def progress(message: str) -> None:
        if not args.json:
            print(f"llmopt merge: {message}", file=sys.stderr, flush=True)

    out = merge_adapter(
        args.base, args.adapter, args.out, overwrite=args.overwrite, progress=progress
    )
    summary = {"out": str(out), "base": args.base, "adapter": str(args.adapter)}
    print(json.dumps(summary) if args.json else f"merged {args.adapter} into {args.base}: {out}")
    return 0
