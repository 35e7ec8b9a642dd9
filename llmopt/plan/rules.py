"""The structural rules a parallel plan must satisfy, and the `key=value` constraint spelling
(`--why-not`, `--where`, `plan compare`) that restricts the search to some plans.

Rules are vectorised masks over a grid, each paired with a one-line message in ParallelPlan's
names, so the search prunes with them and `--why-not` quotes them.
"""

from __future__ import annotations

import numpy as np

from llmopt.errors import LlmoptError
from llmopt.models.config import ModelConfig
from llmopt.parallel.plan import RECOMPUTES, SCHEDULES
from llmopt.plan.grid import GRAD_REDUCES, GRID_FIELDS, GRID_KEYS, Grid
from llmopt.plan.hardware import Cluster
from llmopt.plan.memory import grad_policy
from llmopt.plan.workload import Workload

MAX_MICRO_BATCH = 32
# Context parallelism is for long sequences. The model charges ring attention's K/V passes
# (`llmopt.plan.ring`) but not the lower efficiency of the 2·cp small flash-attention calls,
# which grows as chunks shrink, so the search only splits sequences into chunks of at least this
# many tokens (Llama 3 used CP
# only for its long-context phase; NeMo's Llama-3-70B recipe uses CP=2 at 8192).
MIN_CP_CHUNK = 4096
VIRTUAL_STAGES = (2, 3, 4, 5, 6, 8)  # 5: NeMo's Llama 3 70B recipes (80 layers, pp 8 x vp 5)
KEY_OF_FIELD = {name: key for key, name in GRID_FIELDS.items()}
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


class ConstraintError(LlmoptError, ValueError):
    """A `key=value` mapping spec that names an unknown field or an invalid value."""


def msg_at(msg: str, grid: Grid, i: int, **extra: object) -> str:
    """A rejection message filled with plan i's values (and `extra`, e.g. mem_gib)."""
    g = {k: int(grid[k][i]) for k in GRID_KEYS if k in grid}
    values: dict[str, object] = dict(g)
    values.update(extra)
    values["world"] = g["tp"] * g["pp"] * g["dp"] * g["cp"]
    values["pv"] = g["pp"] * g["v"]
    values["dpmbm"] = g["dp"] * g["mb"] * g["m"]
    values["schedule"] = SCHEDULES[g["sched"]]
    return msg.format(**values)


def structural_reasons(
    model: ModelConfig, work: Workload, cluster: Cluster, grid: Grid
) -> list[tuple[str, np.ndarray]]:
    """Rules a plan must satisfy before its cost matters, each with a one-line reason."""
    tp, pp, dp, cp, v = grid["tp"], grid["pp"], grid["dp"], grid["cp"], grid["v"]
    L, heads, kv = model.num_layers, model.num_heads, model.num_kv_heads
    n = cluster.num_gpus
    return [
        (f"tp*pp*dp*cp={{world}} must equal the {n} GPUs", tp * pp * dp * cp != n),
        (f"tp={{tp}} does not divide num_heads={heads}", heads % tp != 0),
        (
            f"tp={{tp}} and num_kv_heads={kv}: one must divide the other",
            (kv % tp != 0) & (tp % kv != 0),
        ),
        # Uneven splits are allowed (llmopt.plan.split: Megatron-Core's layouts, torchtitan's
        # weighted split, the engine's layers_per_stage); a chunk may hold only the embedding
        # or only the output layer and loss, so pp·v may reach num_layers + 2.
        (
            f"pp*virtual_stages={{pv}} exceeds num_layers+2={L + 2} (one chunk per layer, "
            "plus the embedding's and the loss's)",
            pp * v > L + 2,
        ),
        (
            "schedule=interleaved needs num_microbatches={m} divisible by pp={pp}",
            (grid["sched"] == 2) & (grid["m"] % pp != 0),
        ),
        (
            f"dp*micro_batch*num_microbatches={{dpmbm}} != global_batch {work.global_batch}",
            dp * grid["mb"] * grid["m"] != work.global_batch,
        ),
        (
            f"cp={{cp}} needs seq_len={work.seq_len} divisible by 2*cp (load-balanced causal)",
            (cp > 1) & (work.seq_len % (2 * cp) != 0),
        ),
        ("sequence_parallel needs tp>1", (grid["sp"] == 1) & (tp == 1)),
        (
            "zero_stage={zero} has no data-parallel ranks to shard over (dp*cp=1)",
            (grid["zero"] > 0) & (dp * cp == 1),
        ),
        ("schedule={schedule} needs pp>1", (grid["sched"] != 1) & (pp == 1)),
        (
            "grad_reduce=step needs zero_stage>=2 (zero_stage={zero} reduces once per step)",
            (grad_policy(grid) == 1) & (grid["zero"] < 2),
        ),
    ]


