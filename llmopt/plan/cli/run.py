"""Handlers of `llmopt plan`, `plan estimate` and `plan compare`: call the API, print."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import numpy as np

from llmopt.errors import UsageError
from llmopt.plan.cli.inputs import budget_inputs, build_plan, header, inputs, model_overrides
from llmopt.plan.cli.render import label, links_table, plans_table, plot_breakdown, print_json

if TYPE_CHECKING:
    from llmopt.models.config import ModelConfig
    from llmopt.plan.hardware import Cluster
    from llmopt.plan.search import Plan, SearchResult
    from llmopt.plan.workload import Workload


EXPLAINED = 10  # plans of a --top-k list that get a full explanation


def _console():
    from rich.console import Console

    return Console(width=max(Console().width, 130))


def _emit(
    args: argparse.Namespace,
    model: ModelConfig,
    work: Workload,
    cluster: Cluster,
    result: SearchResult,
) -> list[str]:
    """Write plan #--pick; if the format cannot express it, name the best plan it can."""
    from llmopt.plan.emit import EmitError, PlannedRun, check, format_for, write
    from llmopt.plan.search import first_rank, plan_of_rank

    if args.pick <= 0:
        raise UsageError(f"--pick={args.pick} must be a positive rank")
    fmt = format_for(args.emit, args.emit_format)
    overrides = model_overrides(args)

    def run_of(plan: Plan) -> PlannedRun:
        return PlannedRun(model, args.model, work, cluster, plan, overrides)

    plan = plan_of_rank(model, work, cluster, result, args.pick)
    try:
        check(run_of(plan), fmt)
    except EmitError as exc:

        def accepts(p: Plan) -> bool:
            try:
                check(run_of(p), fmt)
            except EmitError:
                return False
            return True

        best = first_rank(result, accepts)
        hint = (
            f"; the best plan it can express is #{best}: use --pick {best}"
            if best
            else f"; none of the {result.valid} valid plans can be expressed in {fmt}"
        )
        raise EmitError(f"plan #{args.pick}: {exc}{hint}") from None
    return [str(p) for p in write(run_of(plan), args.emit, fmt)]


def _runs_on(args: argparse.Namespace, model, work, cluster, plan: Plan) -> dict[str, str]:
    """framework -> "" when it can run the plan, else the reason it cannot."""
    from llmopt.plan.emit import FORMATS, EmitError, PlannedRun, check

    run = PlannedRun(model, args.model, work, cluster, plan, model_overrides(args))
    out = {}
    for fmt in FORMATS:
        try:
            check(run, fmt)
            out[fmt] = ""
        except EmitError as exc:
            out[fmt] = str(exc)
    return out


def _best_framework_plan(
    args: argparse.Namespace, model, work, cluster, result: SearchResult, runs_on: dict[str, str]
) -> tuple[int, Plan, list[str]] | None:
    """When no framework runs the #1 plan (only llmopt's planner prices it): the best-ranked
    plan some framework's rules and exporter accept, with those frameworks."""
    from llmopt.plan.emit import FORMATS, EmitError, PlannedRun, check
    from llmopt.plan.frameworks import Numerics, framework_reasons
    from llmopt.plan.search import plan_of_rank, ranked

    real = [f for f in FORMATS if f != "llmopt"]
    if args.framework != "llmopt" or any(not runs_on[f] for f in real):
        return None
    ev = result.evaluation
    order = ranked(ev)
    numerics = Numerics.of_work(work)
    for f in real:  # the rules are masks: the first plan each framework accepts
        ok = np.ones(len(ev.grid["tp"]), dtype=bool)
        for _, mask in framework_reasons(f, model, numerics, ev.grid):
            ok &= ~mask
        hits = np.flatnonzero(ok[order])
        runs_on[f] = int(hits[0]) + 1 if len(hits) else 0
    best: tuple[int, Plan, list[str]] | None = None
    for rank in sorted({r for r in runs_on.values() if isinstance(r, int) and r > 0}):
        plan = plan_of_rank(model, work, cluster, result, rank)
        run = PlannedRun(model, args.model, work, cluster, plan, model_overrides(args))
        names = []
        for f in real:
            try:
                check(run, f)
                names.append(f)
            except EmitError:
                pass
        if names:
            best = (rank, plan, names)
            break
    return best


def _answer(objective: str, top: Plan, result: SearchResult, cluster: Cluster) -> str:
    """One sentence answering the objective with the top plan's figure."""
    p = top.parallel
    name = f"{p.short()} zero_stage={p.zero_stage} recompute={p.recompute}"
    if objective == "internode-bytes":
        ev = result.evaluation
        best = float(ev.comm["inter_node"][ev.valid].min()) if ev.comm is not None else 0.0
        return (
            f"{name} sends {top.comm_bytes['inter_node'] / 1e9:.1f} GB per GPU per step over "
            f"{cluster.inter_node.name} (fewest of the {result.valid:,} valid plans: "
            f"{best / 1e9:.1f} GB)."
        )
    if objective == "memory":
        return f"{name} needs {top.memory_bytes['total'] / 2**30:.1f} GiB per GPU."
    if objective == "gpus":
        return (
            f"{cluster.num_gpus} GPUs ({cluster.nodes}x{cluster.gpus_per_node}) are the fewest "
            f"that run it: {name}."
        )
    return f"{name} takes {top.step_time_s['total']:.2f} s per step."


