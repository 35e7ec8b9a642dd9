"""Cut the plain `Transformer` into pipeline stages.

Stage 0 holds the embedding, the last stage the final norm and the LM head; the blocks are
spread evenly. Stages reuse the model's own modules (no copies), and their parameter names are
the model's (block 5's parameters keep the prefix `<blocks>.5.`), so gradients, optimizer
states and checkpoints map one-to-one onto the single-process model.

A stage is the model with the modules it does not hold set to None (torchtitan's
convention), so it runs the model's own forward; the module names come from the
architecture's `ModelSpec`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from llmopt.models.llama import Transformer
from llmopt.models.spec import spec_for
from llmopt.parallel.pipeline.schedule import ScheduleError


def stage_layout(
    num_layers: int,
    pp: int,
    virtual_stages: int = 1,
    layers_per_stage: Sequence[int] | None = None,
) -> tuple[range, ...]:
    """Layer indices of each of the pp*v virtual stages.

    Default: equal blocks. With v=1 an uneven count is balanced by giving the extra blocks to
    the middle stages (the first and last also carry the embedding and the head). Interleaving
    needs equal chunks (a chunk boundary must fall at the same depth on every rank), so with
    v>1 the default requires pp*v to divide num_layers; `layers_per_stage` overrides all this.
    """
    num_stages = pp * virtual_stages
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != num_stages:
            raise ScheduleError(
                f"layers_per_stage has {len(counts)} entries; need pp*v={num_stages} "
                f"(pp={pp}, virtual_stages={virtual_stages})"
            )
        if any(c < 0 for c in counts) or sum(counts) != num_layers:
            raise ScheduleError(
                f"layers_per_stage={counts} must be non-negative and sum to num_layers={num_layers}"
            )
    else:
        if num_layers < num_stages:
            raise ScheduleError(
                f"num_layers={num_layers} is fewer than pp*v={num_stages} stages "
                f"(pp={pp}, virtual_stages={virtual_stages})"
            )
        if virtual_stages > 1 and num_layers % num_stages:
            raise ScheduleError(
                f"num_layers={num_layers} is not divisible by pp*v={num_stages} "
                f"(pp={pp}, virtual_stages={virtual_stages}); pass layers_per_stage to "
                "split unevenly"
            )
        base, extra = divmod(num_layers, num_stages)
        preference = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))
        counts = [base] * num_stages
        for s in preference[:extra]:
            counts[s] += 1
    bounds, start = [], 0
    for count in counts:
        bounds.append(range(start, start + count))
        start += count
    return tuple(bounds)


class PipelineStage(Transformer):
    """One virtual stage: [embedding] -> blocks -> [final norm -> head].

    Input is token ids [B, T] on the first stage and hidden states [B, T', H] elsewhere; output
    is hidden states, or logits on the last stage (T' differs from T only when sequence
    parallelism shards the sequence).
    """

    def __init__(self, model: Transformer, stage: int, num_stages: int, layers: range) -> None:
        nn.Module.__init__(self)  # shares the model's modules; allocates nothing
        spec = spec_for(model)
        self.config = model.config
        self.stage = stage
        self.num_stages = num_stages
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.layer_indices = layers
        self.rotary = model.rotary  # buffers only: positions, not parameters
        self.attn_backend = None
        held = {"embedding": self.is_first, "final_norm": self.is_last, "head": self.is_last}
        for role, keep in held.items():
            setattr(self, getattr(spec, role), spec.top_module(model, role) if keep else None)
        blocks = spec.blocks_of(model)
        # ModuleDict keyed by the original index keeps parameter names equal to the model's.
        setattr(self, spec.blocks, nn.ModuleDict({str(i): blocks[i] for i in layers}))

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """`seq_len`: the full sequence length when x holds a sequence shard (RoPE tables).
        `attn_backend` (None: causal self-attention) is set by the engine: context
        parallelism's ring attention."""
        return super().forward(x, attn=self.attn_backend, seq_len=seq_len)


def split_model(
    model: Transformer,
    pp_rank: int,
    pp: int,
    virtual_stages: int = 1,
    layers_per_stage: Sequence[int] | None = None,
) -> list[PipelineStage]:
    """This rank's chunks (stages pp_rank, pp_rank + pp, ...), sharing the model's modules."""
    if not 0 <= pp_rank < pp:
        raise ScheduleError(f"pp_rank={pp_rank} is outside pp={pp}")
    layout = stage_layout(model.config.num_layers, pp, virtual_stages, layers_per_stage)
    num_stages = len(layout)
    return [PipelineStage(model, s, num_stages, layout[s]) for s in range(pp_rank, num_stages, pp)]


def stage_parameters(stages: Sequence[PipelineStage]) -> dict[str, nn.Parameter]:
    """This rank's parameters by their single-model name (what the optimizer should own)."""
    params: dict[str, nn.Parameter] = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            params.setdefault(name, param)
    return params
