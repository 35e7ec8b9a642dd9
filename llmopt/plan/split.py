"""How the layers are split over pipeline ranks: the most balanced uneven split.

Megatron-Core places layers freely with `--pipeline-model-parallel-layout` (or first/last-stage
layer counts, or `--account-for-embedding/loss-in-pipeline-split`), torchtitan weighs the
embedding and the output layer like layers (`pipeline_parallel_layers_per_stage` and
`generate_llm_fqn_per_model_part`), and llmopt's engine takes explicit `layers_per_stage`. So
the planner does not require pp·v to divide the layers: every rank but the last holds at most
`busiest` layers, and the last rank, which also runs the output layer and the loss, and a
MoE model's multi-token-prediction modules (each a block, its 2h->h projection and the output
layer again; Megatron-Core places them on the last stage, "m" before "L" in a layout), worth
`head_units` layers together, holds the rest. When the layers divide evenly over the pp·v chunks the
split is even (every framework's default); otherwise the split that minimises the busiest
rank's work is chosen (`rank_layers`); `chunk_layers` lists it per model chunk for the
exporters.
"""

from __future__ import annotations

import functools

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.models.moe import attention_params, mlp_params, mtp_block_params


def mtp_layers(model: ModelConfig) -> int:
    """Multi-token-prediction modules of the model (0 for dense models)."""
    return model.moe.mtp_layers if model.moe is not None else 0


def head_units(model: ModelConfig) -> float:
    """The last stage's extra GEMM work in units of one block's GEMM work (the block's matmul
    weights a token uses): the output layer (h·V) and, per MTP module, its block with the 2h->h
    projection and the output layer once more (DeepSeek-V3 §2.2: the MTP modules share the
    main model's output head, so they sit on its stage; Megatron-Bridge's DeepSeek-V3 layouts
    end the last stage with ["mtp"] * mtp_num_layers + ["loss"], recipes/deepseek/deepseek_v3.py
    @v0.2.1)."""
    mp = mlp_params(model)
    block = attention_params(model) + mp["dense"] + mp["active"] + mp["shared"] + mp["router"]
    mtp = mtp_layers(model)
    extra = mtp * mtp_block_params(model) + (1 + mtp) * model.hidden_size * model.vocab_size
    return extra / max(block, 1.0)


@functools.lru_cache(maxsize=4096)
def _best_split(L: int, p: int, v: int, u: float) -> tuple[int, int, int]:
    """(first, busiest, last) layer counts on p ranks of v chunks. When every chunk can hold the
    same number of layers the split is even (every framework's default, no layout needed).
    Otherwise the last rank's count minimises the busiest rank's load (layers, the last rank's
    plus `u`) and, among such counts, is the largest (the most even split); the other ranks
    share the rest as evenly as possible, the first rank (which holds the embedding) taking the
    smallest share. No other rank holds more than an even split's ceil(L/p) layers: a heavy
    last stage gives up layers only down to that (the layouts NVIDIA ships for DeepSeek-V3,
    Megatron-Bridge v0.2.1 recipes/deepseek/deepseek_v3.py: pp 16 as E+4 | 4 x 14 | 1+mtp+loss,
    pp 8 as E+8 | 8 x 6 | 5+mtp+loss, pp 4 as E+16 | 16 | 16 | 13+mtp+loss), which also keeps
    the other ranks' activation memory at the even split's."""
    if p <= 1:
        return L, L, L
    if L % (p * v) == 0:
        return L // p, L // p, L // p
    best = None
    for last in range(0, -(-L // p) + 2):
        rest = L - last
        if rest < 0:
            break
        busiest = -(-rest // (p - 1))
        if busiest > -(-L // p):
            continue
        load = max(busiest, last + u)
        if best is None or load < best[0] - 1e-9 or abs(load - best[0]) <= 1e-9:
            best = (load, rest // (p - 1), busiest, last)
    _, first, busiest, last = best
    return first, busiest, last


def rank_layers(
    model: ModelConfig, pp: np.ndarray | int, v: np.ndarray | int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first rank's, busiest non-last rank's, last rank's) layer counts of the most balanced
    split of the model's layers over `pp` pipeline ranks (`_best_split`; each rank's layers
    spread over its v chunks). With pp=1 all three are the layer count."""
    p, vv = np.broadcast_arrays(np.asarray(pp, dtype=np.int64), np.asarray(v, dtype=np.int64))
    u = head_units(model)
    if p.size == 1:  # one plan (estimate, explanations): no grouping needed
        one = _best_split(model.num_layers, int(p.flat[0]), int(vv.flat[0]), u)
        return tuple(np.full(p.shape, x, dtype=np.int64) for x in one)  # type: ignore[return-value]
    first, busy, last = (np.empty(p.shape, dtype=np.int64) for _ in range(3))
    key = p * 1_000_003 + vv
    for k in np.unique(key):
        at = key == k
        first[at], busy[at], last[at] = _best_split(
            model.num_layers, int(k // 1_000_003), int(k % 1_000_003), u
        )
    return first, busy, last


def chunk_layers(model: ModelConfig, pp: int, v: int) -> list[list[int]]:
    """Layers of each model chunk, [rank][virtual stage], of the split `rank_layers` prices:
    each rank's layers spread as evenly as possible over its v chunks, the first chunk of the
    first rank (embedding) and the last chunk of the last rank (output layer) lightest."""
    first, _, last = (int(x) for x in rank_layers(model, pp, v))
    if pp == 1:
        counts = [model.num_layers]
    else:  # ranks 1..pp-2 share what the first and last do not hold, the earlier ones more
        rest, mids = model.num_layers - first - last, pp - 2
        counts = [first] + [rest // mids + (1 if i < rest % mids else 0) for i in range(mids)]
        counts = (counts if mids else [first]) + [last]
    out = []
    for r, n in enumerate(counts):
        chunks = [n // v + (1 if c < n % v else 0) for c in range(v)]
        if r == pp - 1:
            chunks.reverse()  # the remainder on the earlier chunks; the loss chunk is lightest
        else:
            chunks = chunks[::-1] if r == 0 else chunks
        out.append(chunks)
    return out


def is_even(model: ModelConfig, pp: int, v: int) -> bool:
    """Whether every chunk holds the same number of layers (no layout flags needed)."""
    chunks = [c for rank in chunk_layers(model, pp, v) for c in rank]
    return len(set(chunks)) == 1


def megatron_layout(model: ModelConfig, pp: int, v: int) -> str | None:
    """The split as Megatron-Core's `--pipeline-model-parallel-layout` ("E" embedding, "t" a
    layer, "m" an MTP module, "L" the loss, "|" between chunks in rank-major order per virtual
    stage), or None when an even split needs no layout (every chunk the same size, no MTP)."""
    mtp = model.moe.mtp_layers if model.moe is not None else 0
    counts = chunk_layers(model, pp, v)
    if len({c for rank in counts for c in rank}) == 1 and not mtp:
        return None
    chunks = []
    for vs in range(v):
        for r in range(pp):
            text = ("E" if (vs, r) == (0, 0) else "") + "t" * counts[r][vs]
            if (vs, r) == (v - 1, pp - 1):
                text += "m" * mtp + "L"
            chunks.append(text)
    return "|".join(chunks)
