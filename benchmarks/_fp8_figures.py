"""Figures of `fp8_convergence.py`: loss curves of one run, and the summary across seeds."""

from __future__ import annotations

import statistics
from pathlib import Path

from _report import save_figure


def ema(values: list[float], alpha: float = 0.05) -> list[float]:
    out, acc = [], values[0]
    for v in values:
        acc = (1 - alpha) * acc + alpha * v
        out.append(acc)
    return out


def plot(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_rel) = plt.subplots(1, 2, figsize=(13, 4.8))
    base = results["bf16"]
    for mode, res in results.items():
        style = "--" if mode.startswith("bf16-seed") else "-"
        steps = range(1, len(res["train_loss"]) + 1)
        (line,) = ax.plot(steps, ema(res["train_loss"]), style, label=f"{mode} (train, EMA)")
        xs, ys = zip(*res["eval"])
        ax.plot(xs, ys, "o", color=line.get_color(), markersize=4)
        if mode != "bf16":
            rel = [
                100 * (a - b) / b for a, b in zip(ema(res["train_loss"]), ema(base["train_loss"]))
            ]
            ax_rel.plot(steps, rel, style, color=line.get_color(), label=mode)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token); dots: held-out")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.set_ylim(top=min(ax.get_ylim()[1], base["train_loss"][0] + 0.5))
    ax_rel.axhline(0, color="black", linewidth=0.8)
    for bound in (-1, 1):
        ax_rel.axhline(bound, color="grey", linestyle=":", linewidth=0.8)
    ax_rel.set_xlabel("step")
    ax_rel.set_ylabel("train loss vs bf16 (%), EMA")
    ax_rel.set_ylim(-5, 5)
    ax_rel.legend(fontsize=8)
    ax_rel.set_title("difference to bf16 (dotted: +-1%)")
    fig.tight_layout()
    save_figure(fig, path)


def combine(payloads: list[dict], path: Path) -> dict[str, dict]:
    """Across seeds: held-out loss vs bf16 per mode (each seed, mean, std) and one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in payloads[0]["runs"] if m != "bf16" and not m.startswith("bf16-seed")]
    colors = {m: f"C{i + 1}" for i, m in enumerate(modes)}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    first = payloads[0]["runs"]
    for mode, res in first.items():
        if mode.startswith("bf16-seed"):
            continue
        steps = range(1, len(res["train_loss"]) + 1)
        color = colors.get(mode, "C0")
        axes[0].plot(steps, ema(res["train_loss"]), color=color, label=f"{mode} (train, EMA)")
        xs, ys = zip(*res["eval"])
        axes[0].plot(xs, ys, "o", color=color, markersize=4)
    axes[0].set_ylim(top=first["bf16"]["train_loss"][0] + 0.3)
    axes[0].set_title(f"seed {payloads[0]['args']['seed']}: loss (dots: held-out)")
    axes[0].set_xlabel("step")
    axes[0].legend(fontsize=8)
    stats: dict[str, dict] = {}
    for mode in modes:
        finals = []
        for k, payload in enumerate(payloads):
            runs = payload["runs"]
            if mode not in runs:
                continue
            res, base = runs[mode], runs["bf16"]
            seed = payload["args"]["seed"]
            rel = [
                100 * (a - b) / b for a, b in zip(ema(res["train_loss"]), ema(base["train_loss"]))
            ]
            axes[1].plot(rel, styles[k % 4], color=colors[mode], label=f"{mode} seed {seed}")
            held = [100 * (a[1] - b[1]) / b[1] for a, b in zip(res["eval"], base["eval"])]
            axes[2].plot(
                [e[0] for e in res["eval"]], held, styles[k % 4], marker="o", color=colors[mode]
            )
            finals.append(held[-1])
        stats[mode] = {
            "held_out_vs_bf16_pct": finals,
            "mean": statistics.mean(finals),
            "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        }
    for ax, what in ((axes[1], "train loss (EMA)"), (axes[2], "held-out loss")):
        ax.axhline(0, color="black", linewidth=0.8)
        for bound in (-1, 1):
            ax.axhline(bound, color="grey", linestyle=":", linewidth=0.8)
        ax.set_ylim(-4, 4)
        ax.set_xlabel("step")
        ax.set_ylabel(f"{what} vs bf16 (%)")
    axes[1].set_title("train loss vs bf16 per seed (line style = seed)")
    axes[1].legend(fontsize=7, ncol=2)
    axes[2].set_title("held-out loss vs bf16 per seed (dotted: +-1%)")
    fig.tight_layout()
    save_figure(fig, path)
    return stats
