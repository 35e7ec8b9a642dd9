"""Published framework mappings inside the planner's own ranking: is NeMo's (or Megatron's)
published mapping valid under that framework's rules, and how far is its best variant from
the #1 plan of the same search (issue 27: within 5 %)?

Each case is a published pre-training configuration (NVIDIA-NeMo/Megatron-Bridge
docs/performance-summary-archive.md @ 067f987d, 25.11 container tables; Megatron-Bridge's
performance configs @ b7b4e11b give FP8, bf16 gradients and TP userbuffer overlap). The
dispatcher and the MTP modules are those of the run: Megatron-Bridge v0.2.1 (2025-12-09, the
release whose docs/performance-summary.md first carries the 25.11 tables) sets HybridEP for
DeepSeek-V3 on GB200 and no flex backend on B200 (`scripts/performance/configs/deepseek/
workload_base_configs.py`), so B200 ran the provider's `moe_token_dispatcher_type="alltoall"`
(`src/megatron/bridge/models/deepseek/deepseek_provider.py`); the 25.11 tables label the B200
run "w/ MTP" and the GB200 run "w/o MTP". The mapping's fields are held fixed; the other
choices (recompute, ZeRO stage, ...) are the planner's, as for the #1 plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from llmopt.models.presets import get_preset
from llmopt.plan.frameworks import FRAMEWORK_KERNELS, recipe_moments
from llmopt.plan.hardware import get_cluster
from llmopt.plan.rules import parse_constraints
from llmopt.plan.search import ranked, search
from llmopt.plan.workload import Workload

# (label, model, cluster preset, nodes, GPUs per node, seq, global batch, published mapping,
#  EP dispatcher, MTP modules or None for the preset's)
CASES = [
    ("Llama 3 70B, 64 H100", "llama-3-70b", "dgx-h100", 8, None, 8192, 128,
     "tp=4,pp=8,virtual_stages=5,micro_batch=1,cp=1", "alltoall", None),
    ("Llama 3.1 405B, 1,024 H100", "llama-3.1-405b", "dgx-h100", 128, None, 8192, 512,
     "tp=8,pp=8,cp=2,virtual_stages=8,micro_batch=1", "alltoall", None),
    ("Llama 3.1 405B, 128 B200", "llama-3.1-405b", "dgx-b200", 16, None, 8192, 64,
     "tp=4,pp=8,cp=2,virtual_stages=8,micro_batch=1", "alltoall", None),
    ("DeepSeek-V3, 256 B200", "deepseek-v3", "dgx-b200", 32, None, 4096, 2048,
     "tp=1,pp=16,ep=8,micro_batch=1,schedule=1f1b", "alltoall", 1),
    ("DeepSeek-V3, 256 GB200", "deepseek-v3", "gb200-nvl72", 4, 64, 4096, 4096,
     "tp=1,pp=4,virtual_stages=4,ep=64,micro_batch=1", "hybridep", 0),
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
    for label, name, preset, nodes, per_node, seq, gbs, spec, dispatcher, mtp in CASES:
        model = get_preset(name)
        if mtp is not None and model.moe is not None:
            model = model.replace(moe=dataclasses.replace(model.moe, mtp_layers=mtp))
        cluster = get_cluster(preset, nodes, per_node)
        work = Workload(
            seq_len=seq, global_batch=gbs, precision="fp8", state_bytes="zero",
            tp_comm_overlap=True, ep_dispatcher=dispatcher,
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
