"""The one error summary every validation reports: median and 90th percentile of the absolute
relative error |predicted / measured - 1|."""

from __future__ import annotations

import math
import statistics


def error_summary(rel_errs: list[float]) -> tuple[float, float]:
    """(median, p90) of |e| over `rel_errs`; p90 is the nearest-rank percentile (the smallest
    error at least 90 % of the rows reach), NaN for no rows."""
    a = sorted(abs(e) for e in rel_errs)
    if not a:
        return math.nan, math.nan
    return statistics.median(a), a[min(len(a) - 1, math.ceil(0.9 * len(a)) - 1)]
