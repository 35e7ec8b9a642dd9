"""Published framework mappings inside the planner's own ranking: is NeMo's (or Megatron's)
published mapping valid under that framework's rules, and how far is its best variant from
the #1 plan of the same search (issue 27: within 5 %)?

Each case is a published pre-training configuration (NVIDIA-NeMo/Megatron-Bridge
docs/performance-summary-archive.md @ 067f987d, 25.11 container tables; Megatron-Bridge's
performance configs @ b7b4e11b give FP8, bf16 gradients, TP userbuffer overlap and HybridEP).
The mapping's fields are held fixed; the other choices (recompute, ZeRO stage, ...) are the
planner's, as for the #1 plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmopt.models.presets import get_preset
from llmopt.plan.frameworks import FRAMEWORK_KERNELS, recipe_moments
from llmopt.plan.hardware import get_cluster
from llmopt.plan.rules import parse_constraints
from llmopt.plan.search import ranked, search
from llmopt.plan.workload import Workload

# (label, model, cluster preset, nodes, GPUs per node, seq, global batch, published mapping)
CASES = [
    ("Llama 3 70B, 64 H100", "llama-3-70b", "dgx-h100", 8, None, 8192, 128,
     "tp=4,pp=8,virtual_stages=5,micro_batch=1,cp=1"),
    ("Llama 3.1 405B, 1,024 H100", "llama-3.1-405b", "dgx-h100", 128, None, 8192, 512,
     "tp=8,pp=8,cp=2,virtual_stages=8,micro_batch=1"),
    ("Llama 3.1 405B, 128 B200", "llama-3.1-405b", "dgx-b200", 16, None, 8192, 64,
     "tp=4,pp=8,cp=2,virtual_stages=8,micro_batch=1"),
    ("DeepSeek-V3, 256 B200", "deepseek-v3", "dgx-b200", 32, None, 4096, 2048,
     "tp=1,pp=16,ep=8,micro_batch=1,schedule=1f1b"),
    ("DeepSeek-V3, 256 GB200", "deepseek-v3", "gb200-nvl72", 4, 64, 4096, 4096,
     "tp=1,pp=4,virtual_stages=4,ep=64,micro_batch=1"),
]  # fmt: skip


@dataclass
class MappingResult:
    label: str
    spec: str
    valid: bool
    reason: str  # why it is invalid ("" when valid)
    top: str
    top_s: float
    published_s: float | None
    rank: int | None

    @property
    def gap(self) -> float | None:
        return None if self.published_s is None else self.published_s / self.top_s - 1


def check(framework: str = "nemo") -> list[MappingResult]:
    """Each published mapping's best valid variant under `framework`, against its #1."""
    out = []
    for label, name, preset, nodes, per_node, seq, gbs, spec in CASES:
        model = get_preset(name)
        cluster = get_cluster(preset, nodes, per_node)
        work = Workload(
            seq_len=seq, global_batch=gbs, precision="fp8", state_bytes="zero",
            tp_comm_overlap=True, ep_dispatcher="hybridep" if model.moe else "alltoall",
            moments=recipe_moments(framework, name), **FRAMEWORK_KERNELS.get(framework, {}),
        )  # fmt: skip
        result = search(model, work, cluster, top_k=1, framework=framework)
        ev, top = result.evaluation, result.plans[0]
        mask = np.ones(len(ev.grid["tp"]), dtype=bool)
        for key, value in parse_constraints(spec).items():
            mask &= ev.grid[key] == value
        ok = np.flatnonzero(mask & ev.valid)
        row = dict(label=label, spec=spec, top=top.parallel.short(),
                   top_s=top.step_time_s["total"])  # fmt: skip
        if not len(ok):
            i = np.flatnonzero(mask)
            why = [m for m, bad in ev.reasons if len(i) and bad[i].all()]
            out.append(MappingResult(**row, valid=False, reason=(why or ["not in the grid"])[0],
                                     published_s=None, rank=None))  # fmt: skip
            continue
        best = int(ok[np.argmin(ev.time["total"][ok])])
        rank = int(np.flatnonzero(ranked(ev) == best)[0]) + 1
        out.append(MappingResult(**row, valid=True, reason="",
                                 published_s=float(ev.time["total"][best]), rank=rank))  # fmt: skip
    return out
