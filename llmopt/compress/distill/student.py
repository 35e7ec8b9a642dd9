"""Students made from the teacher ("prune, then distil", Minitron-style), or from a config.

Spec grammar (`llmopt distill --student ...`):

- `init:teacher-layers=0,1,29` — the teacher's blocks 0, 1 and 29 in that order (ranges:
  `0-3,29`), with its embedding, final norm and head: depth pruning;
- `.../ffn=1024` appended (`init:teacher-layers=0-3,29/ffn=1024`) also keeps, in every kept
  block, the 1024 FFN channels of largest weight importance ‖W_in[j,:]‖·‖W_out[:,j]‖ (all
  input projections, e.g. gate and up, multiplied): width pruning of the MLP;
- `config:FILE.json` — a fresh, randomly initialised model of that `ModelConfig` (its
  vocabulary must be the teacher's);
- anything else is a model spec (`load_model`: a name, .gguf, a directory, e.g. a pruned one)
  used as the starting student.

Module names come from `spec_for(model)`, never from Llama's attribute names.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from llmopt.compress.distill.objective import DistillConfigError
from llmopt.models.config import ModelConfig
from llmopt.models.llama import Transformer, build_model
from llmopt.models.spec import spec_for

STUDENT_SPECS = (
    "init:teacher-layers=I,J,... (ranges A-B) [/ffn=N], config:FILE.json, or a model spec"
)


def parse_layers(text: str, num_layers: int) -> list[int]:
    """'0-3,29' -> [0, 1, 2, 3, 29]; each index in [0, num_layers), no repeats."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if b < a:
                    raise ValueError
                out.extend(range(a, b + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise DistillConfigError(
                f"teacher-layers={text!r}: {part!r} is not a layer index or range A-B (A<=B)"
            ) from None
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise DistillConfigError(
            f"teacher-layers={text!r}: layer {bad[0]} is outside [0, {num_layers - 1}] "
            f"(the teacher has {num_layers} layers)"
        )
    if len(set(out)) != len(out):
        raise DistillConfigError(f"teacher-layers={text!r} repeats a layer")
    return out


def _options(spec: str) -> dict[str, str]:
    body = spec[len("init:") :]
    opts: dict[str, str] = {}
    for item in body.split("/"):
        key, sep, value = item.partition("=")
        if not sep or not value.strip():
            raise DistillConfigError(
                f"student {spec!r}: {item!r} is not KEY=VALUE; {STUDENT_SPECS}"
            )
        opts[key.strip()] = value.strip()
    unknown = sorted(set(opts) - {"teacher-layers", "ffn"})
    if unknown:
        raise DistillConfigError(
            f"student {spec!r}: unknown option {unknown[0]!r}; valid: teacher-layers, ffn"
        )
    if "teacher-layers" not in opts:
        raise DistillConfigError(f"student {spec!r} needs teacher-layers=...; {STUDENT_SPECS}")
    return opts


@torch.no_grad()
def drop_layers(teacher: Transformer, layers: list[int]) -> Transformer:
    """A copy of the teacher keeping only `layers` (its blocks, re-indexed in order)."""
    spec = spec_for(teacher)
    student = copy.deepcopy(teacher)
    blocks = spec.blocks_of(student)
    kept = nn.ModuleList(blocks[i] for i in layers)
    for new_index, block in enumerate(kept):
        attention = spec.block_module(block, spec.attention)
        if attention is not None and hasattr(attention, "layer_idx"):
            attention.layer_idx = new_index
    setattr(student, spec.blocks, kept)
    student.config = teacher.config.replace(num_layers=len(layers))
    return student


def _ffn_linears(spec, block: nn.Module) -> tuple[list[nn.Linear], list[nn.Linear]]:
    prefix = spec.feed_forward + "."
    ins = [spec.block_module(block, n) for n in spec.column_parallel if n.startswith(prefix)]
    outs = [spec.block_module(block, n) for n in spec.row_parallel if n.startswith(prefix)]
    return [m for m in ins if m is not None], [m for m in outs if m is not None]


@torch.no_grad()
def prune_ffn(model: Transformer, width: int) -> Transformer:
    """Keep the `width` most important FFN channels of every block (in place; returned)."""
    spec = spec_for(model)
    current = model.config.intermediate_size
    if not 1 <= width <= current:
        raise DistillConfigError(f"ffn={width} must be in [1, {current}] (the teacher's FFN width)")
    for block in spec.blocks_of(model):
        ins, outs = _ffn_linears(spec, block)
        if not ins or not outs:
            raise DistillConfigError("ffn=: this architecture's spec names no FFN projections")
        score = torch.ones(current, dtype=torch.float64)
        for lin in ins:
            score *= lin.weight.double().norm(dim=1)
        for lin in outs:
            score *= lin.weight.double().norm(dim=0)
        keep = torch.sort(torch.topk(score, width).indices).values
        for lin in ins:
            lin.weight = nn.Parameter(lin.weight[keep].clone())
            if lin.bias is not None:
                lin.bias = nn.Parameter(lin.bias[keep].clone())
            lin.out_features = width
        for lin in outs:
            lin.weight = nn.Parameter(lin.weight[:, keep].clone())
            lin.in_features = width
    model.config = model.config.replace(intermediate_size=width)
    return model


def make_student(spec: str, teacher: Transformer, *, seed: int = 0) -> Transformer:
    """The starting student for `spec` (see the module doc), in fp32, on the teacher's device."""
    spec = spec.strip()
    if not spec:
        raise DistillConfigError(f"empty student spec; valid: {STUDENT_SPECS}")
    device = next(teacher.parameters()).device
    if spec.startswith("init:"):
        opts = _options(spec)
        student = drop_layers(
            teacher, parse_layers(opts["teacher-layers"], teacher.config.num_layers)
        )
        if "ffn" in opts:
            try:
                width = int(opts["ffn"])
            except ValueError:
                raise DistillConfigError(f"ffn={opts['ffn']!r} must be an integer") from None
            prune_ffn(student, width)
        return student.float()
    if spec.startswith("config:"):
        path = Path(spec[len("config:") :])
        if not path.is_file():
            raise DistillConfigError(f"student config {str(path)!r} does not exist")
        try:
            config = ModelConfig.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            raise DistillConfigError(f"student config {str(path)!r}: {exc}") from exc
        student = build_model(config, seed=seed, device=device)
    elif (Path(spec) / "llmopt_prune.json").is_file():  # recover a pruned model: dense linears
        from llmopt.compress.prune import load_pruned
        from llmopt.models.packed.metadata import set_compression_metadata

        student = load_pruned(spec, packed=False, device=device)
        set_compression_metadata(student, None)
    else:
        from llmopt.models.loading import load_model

        student = load_model(spec, dtype=torch.float32, device=device)
    if student.config.vocab_size != teacher.config.vocab_size:
        raise DistillConfigError(
            f"student {spec!r} has a vocabulary of {student.config.vocab_size} tokens, the "
            f"teacher {teacher.config.vocab_size}: distillation needs the teacher's vocabulary"
        )
    return student