def search_space_reasons(
    model: ModelConfig, work: Workload, grid: Grid
) -> list[tuple[str, np.ndarray]]:
    """What the search does not generate although no structural rule forbids it (see the
    constants above): `--why-not` names these when a spec falls outside the searched space."""
    cp, s = grid["cp"], work.seq_len
    vs = ", ".join(map(str, VIRTUAL_STAGES))
    return [
        (
            f"cp={{cp}} cuts seq_len={s} into chunks under the {MIN_CP_CHUNK} tokens the search "
            "allows (the small flash-attention calls of short chunks are not modelled)",
            (cp > 1) & (s // cp < MIN_CP_CHUNK),
        ),
        (
            f"micro_batch={{mb}} is above the searched maximum {MAX_MICRO_BATCH}",
            grid["mb"] > MAX_MICRO_BATCH,
        ),
        (
            f"virtual_stages={{v}} is not among the searched {vs}",
            (grid["v"] > 1) & ~np.isin(grid["v"], VIRTUAL_STAGES),
        ),
    ]


def parse_constraints(spec: str) -> dict[str, int]:
    """'tp=8,pp=4,zero_stage=3,recompute=full,schedule=interleaved' -> grid constraints.

    Keys are ParallelPlan field names that the search varies; values as in a run config.
    """
    out: dict[str, int] = {}
    if not spec.strip():
        return out
    given: dict[str, str] = {}
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        name, eq, value = part.partition("=")
        if not eq:
            raise ConstraintError(f"bad mapping item {part!r}; expected key=value, e.g. tp=8")
        name = name.lower()
        if name not in KEY_OF_FIELD:
            raise ConstraintError(
                f"unknown mapping key {name!r}; valid: {', '.join(sorted(KEY_OF_FIELD))}"
            )
        if name in given:
            raise ConstraintError(
                f"{name} is given twice ({name}={given[name]}, {name}={value}); give it once"
            )
        given[name] = value
        key = KEY_OF_FIELD[name]
        if key == "sched":
            if value not in SCHEDULES:
                raise ConstraintError(f"schedule={value!r}; choose from {', '.join(SCHEDULES)}")
            out[key] = SCHEDULES.index(value)
        elif key == "rc":
            if value not in RECOMPUTES:
                raise ConstraintError(f"recompute={value!r}; choose from {', '.join(RECOMPUTES)}")
            out[key] = RECOMPUTES.index(value)
        elif key == "gacc":
            if value not in GRAD_REDUCES:
                raise ConstraintError(
                    f"grad_reduce={value!r}; choose from {', '.join(GRAD_REDUCES)}"
                )
            out[key] = GRAD_REDUCES.index(value)
        elif key == "sp":
            if value.lower() not in _TRUE + _FALSE:
                raise ConstraintError(f"sequence_parallel={value!r}; use true or false")
            out[key] = int(value.lower() in _TRUE)
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise ConstraintError(f"{name}={value!r} must be an integer") from None
            if key == "zero" and out[key] not in (0, 1, 2, 3):
                raise ConstraintError(f"zero_stage={value} is not a ZeRO stage; choose 0-3")
            if key != "zero" and out[key] <= 0:
                raise ConstraintError(f"{name}={value} must be a positive integer")
    return out


def format_constraints(constraints: dict[str, int]) -> str:
    """Grid constraints back in the spelling `parse_constraints` reads."""
    parts = []
    for key, value in constraints.items():
        name = GRID_FIELDS[key]
        if key == "sched":
            parts.append(f"{name}={SCHEDULES[value]}")
        elif key == "rc":
            parts.append(f"{name}={RECOMPUTES[value]}")
        elif key == "gacc":
            parts.append(f"{name}={GRAD_REDUCES[value]}")
        elif key == "sp":
            parts.append(f"{name}={'true' if value else 'false'}")
        else:
            parts.append(f"{name}={value}")
    return ",".join(parts)
