"""`llmopt plan`: rank parallel mappings (default), `estimate` one, `compare` several.

With no arguments: Llama-3-70B on 8 DGX-H100 nodes, sequence 4096, global batch 1024
sequences, bf16.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from llmopt.artifacts import atomic_save_figure
from llmopt.models.config import ModelConfig
from llmopt.plan.hardware import Cluster, customize, get_cluster, load_cluster_toml
from llmopt.plan.workload import RECOMPUTES, SCHEDULES, STATE_BYTES, ParallelConfig, Workload

DEFAULT_MODEL = "llama-3-70b"
DEFAULT_CLUSTER = "dgx-h100"
DEFAULT_COMPARE = ("tp=8,pp=8", "tp=16,pp=4", "dp=64,zero=3")

_DIMS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")


def _common(p: argparse.ArgumentParser, sub: bool) -> None:
    """Options shared by plan/estimate/compare. On subcommands the defaults are suppressed so a
    value given before the subcommand name is not overwritten."""

    def d(value: Any) -> Any:
        return argparse.SUPPRESS if sub else value

    m = p.add_argument_group("model")
    m.add_argument("--model", default=d(DEFAULT_MODEL), help="preset name or HF config.json/dir")
    m.add_argument("--layers", type=int, default=d(None), help="explicit dims override the model")
    m.add_argument("--hidden", type=int, default=d(None))
    m.add_argument("--heads", type=int, default=d(None))
    m.add_argument("--kv-heads", dest="kv_heads", type=int, default=d(None))
    m.add_argument("--ffn", type=int, default=d(None), help="MLP intermediate size")
    m.add_argument("--vocab", type=int, default=d(None))
    m.add_argument("--mlp", choices=("swiglu", "gelu"), default=d(None))
    m.add_argument("--tied", action="store_true", default=d(None), help="tied embeddings")
    c = p.add_argument_group("cluster")
    c.add_argument(
        "--cluster",
        default=d(DEFAULT_CLUSTER),
        help="dgx-a100-80gb, dgx-h100, dgx-h200, dgx-b200 or a TOML file",
    )
    c.add_argument("--nodes", type=int, default=d(8))
    c.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, default=d(None))
    c.add_argument(
        "--peak-tflops", dest="peak_tflops", type=float, default=d(None), help="dense bf16"
    )
    c.add_argument("--fp8-tflops", dest="fp8_tflops", type=float, default=d(None))
    c.add_argument("--hbm-gib", dest="hbm_gib", type=float, default=d(None))
    c.add_argument("--hbm-gbs", dest="hbm_gbs", type=float, default=d(None), help="HBM GB/s")
    c.add_argument(
        "--nvlink-gbs",
        dest="nvlink_gbs",
        type=float,
        default=d(None),
        help="per GPU, per direction",
    )
    c.add_argument(
        "--ib-gbs", dest="ib_gbs", type=float, default=d(None), help="per GPU, per direction"
    )
    c.add_argument("--gemm-efficiency", dest="gemm_efficiency", type=float, default=d(None))
    w = p.add_argument_group("workload")
    w.add_argument("--seq-len", dest="seq_len", type=int, default=d(4096))
    w.add_argument(
        "--global-batch", dest="global_batch", type=int, default=d(1024), help="sequences"
    )
    w.add_argument("--global-batch-tokens", dest="global_batch_tokens", type=int, default=d(None))
    w.add_argument("--precision", choices=("bf16", "fp8"), default=d("bf16"))
    w.add_argument(
        "--state-bytes", dest="state_bytes", choices=tuple(STATE_BYTES), default=d("megatron")
    )
    w.add_argument("--no-flash", dest="no_flash", action="store_true", default=d(False))
    w.add_argument(
        "--tp-comm-overlap", dest="tp_comm_overlap", action="store_true", default=d(False)
    )
    w.add_argument("--no-dp-overlap", dest="no_dp_overlap", action="store_true", default=d(False))
    p.add_argument("--json", action="store_true", default=d(False), help="machine-readable output")
    p.add_argument("--plot", default=d(None), metavar="PNG", help="step-time breakdown chart")


def register(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser(
        "plan",
        help="choose and explain the parallel mapping of a model on a cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(plan, sub=False)
    plan.add_argument("--top-k", dest="top_k", type=int, default=10)
    plan.add_argument(
        "--why-not", dest="why_not", default=None, metavar="SPEC",
        help="e.g. tp=16 or tp=8,pp=1,zero=3: why no top plan uses these settings",
    )  # fmt: skip
    plan.set_defaults(func=run_plan)
    sub = plan.add_subparsers(dest="plan_command", metavar="{estimate,compare}")
    est = sub.add_parser("estimate", help="evaluate one fully specified mapping")
    _common(est, sub=True)
    for name in ("tp", "pp", "cp", "micro-batch"):
        est.add_argument(f"--{name}", dest=name.replace("-", "_"), type=int, default=1)
    est.add_argument("--dp", type=int, default=None, help="default: GPUs / (tp*pp*cp)")
    est.add_argument("--num-microbatches", dest="num_microbatches", type=int, default=None)
    est.add_argument("--sp", action="store_true", help="sequence parallel")
    est.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    est.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    est.add_argument("--virtual-stages", dest="virtual_stages", type=int, default=1)
    est.add_argument("--recompute", choices=RECOMPUTES, default="none")
    est.set_defaults(func=run_estimate)
    cmp = sub.add_parser("compare", help="evaluate several mappings side by side")
    _common(cmp, sub=True)
    cmp.add_argument(
        "mappings", nargs="*", default=list(DEFAULT_COMPARE),
        help=f"mapping specs (unset fields chosen by the planner); default: {' '.join(DEFAULT_COMPARE)}",
    )  # fmt: skip
    cmp.set_defaults(func=run_compare)


# ---- building inputs -------------------------------------------------------------------------
def build_model(args: argparse.Namespace) -> ModelConfig:
    from llmopt.models.presets import get_preset

    spec = args.model
    path = Path(spec)
    if spec.endswith(".json") or path.is_dir():
        model = ModelConfig.from_hf_config(path, name=path.stem)
    else:
        model = get_preset(spec)
    changes = {}
    names = {
        "layers": "num_layers",
        "hidden": "hidden_size",
        "heads": "num_heads",
        "kv_heads": "num_kv_heads",
        "ffn": "intermediate_size",
        "vocab": "vocab_size",
    }
    for arg, field in names.items():
        if getattr(args, arg, None) is not None:
            changes[field] = getattr(args, arg)
    if getattr(args, "mlp", None):
        changes["mlp"] = args.mlp
    if getattr(args, "tied", None):
        changes["tie_embeddings"] = True
    if changes:
        if "hidden_size" in changes or "num_heads" in changes:
            changes.setdefault("head_dim", None)
        model = model.replace(name=f"{model.name} (custom)", **changes)
    return model


def build_cluster(args: argparse.Namespace) -> Cluster:
    if args.nodes is not None and args.nodes <= 0:
        raise ValueError(f"--nodes={args.nodes} must be a positive integer")
    if args.cluster.endswith(".toml"):
        cluster = load_cluster_toml(args.cluster, nodes=args.nodes)
    else:
        cluster = get_cluster(args.cluster, args.nodes)
    overrides = {
        "gpus_per_node": args.gpus_per_node,
        "gpu.peak_bf16_tflops": args.peak_tflops,
        "gpu.peak_fp8_tflops": args.fp8_tflops,
        "gpu.hbm_gib": args.hbm_gib,
        "gpu.hbm_bandwidth_gbs": args.hbm_gbs,
        "gpu.gemm_efficiency": args.gemm_efficiency,
        "intra_node.bandwidth_gbs": args.nvlink_gbs,
        "inter_node.bandwidth_gbs": args.ib_gbs,
    }
    return customize(cluster, **overrides)


def build_workload(args: argparse.Namespace) -> Workload:
    batch = args.global_batch
    if args.global_batch_tokens is not None:
        if args.global_batch_tokens <= 0 or args.global_batch_tokens % args.seq_len:
            raise ValueError(
                f"--global-batch-tokens={args.global_batch_tokens} must be a positive multiple "
                f"of --seq-len={args.seq_len}"
            )
        batch = args.global_batch_tokens // args.seq_len
    return Workload(
        seq_len=args.seq_len,
        global_batch=batch,
        precision=args.precision,
        flash_attention=not args.no_flash,
        state_bytes=args.state_bytes,
        tp_comm_overlap=args.tp_comm_overlap,
        dp_comm_overlap=not args.no_dp_overlap,
    )


def _inputs(args):
    return build_model(args), build_workload(args), build_cluster(args)


def _header(model: ModelConfig, work: Workload, cluster: Cluster) -> dict[str, Any]:
    return {
        "model": model.name,
        "parameters": model.num_parameters(),
        "cluster": {
            "name": cluster.name,
            "gpu": cluster.gpu.name,
            "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node,
        },
        "workload": {
            "seq_len": work.seq_len,
            "global_batch": work.global_batch,
            "precision": work.precision,
            "state_bytes": work.state_bytes,
        },
    }


# ---- rendering -------------------------------------------------------------------------------
def _table(plans, title: str):
    from rich.table import Table

    table = Table(title=title)
    cols = ("#", "tp pp dp cp", "SP", "ZeRO", "mb x m", "schedule", "recomp")
    cols += ("GiB", "step s", "tok/s", "MFU", "net GB")
    for c in cols:
        table.add_column(
            c, justify="left" if c in ("schedule", "recomp", "tp pp dp cp") else "right"
        )
    for i, plan in enumerate(plans):
        p = plan.parallel
        sched = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": f"int v{p.virtual_stages}"}
        mem = f"{plan.memory_bytes['total'] / 2**30:.1f}" + ("" if plan.fits else "!")
        table.add_row(
            str(plan.rank or i + 1), f"{p.tp} {p.pp} {p.dp} {p.cp}",
            "y" if p.sp else "n", str(p.zero_stage), f"{p.micro_batch}x{p.num_microbatches}",
            sched[p.schedule] if p.pp > 1 else "-", p.recompute[:4], mem,
            f"{plan.step_time_s['total']:.2f}", f"{plan.tokens_per_s:,.0f}", f"{plan.mfu:.1%}",
            f"{plan.comm_bytes.get('inter_node', 0.0) / 1e9:.1f}",
        )  # fmt: skip
    return table


def plot_breakdown(plans, labels: list[str], path: str, title: str) -> None:
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


def _label(plan) -> str:
    p = plan.parallel
    sched = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": f"v{p.virtual_stages}"}[p.schedule]
    return (
        f"#{plan.rank} tp{p.tp} pp{p.pp} dp{p.dp} cp{p.cp} {sched} z{p.zero_stage} "
        f"{p.recompute[:4]} mb{p.micro_batch}"
    )


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1))


# ---- handlers --------------------------------------------------------------------------------
def run_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from llmopt.plan.explain import explain, why_not
    from llmopt.plan.search import parse_constraints, search

    if args.top_k <= 0:
        raise ValueError(f"--top-k={args.top_k} must be positive")
    model, work, cluster = _inputs(args)
    constraints = parse_constraints(args.why_not) if args.why_not else None
    t0 = time.perf_counter()
    result = search(model, work, cluster, top_k=max(args.top_k, 2))
    seconds = time.perf_counter() - t0
    plans = result.plans[: args.top_k]
    runner = result.plans[1] if len(result.plans) > 1 else None
    plans[0].explanation = explain(model, work, cluster, plans[0], runner)
    for plan in plans[1:]:
        plan.explanation = explain(model, work, cluster, plan, top=plans[0])
    if args.plot:
        title = f"{model.name} on {cluster.num_gpus} x {cluster.gpu.name}: top plans"
        plot_breakdown(plans, [_label(p) for p in plans], args.plot, title)
    why: list[str] = []
    if constraints is not None:
        ev = result.evaluation
        times = ev.time["total"][ev.valid]
        why = why_not(model, work, cluster, constraints, plans[0], times)
    if args.json:
        out = _header(model, work, cluster)
        out.update(
            {
                "evaluated": result.evaluated,
                "valid": result.valid,
                "search_seconds": seconds,
                "plans": [p.to_dict() for p in plans],
            }
        )
        if constraints is not None:
            out["why_not"] = {"spec": args.why_not, "explanation": why}
        _print_json(out)
        return 0
    console = Console(width=max(Console().width, 130))
    title = (
        f"{model.name} on {cluster.nodes}x{cluster.gpus_per_node} {cluster.gpu.name}, "
        f"seq {work.seq_len}, batch {work.global_batch}, {work.precision} -- "
        f"{result.valid:,} of {result.evaluated:,} plans valid, searched in {seconds:.2f} s"
    )
    console.print(_table(plans, title))
    console.print("[bold]Why the top plan:[/bold]")
    for line in plans[0].explanation:
        console.print(f"  - {line}", soft_wrap=True, highlight=False)
    if why:
        console.print(f"[bold]Why not {args.why_not}:[/bold]")
        for line in why:
            console.print(f"  {line}", soft_wrap=True, highlight=False)
    return 0


def run_estimate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from llmopt.plan.explain import explain, link_report
    from llmopt.plan.search import estimate

    model, work, cluster = _inputs(args)
    inner = args.tp * args.pp * args.cp
    dp = args.dp
    if dp is None:
        if cluster.num_gpus % inner:
            raise ValueError(
                f"tp*pp*cp={inner} does not divide the {cluster.num_gpus} GPUs; pass --dp"
            )
        dp = cluster.num_gpus // inner
    m = args.num_microbatches
    if m is None:
        per = dp * args.micro_batch
        if work.global_batch % per:
            raise ValueError(
                f"global batch {work.global_batch} is not divisible by dp*micro_batch={per}"
            )
        m = work.global_batch // per
    par = ParallelConfig(
        tp=args.tp, pp=args.pp, dp=dp, cp=args.cp, sp=args.sp, zero_stage=args.zero,
        micro_batch=args.micro_batch, num_microbatches=m, schedule=args.schedule,
        virtual_stages=args.virtual_stages, recompute=args.recompute,
    )  # fmt: skip
    plan = estimate(model, work, cluster, par)
    plan.explanation = explain(model, work, cluster, plan)
    links = link_report(model, work, cluster, par)
    if args.json:
        out = _header(model, work, cluster)
        out["plan"] = plan.to_dict()
        out["collectives"] = links
        _print_json(out)
        return 0
    console = Console(width=max(Console().width, 130))
    console.print(_table([plan], f"{model.name}: estimate of {par.short()}"))
    if plan.rejected:
        console.print("[bold red]Invalid:[/bold red] " + "; ".join(plan.rejected), soft_wrap=True)
    for line in plan.explanation:
        console.print(f"  - {line}", soft_wrap=True, highlight=False)
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from llmopt.plan.explain import link_report
    from llmopt.plan.search import build_grid, evaluate, parse_constraints, plan_at, ranked

    model, work, cluster = _inputs(args)
    results = []
    for spec in args.mappings:
        c = parse_constraints(spec)
        grid = build_grid(model, work, cluster, c)
        if len(grid["tp"]) == 0:
            raise ValueError(f"mapping {spec!r} is impossible on {cluster.num_gpus} GPUs")
        ev = evaluate(model, work, cluster, grid)
        order = ranked(ev)
        if len(order):
            i = int(order[0])
        else:  # nothing valid: show the leanest structurally valid variant, flagged
            import numpy as np

            ok = np.flatnonzero(ev.structural)
            if not len(ok):
                raise ValueError(
                    f"mapping {spec!r} violates: "
                    + "; ".join(plan_at(ev, 0, work.precision).rejected)
                )
            i = int(ok[np.argmin(ev.memory["total"][ok])])
        plan = plan_at(ev, i, work.precision)
        results.append((spec, plan, link_report(model, work, cluster, plan.parallel)))
    if args.plot:
        plot_breakdown([r[1] for r in results], [r[0] for r in results], args.plot, model.name)
    fastest = (
        min(r[1].step_time_s["total"] for r in results if r[1].fits)
        if any(r[1].fits for r in results)
        else None
    )
    if args.json:
        out = _header(model, work, cluster)
        out["mappings"] = [
            {"spec": s, "plan": p.to_dict(), "collectives": links} for s, p, links in results
        ]
        _print_json(out)
        return 0
    console = Console(width=max(Console().width, 130))
    plans = [p for _, p, _ in results]
    for i, p in enumerate(plans):
        p.rank = i + 1
    console.print(_table(plans, f"{model.name}: {' vs '.join(args.mappings)}"))
    for spec, plan, links in results:
        t = Table(title=f"{spec}: collectives per GPU per step (last pipeline stage)")
        for col in ("group", "op", "link", "calls", "wire GB"):
            t.add_column(col, justify="right" if col in ("calls", "wire GB") else "left")
        for r in links:
            t.add_row(r["group"], r["op"], r["link"], f"{r['calls']:,}", f"{r['wire_gb']:.2f}")
        console.print(t)
        verdict = "" if not plan.fits else (
            "fastest" if fastest == plan.step_time_s["total"]
            else f"{plan.step_time_s['total'] / fastest - 1:+.1%} vs fastest"
        )  # fmt: skip
        if not plan.fits:
            verdict = "does not fit: " + "; ".join(plan.rejected)
        console.print(f"  {spec}: {verdict}", soft_wrap=True, highlight=False)
    return 0
