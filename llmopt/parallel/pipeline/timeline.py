"""Timelines of a pipeline step, as text (terminals, logs, tests) and as a PNG.

Both take per-rank lists of `Event`s, so a simulated schedule and a measured run (the executor
records the same events with wall-clock times) are drawn the same way and can be compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from llmopt.artifacts import atomic_save_figure
from llmopt.parallel.pipeline.simulate import Event


def _label(event: Event, pp: int) -> str:
    chunk = event.action.stage // pp
    return f"{event.action.op}{event.action.mb}" + ("" if chunk == 0 else f"'{chunk}")


def render_text(events: Sequence[Sequence[Event]], pp: int | None = None, unit: float = 0) -> str:
    """One row per rank; each cell is `unit` of time (default: the shortest event).

    A forward of micro-batch 3 is `F3`, a backward `B3`, chunk c>0 adds `'c`; `.` is idle.
    """
    pp = pp or len(events)
    durations = [e.end - e.start for rank in events for e in rank if e.end > e.start]
    if not durations:
        return "\n".join(f"rank {r}: (no compute)" for r in range(len(events)))
    unit = unit or min(durations)
    width = max(len(_label(e, pp)) for rank in events for e in rank) + 1
    rows = []
    for r, rank_events in enumerate(events):
        cells: list[str] = []
        for e in rank_events:
            start = round(e.start / unit)
            while len(cells) < start:
                cells.append(".".ljust(width))
            for _ in range(max(1, round((e.end - e.start) / unit))):
                cells.append(_label(e, pp).ljust(width))
        rows.append(f"rank {r}: " + "".join(cells).rstrip())
    return "\n".join(rows)


def _draw(ax, events: Sequence[Sequence[Event]], pp: int, title: str, time_unit: str) -> None:
    fwd_colors = ["#4c78a8", "#1f4e79", "#7fa7d1", "#0b2a4a"]
    bwd_colors = ["#59a14f", "#2d6a27", "#8cd17d", "#173d12"]
    origin = min((e.start for rank in events for e in rank), default=0.0)
    makespan = max((e.end - origin for rank in events for e in rank), default=1.0)
    for r, rank_events in enumerate(events):
        for e in rank_events:
            chunk = e.action.stage // pp
            palette = fwd_colors if e.action.op == "F" else bwd_colors
            ax.broken_barh(
                [(e.start - origin, e.end - e.start)],
                (r - 0.4, 0.8),
                facecolors=palette[chunk % len(palette)],
                edgecolor="white",
                linewidth=0.5,
            )
            if (e.end - e.start) / makespan > 0.012:
                ax.text(
                    (e.start + e.end) / 2 - origin,
                    r,
                    str(e.action.mb),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
    ax.set_yticks(range(len(events)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(events))])
    ax.set_ylim(len(events) - 0.5, -0.5)
    ax.set_xlim(0, makespan)
    ax.set_xlabel(f"time{f' ({time_unit})' if time_unit else ''}")
    if title:
        ax.set_title(title, fontsize=10)


def render_png(
    events: Sequence[Sequence[Event]] | Sequence[tuple[str, Sequence[Sequence[Event]]]],
    path: str | Path,
    *,
    pp: int | None = None,
    title: str = "",
    time_unit: str = "",
) -> Path:
    """Gantt chart of a step (forward blue, backward green, darker for later chunks).

    `events` is one step's per-rank events, or a list of (title, events) panels stacked in one
    figure (e.g. gpipe / 1f1b / interleaved side by side). Time starts at the earliest event.
    Written atomically: a reader never sees a half-written picture.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        list(events)
        if events and isinstance(events[0], tuple) and isinstance(events[0][0], str)
        else [(title, events)]
    )
    rows = sum(len(ev) for _, ev in panels)
    n_events = max(sum(map(len, ev)) / max(1, len(ev)) for _, ev in panels)
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(max(6.0, min(16.0, 0.35 * n_events)), 0.55 * rows + 1.1 * len(panels)),
        squeeze=False,
    )
    for ax, (panel_title, panel_events) in zip(axes[:, 0], panels):
        _draw(ax, panel_events, pp or len(panel_events), panel_title, time_unit)
    fig.tight_layout()
    path = Path(path)
    try:
        atomic_save_figure(fig, path)
    finally:
        plt.close(fig)
    return path
