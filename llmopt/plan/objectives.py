"""What the search optimises (`--objective`) and the hard limits a plan must meet (`--require`).

Objectives order the valid plans; requirements are masks over a grid, reported by `--why-not`
like any other rule. Both work on the search's arrays, so they add no per-plan Python.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from llmopt.errors import LlmoptError
from llmopt.plan.grid import GRID_FIELDS, Grid
from llmopt.plan.hardware import GIB

OBJECTIVES = ("time", "internode-bytes", "memory", "gpus")
# Plans whose objective is within this fraction of the best are ties, ordered by step time.
OBJECTIVE_BAND = 0.01

_OPS: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
    "=": operator.eq,
}
_NUMERIC = {"tp", "pp", "dp", "cp", "zero", "mb", "m", "v"}
_FIELD_KEY = {GRID_FIELDS[k]: k for k in _NUMERIC}
_UNITS = {"gib": GIB, "gb": 1e9, "mib": 2**20, "mb": 1e6, "": GIB}
_EXPR = re.compile(r"^([a-z_]+)\s*(<=|>=|==|!=|<|>|=)\s*([0-9.]+)\s*([a-z]*)$")
# Named requirements: (what it excludes, grid -> mask of plans violating it).
NAMED: dict[str, tuple[str, Callable[[Grid, int], np.ndarray]]] = {
    # ZeRO-3 all-gathers every layer's weights before its forward (and again for backward);
    # ZeRO-0/1/2 keep full weights and gather none in the forward pass.
    "no-forward-allgather": ("zero_stage=3 (weights all-gathered in forward)",
                             lambda g, n: g["zero"] == 3),
    "tp-in-node": ("tp larger than one node", lambda g, n: g["tp"] > n),
}  # fmt: skip


class RequireError(LlmoptError, ValueError):
    """A `--require` expression or `--objective` the planner cannot read."""


@dataclass(frozen=True)
class Requirement:
    """One `--require` expression; `violates` marks the plans it excludes."""

    text: str
    key: str  # a grid key, "mem" (bytes per GPU) or a NAMED requirement
    op: str = ""
    value: float = 0.0

    def violates(self, grid: Grid, mem_total: np.ndarray, gpus_per_node: int) -> np.ndarray:
        if self.key in NAMED:
            return NAMED[self.key][1](grid, gpus_per_node)
        values = mem_total if self.key == "mem" else grid[self.key]
        return ~_OPS[self.op](values, self.value)


def check_objective(name: str) -> str:
    if name not in OBJECTIVES:
        raise RequireError(
            f"--objective={name!r} is not valid; choose one of {', '.join(OBJECTIVES)}"
        )
    return name


def parse_require(expr: str) -> Requirement:
    """'zero_stage<=2', 'tp<=8', 'mem<=70GiB' (GiB, GB, MiB, MB; bare = GiB), or a named
    requirement ('no-forward-allgather', 'tp-in-node')."""
    text = expr.strip().lower()
    if text in NAMED:
        return Requirement(text, text)
    match = _EXPR.match(text)
    valid = (
        f"expected FIELD<=N with FIELD one of {', '.join(sorted(_FIELD_KEY))}, mem (e.g. "
        f"mem<=70GiB), or one of {', '.join(NAMED)}"
    )
    if not match:
        raise RequireError(f"--require {expr!r} is not valid; {valid}")
    name, op, number, unit = match.groups()
    try:
        value = float(number)
    except ValueError:
        raise RequireError(f"--require {expr!r}: {number!r} is not a number") from None
    if not np.isfinite(value):
        raise RequireError(f"--require {expr!r}: the value must be finite")
    if name == "mem":
        if unit not in _UNITS:
            raise RequireError(f"--require {expr!r}: unit {unit!r}; use GiB, GB, MiB or MB")
        return Requirement(expr.strip(), "mem", op, value * _UNITS[unit])
    if name not in _FIELD_KEY:
        raise RequireError(f"--require {expr!r}: unknown field {name!r}; {valid}")
    if unit:
        raise RequireError(f"--require {expr!r}: {name} takes a plain number, not {unit!r}")
    return Requirement(expr.strip(), _FIELD_KEY[name], op, value)


def objective_band(objective: str, time: np.ndarray, mem: np.ndarray, internode: np.ndarray):
    """Per plan, the band of the objective it falls in (0 = within 1 % of the best; bytes
    closer than 1 MB are equal). Step time orders plans within a band; "time" and "gpus" (the
    GPU count is fixed before ranking) have one band."""
    check_objective(objective)
    key = {"memory": mem, "internode-bytes": internode}.get(objective)
    if key is None:
        return np.zeros(len(time), dtype=np.int64)
    floor = max(float(key.min()) * OBJECTIVE_BAND, 1e6)
    return np.floor((key - key.min()) / floor).astype(np.int64)
