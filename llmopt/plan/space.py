"""The search space: every candidate plan of a model on a cluster as one grid (arrays), before
the cost model and the rules score them (`llmopt.plan.search`)."""

from __future__ import annotations

import itertools

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.plan.experts import expert_options
from llmopt.plan.grid import GRID_KEYS, Grid
from llmopt.plan.hardware import Cluster
from llmopt.plan.rules import MAX_MICRO_BATCH, MIN_CP_CHUNK, VIRTUAL_STAGES
from llmopt.plan.workload import Workload


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def build_grid(
    model: ModelConfig, work: Workload, cluster: Cluster, constraints: dict[str, int] | None = None
) -> Grid:
    """All candidate plans, already restricted to `constraints` (grid keys -> value).

    Only combinations that can possibly be valid are generated (tp·pp·dp·cp = GPUs, dp divides
    the batch, micro-batch divides the per-replica batch); the rest of the rules are checked by
    `structural_reasons` so that `--why-not` can name them.
    """
    c = dict(constraints or {})
    n = cluster.num_gpus
    B, s = work.global_batch, work.seq_len

    def options(key: str, default: list[int]) -> list[int]:
        return [c[key]] if key in c else default

    outer: list[tuple[int, ...]] = []
    divs = _divisors(n)
    for tp in options("tp", divs):
        if n % tp:
            continue
        cps = [x for x in divs if s % (2 * x) == 0 and s // x >= MIN_CP_CHUNK] or [1]
        for cp in options("cp", sorted(set(cps) | {1})):
            if n % (tp * cp):
                continue
            rest = n // (tp * cp)
            for pp in options("pp", [d for d in _divisors(rest) if d <= model.num_layers]):
                if rest % pp:
                    continue
                dp = rest // pp
                if "dp" in c and c["dp"] != dp:
                    continue
                if B % dp:
                    continue
                per_replica = B // dp
                mbs = [x for x in _divisors(per_replica) if x <= MAX_MICRO_BATCH]
                for mb in options("mb", mbs):
                    if per_replica % mb:
                        continue
                    m = per_replica // mb
                    if "m" in c and c["m"] != m:
                        continue
                    scheds = [(1, 1)]
                    if pp > 1:
                        vs = [c["v"]] if c.get("v", 1) > 1 else VIRTUAL_STAGES  # fixed: as given
                        scheds = [(0, 1), (1, 1)] + [(2, v) for v in vs]
                    for sched, v in scheds:
                        if "sched" in c and c["sched"] != sched:
                            continue
                        if "v" in c and c["v"] != v:
                            continue
                        for ep, etp in expert_options(model, tp, dp * cp, options):
                            outer.append((tp, pp, dp, cp, mb, m, v, sched, ep, etp))
    if not outer:
        return {k: np.zeros(0, dtype=np.int64) for k in GRID_KEYS}
    base = np.array(outer, dtype=np.int64)
    inner = list(
        itertools.product(
            options("zero", [0, 1, 2, 3]),
            options("rc", [0, 1, 2]),
            options("sp", [0, 1]),
            options("gacc", [0, 1]),
        )
    )
    inner_a = np.array(inner, dtype=np.int64)
    rep = np.repeat(base, len(inner), axis=0)
    tile = np.tile(inner_a, (len(base), 1))
    grid = {
        "tp": rep[:, 0],
        "pp": rep[:, 1],
        "dp": rep[:, 2],
        "cp": rep[:, 3],
        "mb": rep[:, 4],
        "m": rep[:, 5],
        "v": rep[:, 6],
        "sched": rep[:, 7],
        "ep": rep[:, 8],
        "etp": rep[:, 9],
        "zero": tile[:, 0],
        "rc": tile[:, 1],
        "sp": tile[:, 2],
        "gacc": tile[:, 3],
    }
    if "gacc" not in c:  # the gradient policy is a choice only under ZeRO-2/3
        keep = (grid["gacc"] == 0) | (grid["zero"] >= 2)
        grid = {k: v[keep] for k, v in grid.items()}
    if not constraints:  # drop plans that are trivially redundant (SP without TP, ZeRO alone)
        keep = ~((grid["sp"] == 1) & (grid["tp"] == 1))
        keep &= ~((grid["zero"] > 0) & (grid["dp"] * grid["cp"] == 1))
        keep &= ~((grid["sched"] == 2) & (grid["m"] % grid["pp"] != 0))
        grid = {k: v[keep] for k, v in grid.items()}
    return grid
