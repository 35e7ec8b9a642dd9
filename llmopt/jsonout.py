"""JSON for every `--json` printer and JSON log: always valid JSON, never `NaN` or `Infinity`.

Python's `json.dumps` writes non-finite floats as the bare words NaN / Infinity, which no JSON
parser accepts (jq, JavaScript, strict Python all refuse them). A non-finite float here becomes
`null` (what JavaScript's JSON.stringify does) and `allow_nan=False` guarantees nothing else
slips through: a value that still cannot be written raises instead of printing invalid JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(value: Any) -> Any:
    """`value` with every non-finite float (nested in dicts, lists, tuples) replaced by None;
    numbers with a `.item()` (NumPy, 0-d tensors) are converted to Python scalars first."""
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    if not isinstance(value, (str, bytes, int, float, bool)) and hasattr(value, "item"):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):  # not a scalar: left to json to refuse
            return value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(payload: Any, **kwargs: Any) -> str:
    """`json.dumps` of `payload` with non-finite floats as null (keyword arguments passed on)."""
    return json.dumps(finite_or_none(payload), allow_nan=False, **kwargs)
