"""`llmopt merge --base M --adapter DIR --out DIR`: fold LoRA adapters into their base model.

The adapter is a PEFT LoRA directory (ours from a checkpoint's `adapter/`, or one `peft` wrote
for the same architecture); the output is a complete HF directory (weights W + (alpha/r) B A in
fp32, the base's tokenizer, generation config) written aside and renamed into place, so
neither input is ever overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch

from llmopt.train.lora import LoraError, apply_lora, lora_modules, merged_model, read_adapter


def merge_adapter(base: str, adapter: str | Path, out: str | Path) -> Path:
    """Load `base`, apply the adapter's LoRA, fold it in and write the HF directory `out`."""
    from llmopt.models.loading import load_model
    from llmopt.train.export import write_hf

    out = Path(out)
    for source in (Path(adapter), Path(base)):
        if source.exists() and out.resolve() == source.resolve():
            raise LoraError(f"--out {out} is an input; choose a new directory")
    if out.exists() and any(out.iterdir()):
        raise LoraError(f"--out {out} exists and is not empty; choose a new directory")
    settings, tensors = read_adapter(adapter)
    model = load_model(base, dtype=torch.float32)
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
    merged = merged_model(model, tensors)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_hf(merged, partial, base)
    if out.exists():
        out.rmdir()
    os.replace(partial, out)
    return out


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "merge",
        help="fold LoRA adapters into their base model",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--base", required=True, help="base model: packaged name, .gguf, HF dir")
    parser.add_argument("--adapter", required=True, help="PEFT LoRA directory")
    parser.add_argument("--out", required=True, help="new output directory (HF layout)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    out = merge_adapter(args.base, args.adapter, args.out)
    summary = {"out": str(out), "base": args.base, "adapter": str(args.adapter)}
    print(json.dumps(summary) if args.json else f"merged {args.adapter} into {args.base}: {out}")
    return 0
