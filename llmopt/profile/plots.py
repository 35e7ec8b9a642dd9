"""Roofline and memory-timeline figures of a profile summary (`llmopt.profile.session`).

The roofline places each main operator of a phase at (arithmetic intensity, achieved FLOP/s)
under the two roofs this machine actually reached (`llmopt.peaks`): an op near the
slanted roof is bandwidth-bound, near the flat one compute-bound, far below both it is bound by
something else (launch overhead, poor kernels, Python).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.artifacts import atomic_save_figure


def _short(op: str) -> str:
    op = op.removeprefix("aten::")
    return "sdpa" if op.startswith("_scaled_dot_product") else op


def roofline_points(phase: dict[str, Any], time_key: str, top: int) -> list[dict[str, Any]]:
    """The `top` rows by self time whose FLOPs and bytes are known and non-zero."""
    points = []
    for row in phase["table"]:
        seconds = row[time_key] * 1e-6
        if not row["flops"] or not row["bytes"] or seconds <= 0:
            continue
        points.append(
            {
                "name": _short(row["name"]),
                "intensity": row["flops"] / row["bytes"],
                "flops_per_s": row["flops"] / seconds,
                "percent": row["percent"],
            }
        )
        if len(points) == top:
            break
    return points


def plot_roofline(summary: dict[str, Any], path: str | Path, top: int = 6) -> dict[str, list]:
    """Write the roofline PNG; returns the plotted points per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    peaks = summary["peaks"]
    key = "self_device_us" if summary["time_basis"] == "device" else "self_cpu_us"
    phases = {p: roofline_points(summary[p], key, top) for p in ("decode", "prefill")}
    xs = [pt["intensity"] for pts in phases.values() for pt in pts] + [peaks["ridge_flop_per_byte"]]
    lo, hi = min(xs) / 4, max(xs) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.loglog(x, np.minimum(peaks["flops_per_s"], x * peaks["bytes_per_s"]), "k-", lw=2)
    ax.axvline(peaks["ridge_flop_per_byte"], color="0.7", ls=":", lw=1)
    label = (
        f"measured roofs: {peaks['flops_per_s'] / 1e9:.1f} GFLOP/s matmul, "
        f"{peaks['bytes_per_s'] / 1e9:.1f} GB/s copy ({peaks['dtype']}, {peaks['device']})"
    )
    ax.set_title(label, fontsize=9)
    styles = {"decode": ("o", "tab:blue"), "prefill": ("s", "tab:orange")}
    for phase, pts in phases.items():
        marker, color = styles[phase]
        for pt in pts:
            ax.loglog(pt["intensity"], pt["flops_per_s"], marker, color=color, ms=8)
            ax.annotate(
                f"{pt['name']} ({pt['percent']:.0f}%)",
                (pt["intensity"], pt["flops_per_s"]),
                textcoords="offset points",
                xytext=(6, 4),
                fontsize=7,
                color=color,
            )
        ax.plot([], [], marker, color=color, label=f"{phase} ops (% of phase op time)")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, which="both", alpha=0.25)
    fig.tight_layout()
    atomic_save_figure(fig, path)
    plt.close(fig)
    return phases


def plot_memory(summary: dict[str, Any], path: str | Path) -> None:
    """Write the memory-timeline PNG (bytes held over the profiled generation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem = summary["memory"]
    points = mem["timeline_ms_bytes"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step([t for t, _ in points], [b / 2**20 for _, b in points], where="post")
    ax.axhline(mem["peak_bytes"] / 2**20, color="tab:red", ls="--", lw=1, label="peak")
    ax.set_xlabel("time in profiled generation (ms)")
    ax.set_ylabel("MiB held")
    ax.set_title(f"memory ({mem['basis']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, path)
    plt.close(fig)
