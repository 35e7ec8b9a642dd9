"""One block-sequential calibration walk that AWQ, GPTQ, SparseGPT and Wanda plug into.

Every calibrated method runs the same loop (as llm-compressor's modifiers share one pipeline):
embed the calibration tokens as the model's forward does, then for each block in order
observe the inputs of some of its linears (hooks on one block forward, cut short once all
were seen), transform the block from what was observed, possibly in several stages (GPTQ's
true-sequential order: each stage observed from a block whose earlier stages are already
transformed), and feed the block's outputs to the next block. A method says only what it
observes per linear and what it does to a block (`BlockMethod`); the walk owns the order,
the hooks, the embedding prologue and the hand-off between blocks, written once here.

The next block reads the transformed block's outputs (GPTQ, SparseGPT, Wanda: each layer
adapts to the errors before it), or with `feed_original` the outputs the block had when it
was first observed (AWQ, as its reference implementation does: its scaling is exact, so only
quantization would differ).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmopt.compress.quant.progress import layer_progress
from llmopt.models.spec import ModelSpec, spec_for


@dataclass
class BlockStep:
    """One block of the walk: where it is, and the calibration inputs it is being fed
    (`x` is None when the method needs no calibration data)."""

    index: int
    name: str  # qualified, e.g. "layers.3"
    block: nn.Module
    x: torch.Tensor | None
    cos: torch.Tensor | None
    sin: torch.Tensor | None


class BlockMethod:
    """What a method plugs into `walk_blocks`; override `stages` and `apply` (and `observe`
    when the raw inputs are not the statistic wanted)."""

    label = "calibrate"  # the progress bar's description
    feed_original = False  # next block reads this block's outputs from before `apply`

    def stages(self, step: BlockStep) -> list[list[str]]:
        """Groups of block-relative linear names, observed and applied one group at a time."""
        raise NotImplementedError

    def observe(self, name: str, inputs: torch.Tensor) -> Any:
        """The statistic kept of linear `name`'s calibration input (default: the input)."""
        return inputs.detach()

    def apply(self, step: BlockStep, stage: list[str], stats: dict[str, Any]) -> None:
        """Transform the block's `stage` linears given their statistics ({} without data)."""
        raise NotImplementedError

    def finish(self, step: BlockStep) -> None:
        """After the next block's inputs were computed from this block (e.g. swap in packed
        layers that calibration should not run through)."""


def sequential_stages(
    spec: ModelSpec, names: list[str], sort_rest: bool = False
) -> list[list[str]]:
    """The spec's `gptq_order` restricted to `names`, then a last stage of the names it does
    not mention (in the given order, or sorted: GPTQ's report order). A `*` in the order
    (an expert container's projection) stands for every expert, so experts are sequential too."""
    stages = [
        [n for pattern in stage for n in names if _matches(pattern, n)] for stage in spec.gptq_order
    ]
    stages = [stage for stage in stages if stage]
    staged = {n for stage in stages for n in stage}
    rest = [n for n in names if n not in staged]
    if sort_rest:
        rest = sorted(rest)
    return stages + ([rest] if rest else [])


def _matches(pattern: str, name: str) -> bool:
    if "*" not in pattern:
        return pattern == name
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name) is not None


class _Captured(Exception):
    """Raised by a hook once every requested input was seen: the rest of the block is skipped."""


def observe_linears(
    block: nn.Module,
    names: list[str],
    x: torch.Tensor,
    cos,
    sin,
    observe: Callable[[str, torch.Tensor], Any],
    full: bool = False,
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """`observe(name, input)` for each named linear from one block forward, and the block's
    output when `full` (else the forward stops once every input was seen, output None)."""
    stats: dict[str, Any] = {}
    hooks = []
    for name in names:

        def hook(_m, args, name=name):
            stats[name] = observe(name, args[0])
            if not full and len(stats) == len(names):
                raise _Captured

        hooks.append(block.get_submodule(name).register_forward_pre_hook(hook))
    out = None
    try:
        out = block(x, cos, sin)
    except _Captured:
        pass
    finally:
        for h in hooks:
            h.remove()
    missing = set(names) - set(stats)
    if missing:
        raise RuntimeError(f"block forward never reached {sorted(missing)}")
    return stats, out


def hessian(_name: str, inputs: torch.Tensor) -> torch.Tensor:
    """H = 2 X X^T / n of a linear's inputs (GPTQ, SparseGPT, Wanda's input norms)."""
    inp = inputs.detach().reshape(-1, inputs.shape[-1]).float()
    # zero rows (an expert no calibration token chose): an all-zero H
    return 2.0 * (inp.t() @ inp) / max(inp.shape[0], 1)


def collect_hessians(
    block: nn.Module, names: list[str], x: torch.Tensor, cos, sin
) -> dict[str, torch.Tensor]:
    """H = 2 X X^T / n for each named linear's input, from one (truncated) block forward."""
    return observe_linears(block, names, x, cos, sin, hessian)[0]


def embed_calibration(
    model: nn.Module, calib_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first block's inputs (float32) and RoPE tables, as the model's forward makes them
    (Gemma's embedding scale included)."""
    spec = spec_for(model)
    embedding = spec.top_module(model, "embedding")
    x = embedding(calib_tokens.to(embedding.weight.device))
    if spec.scaled_embedding:  # as `Transformer.hidden_states`: rounded to x's dtype
        x = x * torch.tensor(model.config.hidden_size**0.5, dtype=x.dtype)
    x = x.float()
    cos, sin = model.rotary(0, calib_tokens.shape[1], x.dtype)
    return x, cos, sin


def walk_blocks(
    model: nn.Module,
    calib_tokens: torch.Tensor | None,
    method: BlockMethod,
    progress: bool = False,
) -> None:
    """Run `method` over the model's blocks in order, in place; each block is observed on
    the outputs of the blocks before it (see the module docstring). Without `calib_tokens`
    each stage is applied with no statistics and nothing runs forward (magnitude pruning)."""
    x = cos = sin = None
    if calib_tokens is not None:
        x, cos, sin = embed_calibration(model, calib_tokens)
    blocks = spec_for(model).named_blocks(model)
    with torch.no_grad(), layer_progress(len(blocks), method.label, progress) as advance:
        for i, (name, block) in enumerate(blocks):
            step = BlockStep(i, name, block, x, cos, sin)
            out = None
            for k, stage in enumerate(method.stages(step)):
                stats: dict[str, Any] = {}
                if x is not None:
                    full = method.feed_original and k == 0
                    stats, first = observe_linears(block, stage, x, cos, sin, method.observe, full)
                    out = first if full else out
                method.apply(step, stage, stats)
            if x is not None:
                x = out if method.feed_original and out is not None else block(x, cos, sin)
            method.finish(step)
            advance()