def _budget(
    b: dict | None, model: ModelConfig, work: Workload, plan: Plan
) -> tuple[dict, list[str]]:
    """Goodput and token-budget figures of `plan` for the checked flags `b` (JSON, lines)."""
    from llmopt.plan.budget import training_budget
    from llmopt.plan.goodput import goodput

    if b is None:
        return {}, []
    gpus = plan.parallel.world_size
    out: dict = {}
    lines: list[str] = []
    fraction = 1.0
    if b["failures"]:
        g = goodput(model, gpus, b["ckpt_gbs"], b["gpu_mtbf_hours"], b["failures_per_day"],
                    b["restart_minutes"])  # fmt: skip
        fraction = g.goodput
        out["goodput"] = g.to_dict()
        lines.append(g.line())
    if b["tokens"] is not None:
        step_s = plan.step_time_s["total"]
        tb = training_budget(b["tokens"], work.tokens_per_step, step_s, gpus, b["price"], fraction)
        out["budget"] = tb.to_dict()
        lines.append(tb.line())
    return out, lines


def run_plan(args: argparse.Namespace) -> int:
    from llmopt.plan.explain import explain, why_not
    from llmopt.plan.fewest import search_fewest_gpus
    from llmopt.plan.fits import fits_with
    from llmopt.plan.objectives import parse_require
    from llmopt.plan.rules import parse_constraints
    from llmopt.plan.search import search
    from llmopt.plan.shortfall import NothingFitsError

    if args.top_k <= 0:
        raise UsageError(f"--top-k={args.top_k} must be positive")
    model, work, cluster = inputs(args)
    budget_flags = budget_inputs(args)
    constraints = parse_constraints(args.why_not) if args.why_not else None
    where = parse_constraints(args.where) if args.where else None
    requires = tuple(parse_require(r) for r in args.require)
    top_k = max(args.top_k, args.pick, 2)
    t0 = time.perf_counter()
    if args.objective == "gpus":
        cluster, result = search_fewest_gpus(
            model, work, cluster, top_k, where, args.framework, requires
        )
    else:
        try:
            result = search(
                model, work, cluster, top_k, where, args.framework, args.objective, requires
            )
        except NothingFitsError as exc:  # name the one switch that admits plans, if any
            fix = fits_with(model, work, cluster, exc.constraints, exc.evaluation)
            if fix is None or "does not fit" not in str(exc):
                raise
            raise UsageError(f"{exc}; {fix.strip()[0].lower()}{fix.strip()[1:]}") from None
    seconds = time.perf_counter() - t0
    plans = result.plans[: args.top_k]
    runner = result.plans[1] if len(result.plans) > 1 else None
    plans[0].explanation = explain(model, work, cluster, plans[0], runner, framework=args.framework)
    # A full explanation prices each plan's alternatives (several evaluations); only the plans
    # a reader sees explained get one, the bulk rows of a long --top-k list one cheap line.
    top_time = plans[0].step_time_s["total"]
    for i, plan in enumerate(plans[1:], start=2):
        if i <= EXPLAINED:
            plan.explanation = explain(
                model, work, cluster, plan, top=plans[0], framework=args.framework
            )
        else:
            plan.explanation = [
                f"Rank {i}: {plan.step_time_s['total'] / top_time - 1:+.1%} step time versus "
                f"the top plan, {plan.memory_bytes['total'] / 2**30:.1f} GiB per GPU (full "
                f"explanations for the first {EXPLAINED} plans)."
            ]
    runs_on = _runs_on(args, model, work, cluster, plans[0])
    framework_plan = _best_framework_plan(args, model, work, cluster, result, dict(runs_on))
    budget, budget_lines = _budget(budget_flags, model, work, plans[0])
    written = _emit(args, model, work, cluster, result) if args.emit else []
    if args.plot:
        title = f"{model.name} on {cluster.num_gpus} x {cluster.gpu.name}: top plans"
        plot_breakdown(plans, [label(p) for p in plans], args.plot, title)
    why: list[str] = []
    if constraints is not None:
        why = why_not(model, work, cluster, constraints, result)
    choice = {"framework": args.framework, "objective": args.objective, "require": args.require}
    if args.json:
        out = header(model, work, cluster)
        out.update(
            {
                "evaluated": result.evaluated,
                "valid": result.valid,
                "search_seconds": seconds,
                **choice,
                "answer": _answer(args.objective, plans[0], result, cluster),
                "runs_on": [f for f, why in runs_on.items() if not why],
                "not_on": {f: why for f, why in runs_on.items() if why},
                "plans": [p.to_dict() for p in plans],
            }
        )
        out.update(budget)
        if framework_plan is not None:
            rank, fp, names = framework_plan
            out["best_framework_plan"] = {"rank": rank, "runs_on": names, "plan": fp.to_dict()}
        if where:
            out["where"] = args.where
        if constraints is not None:
            out["why_not"] = {"spec": args.why_not, "explanation": why}
        if written:
            out["emitted"] = written
        print_json(out)
        return 0
    console = _console()
    title = (
        f"{model.name} on {cluster.nodes}x{cluster.gpus_per_node} {cluster.gpu.name}, "
        f"seq {work.seq_len}, batch {work.global_batch}, {work.precision} -- "
        f"{result.valid:,} of {result.evaluated:,} plans valid"
        + (f" with {args.where}" if where else "")
        + (f", {args.framework} rules" if args.framework != "llmopt" else "")
        + (f", objective {args.objective}" if args.objective != "time" else "")
        + (f", require {' & '.join(args.require)}" if args.require else "")
        + f", searched in {seconds:.2f} s"
    )
    console.print(plans_table(plans, title))
    answer = _answer(args.objective, plans[0], result, cluster)
    console.print(
        f"[bold]Answer ({args.objective}):[/bold] {answer}", soft_wrap=True, highlight=False
    )
    console.print("[bold]Why the top plan:[/bold]")
    for line in plans[0].explanation:
        console.print(f"  - {line}", soft_wrap=True, highlight=False)
    can = [f for f, why in runs_on.items() if not why]
    cannot = [f"{f} ({why})" for f, why in runs_on.items() if why]
    console.print(
        f"[bold]Runs on:[/bold] {', '.join(can) or 'none of the exporters'}"
        + (f"; not on: {'; '.join(cannot)}" if cannot else ""),
        soft_wrap=True,
        highlight=False,
    )
    if framework_plan is not None:
        rank, fp, names = framework_plan
        slower = fp.step_time_s["total"] / plans[0].step_time_s["total"] - 1
        console.print(
            f"[bold]Best plan a framework runs:[/bold] #{rank} {fp.parallel.short()} "
            f"zero_stage={fp.parallel.zero_stage} recompute={fp.parallel.recompute}, "
            f"{fp.step_time_s['total']:.2f} s per step ({slower:+.1%}), on {', '.join(names)}",
            soft_wrap=True,
            highlight=False,
        )
    for line in budget_lines:
        console.print(f"[bold]Budget:[/bold] {line}", soft_wrap=True, highlight=False)
    if why:
        console.print(f"[bold]Why not {args.why_not}:[/bold]")
        for line in why:
            console.print(f"  {line}", soft_wrap=True, highlight=False)
    for path in written:
        console.print(f"wrote {path} (plan #{args.pick})", soft_wrap=True, highlight=False)
    return 0


