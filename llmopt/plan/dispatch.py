"""Expert-parallel token dispatch and combine: the bytes each MoE block moves, per dispatcher,
and how much of it hides behind compute.

An EP group spans etp·ep consecutive ranks (Megatron-Core's folding); each rank dispatches the
top_k copies of its local tokens' hidden states (bf16) to the ranks holding the chosen experts
and gets the results back (combine), forward and backward (and again under full recompute).
With experts spread evenly, a copy goes to each of the ep ranks with probability 1/ep.

Dispatchers (`DISPATCHERS`, Megatron-Core `--moe-token-dispatcher-type` / flex backends):
- "alltoall": NCCL all-to-all; every copy bound for another node crosses the network itself.
- "deepep" (DeepEP, arXiv:2412.19437 §3.2.2 and deepseek-ai/DeepEP): a token crosses the
  network once per destination node and is fanned out over NVLink there, so the network carries
  the expected number of distinct remote nodes per token, not top_k copies.
- "hybridep" (Megatron-Core's HybridEP, the DeepEP hybrid-ep branch): the same deduplication
  over the NVLink domain of an NVL72 rack (for a DGX it is DeepEP).
NVLink and the network run concurrently: a call takes the longer of the two parts plus two
latencies.

Hiding (`exposed_seconds`): by default the all-to-alls sit on the critical path. With
`Workload.ep_comm_overlap` (Megatron-Core `--overlap-moe-expert-parallel-comm`, the 1F1B
"A2A overlap") the dispatch/combine of one micro-batch runs under the other micro-batch's
compute of the merged forward-backward step; DualPipe (`Workload.dualpipe`, DeepSeek-V3) does
the same inside its bidirectional schedule. Either hides up to `comm_overlap_efficiency` of the
stage's compute; what is left is exposed.
"""

from __future__ import annotations

from math import comb

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.models.moe import num_moe_layers
from llmopt.plan.grid import Grid
from llmopt.plan.hardware import Cluster

DISPATCHERS = ("alltoall", "deepep", "hybridep")
ACT_BYTES = 2


def ep_of(grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """(ep, etp) arrays of a grid; 1 where the grid has none (dense plans)."""
    ones = np.ones_like(grid["tp"])
    return grid.get("ep", ones), grid.get("etp", ones)


def _distinct_nodes(experts: int, top_k: int, nodes: np.ndarray) -> np.ndarray:
    """Expected distinct nodes among a token's top_k experts when `experts` are spread evenly
    over `nodes` nodes (sampling without replacement)."""
    out = np.empty_like(nodes, dtype=np.float64)
    for n in np.unique(nodes):
        per = experts // int(n) if n > 0 else experts
        miss = comb(experts - per, top_k) / comb(experts, top_k) if experts - per >= top_k else 0.0
        out[nodes == n] = n * (1.0 - miss)
    return out


def call_payload_bytes(model: ModelConfig, grid: Grid, tokens: np.ndarray) -> np.ndarray:
    """What one rank hands one dispatch (or combine) all-to-all of one MoE block: the top_k
    copies of its `tokens` tokens (before the TP split; sequence-split over TP), bf16 rows,
    its own share included (the engine's counter books the same)."""
    if model.moe is None:
        return np.zeros(len(grid["tp"]))
    ep, _ = ep_of(grid)
    local = np.asarray(tokens, dtype=np.float64) / grid["tp"]
    return np.where(ep > 1, local * model.moe.top_k * model.hidden_size * ACT_BYTES, 0.0)


def moe_layers_per_stage(
    model: ModelConfig, n_first: np.ndarray, n_last: np.ndarray, v: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """MoE blocks on the first and on the last pipeline rank, given their layer counts (the
    MoE blocks are the model's last `num_moe_layers`). With virtual stages a rank's layers are
    spread over the model, so it gets its share of them (rounded)."""
    moe = num_moe_layers(model)
    dense = model.num_layers - moe
    first = np.clip(n_first - dense, 0, n_first)
    last = np.minimum(n_last, moe)
    frac = moe / model.num_layers
    spread = np.asarray(v) > 1
    first = np.where(spread, np.rint(n_first * frac), first).astype(np.int64)
    last = np.where(spread, np.rint(n_last * frac), last).astype(np.int64)
    return first, last


def call_bytes(
    model: ModelConfig, cluster: Cluster, grid: Grid, tokens: np.ndarray, dispatcher: str
) -> tuple[np.ndarray, np.ndarray]:
    """(NVLink bytes, network bytes) one rank sends in one dispatch (or combine) call of one
    MoE block, for `tokens` tokens per rank before the TP split."""
    if model.moe is None:
        zero = np.zeros(len(grid["tp"]))
        return zero, zero
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher={dispatcher!r}; choose from {', '.join(DISPATCHERS)}")
    ep, etp = ep_of(grid)
    e = ep.astype(np.float64)
    g = cluster.gpus_per_node
    k = model.moe.top_k
    local = np.asarray(tokens, dtype=np.float64) / grid["tp"]  # sequence-split over TP
    row = model.hidden_size * ACT_BYTES  # local * k * row = call_payload_bytes
    span = etp * ep
    in_node = np.where(span <= g, e, np.maximum(g // etp, 1))  # EP ranks in my node (me too)
    nodes = np.maximum(np.ceil(e / in_node), 1).astype(np.int64)
    intra = local * k * row * (in_node - 1) / e
    copies_out = local * k * (e - in_node) / e
    if dispatcher == "alltoall":
        inter = copies_out * row
    else:  # one copy per distinct remote node, the rest forwarded over NVLink there
        remote_nodes = _distinct_nodes(model.moe.num_experts, k, nodes) * (nodes - 1) / nodes
        inter = local * np.minimum(remote_nodes, k * (e - in_node) / e) * row
        intra = intra + (copies_out * row - inter)  # the fan-out inside the remote node
    return np.where(ep > 1, intra, 0.0), np.where(ep > 1, inter, 0.0)


def seconds_per_call(
    model: ModelConfig, cluster: Cluster, grid: Grid, tokens: np.ndarray, dispatcher: str
) -> np.ndarray:
    """One dispatch (or combine) call: NVLink and network parts run concurrently."""
    intra, inter = call_bytes(model, cluster, grid, tokens, dispatcher)
    t = np.maximum(intra / cluster.intra_node.bytes_per_s, inter / cluster.inter_node.bytes_per_s)
    lat = np.where(inter > 0, cluster.inter_node.latency_us, cluster.intra_node.latency_us) * 1e-6
    ep, _ = ep_of(grid)
    return np.where(ep > 1, t + 2 * lat, 0.0)


def calls_per_microbatch(model: ModelConfig, rc_full: np.ndarray) -> np.ndarray:
    """Dispatch + combine forward and backward per block (averaged over blocks), again under
    full recomputation."""
    frac = num_moe_layers(model) / model.num_layers
    return frac * np.where(rc_full, 6.0, 4.0)


def exposed_seconds(
    a2a_mb: np.ndarray, compute_mb: np.ndarray, hidden: bool, overlap_efficiency: float
) -> np.ndarray:
    """Seconds of a micro-batch's all-to-alls (`a2a_mb`) left on the critical path: all of
    them, or with A2A overlap / DualPipe what exceeds the hideable share of the other
    micro-batch's compute (`compute_mb`, the stage's compute of one micro-batch)."""
    if not hidden:
        return a2a_mb
    return np.maximum(0.0, a2a_mb - overlap_efficiency * compute_mb)
