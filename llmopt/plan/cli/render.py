"""How `llmopt plan` shows plans: a rich table, a step-time breakdown chart, JSON."""

from __future__ import annotations

import os
import sys
from typing import Any

from llmopt import jsonout
from llmopt.artifacts import atomic_save_figure
from llmopt.plan.search import Plan


def plans_table(plans: list[Plan], title: str):
    from rich.table import Table

    table = Table(title=title)
    moe = any(p.parallel.ep > 1 for p in plans)
    fp8 = any(p.mfu_bf16_peak is not None for p in plans)
    cols = ("#", "tp pp dp cp" + (" ep/etp" if moe else ""), "SP", "ZeRO", "mb x m", "schedule")
    cols += ("recomp", "GiB", "step s", "tok/s", "tok/s/GPU", "MFU (fp8 peak)" if fp8 else "MFU")
    cols += ("MFU (bf16 peak)",) if fp8 else ()
    for c in cols + ("net GB",):
        table.add_column(
            c, justify="left" if c in ("schedule", "recomp") or c[:2] == "tp" else "right"
        )
    for i, plan in enumerate(plans):
        p = plan.parallel
        sched = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": f"int v{p.virtual_stages}"}
        mem = f"{plan.memory_bytes['total'] / 2**30:.1f}" + ("" if plan.fits else "!")
        mapping = f"{p.tp} {p.pp} {p.dp} {p.cp}" + (f" {p.ep}/{plan.expert_tp}" if moe else "")
        bf16 = (f"{plan.mfu_bf16_peak:.1%}",) if fp8 and plan.mfu_bf16_peak is not None else ()
        table.add_row(
            str(plan.rank or i + 1), mapping,
            "y" if p.sequence_parallel else "n",
            f"{p.zero_stage}" + ("/step" if plan.grad_reduce == "step" else ""),
            f"{p.micro_batch}x{p.num_microbatches}",
            sched[p.schedule] if p.pp > 1 else "-", p.recompute[:4], mem,
            f"{plan.step_time_s['total']:.2f}", f"{plan.tokens_per_s:,.0f}",
            f"{plan.tokens_per_s / p.world_size:,.0f}", f"{plan.mfu:.1%}", *bf16,
            f"{plan.comm_bytes.get('inter_node', 0.0) / 1e9:.1f}",
        )  # fmt: skip
    return table


def links_table(title: str, links: list[dict]):
    from rich.table import Table

    t = Table(title=title)
    for col in ("group", "op", "phase", "link", "calls", "wire GB"):
        t.add_column(col, justify="right" if col in ("calls", "wire GB") else "left")
    for r in links:
        t.add_row(
            r["group"], r["op"], r["phase"], r["link"], f"{r['calls']:,}", f"{r['wire_gb']:.2f}"
        )
    return t


def plot_breakdown(plans: list[Plan], labels: list[str], path: str, title: str) -> None:
    """Stacked bars of each plan's step-time components (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [k for k in plans[0].step_time_s if k != "total"]
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(plans) + 1.5))
    left = [0.0] * len(plans)
    for j, part in enumerate(parts):
        widths = [p.step_time_s[part] for p in plans]
        if not any(widths):
            continue
        ax.barh(labels, widths, left=left, label=part, color=f"C{j}")
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)
    plt.close(fig)


def label(plan: Plan) -> str:
    p = plan.parallel
    sched = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": f"v{p.virtual_stages}"}[p.schedule]
    return (
        f"#{plan.rank} tp{p.tp} pp{p.pp} dp{p.dp} cp{p.cp} {sched} z{p.zero_stage} "
        f"{p.recompute[:4]} mb{p.micro_batch}"
    )


def print_json(obj: Any) -> None:
    """Print JSON; a reader that stops early (`| head`) ends the output quietly."""
    try:
        sys.stdout.write(jsonout.dumps(obj, indent=1) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # point stdout at /dev/null so the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