def run_estimate(args: argparse.Namespace) -> int:
    from llmopt.plan.explain import explain, link_report
    from llmopt.plan.search import estimate, workload_for

    model, work, cluster = inputs(args)
    budget_flags = budget_inputs(args)
    par = build_plan(args, work, cluster)
    etp = getattr(args, "etp", None)
    if etp is not None and etp <= 0:
        raise UsageError(f"--etp={etp} must be a positive integer")
    plan = estimate(model, work, cluster, par, etp)
    work = workload_for(work, par)
    plan.explanation = explain(model, work, cluster, plan)
    links = link_report(model, work, cluster, par)
    budget, budget_lines = _budget(budget_flags, model, work, plan)
    if args.json:
        out = header(model, work, cluster)
        out["plan"] = plan.to_dict()
        out["collectives"] = links
        out.update(budget)
        print_json(out)
        return 0
    console = _console()
    console.print(plans_table([plan], f"{model.name}: estimate of {par.short()}"))
    if plan.rejected:
        console.print("[bold red]Invalid:[/bold red] " + "; ".join(plan.rejected), soft_wrap=True)
    for line in plan.explanation:
        console.print(f"  - {line}", soft_wrap=True, highlight=False)
    for line in budget_lines:
        console.print(f"[bold]Budget:[/bold] {line}", soft_wrap=True, highlight=False)
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from llmopt.plan.compare import compare

    model, work, cluster = inputs(args)
    results = compare(model, work, cluster, list(args.mappings))
    if args.plot:
        plot_breakdown([r.plan for r in results], [r.spec for r in results], args.plot, model.name)
    if args.json:
        out = header(model, work, cluster)
        out["mappings"] = [
            {
                "spec": r.spec,
                "plan": r.plan.to_dict(),
                "collectives": r.collectives,
                "verdict": r.verdict,
            }
            for r in results
        ]
        print_json(out)
        return 0
    console = _console()
    console.print(
        plans_table([r.plan for r in results], f"{model.name}: {' vs '.join(args.mappings)}")
    )
    for r in results:
        title = f"{r.spec}: collectives per GPU per step (last pipeline stage)"
        console.print(links_table(title, r.collectives))
        console.print(f"  {r.spec}: {r.verdict}", soft_wrap=True, highlight=False)
    return 0
