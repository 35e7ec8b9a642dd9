"""`llmopt plan`: rank parallel mappings (default), `estimate` one, `compare` several;
`--emit FILE` writes the chosen plan as a run config (llmopt, Megatron-LM, NeMo/Megatron-Bridge,
torchtitan or DeepSpeed).

With no arguments: Llama-3-70B on 8 DGX-H100 nodes, sequence 4096, global batch 1024
sequences, bf16. Flags use the trainer's names (--num-layers, --zero-stage, ...).
"""

from __future__ import annotations

import argparse
from typing import Any

from llmopt.errors import UsageError
from llmopt.parallel.plan import FP8_RECIPES, RECOMPUTES, REDUCE_DTYPES, SCHEDULES
from llmopt.plan.cli.inputs import DEFAULT_NODES, add_budget_flags
from llmopt.plan.flops import FLOPS_CONVENTIONS
from llmopt.plan.objectives import OBJECTIVES

DEFAULT_MODEL = "llama-3-70b"
DEFAULT_CLUSTER = "dgx-h100"
DEFAULT_COMPARE = ("tp=8,pp=8", "tp=16,pp=4", "dp=64,zero_stage=3")
EMIT_FORMATS = ("llmopt", "megatron", "nemo", "torchtitan", "deepspeed")


def _common(p: argparse.ArgumentParser, sub: bool) -> None:
    """Options shared by plan/estimate/compare. On subcommands the defaults are suppressed so a
    value given before the subcommand name is not overwritten."""

    def d(value: Any) -> Any:
        return argparse.SUPPRESS if sub else value

    m = p.add_argument_group("model")
    m.add_argument("--model", default=d(DEFAULT_MODEL), help="preset name or HF config.json/dir")
    for name, text in (
        ("num-layers", "explicit shape fields override the model"),
        ("hidden-size", None),
        ("num-heads", None),
        ("num-kv-heads", None),
        ("intermediate-size", "MLP intermediate size"),
        ("vocab-size", None),
        ("num-experts", "routed experts per MoE block (a MoE model)"),
        ("expert-ffn-hidden", "expert MLP width (a MoE model)"),
    ):
        m.add_argument(f"--{name}", type=int, default=d(None), help=text)
    m.add_argument("--activation", dest="mlp_kind", choices=("swiglu", "gelu"), default=d(None))
    m.add_argument("--tied", action="store_true", default=d(None), help="tied embeddings")
    c = p.add_argument_group("cluster")
    c.add_argument(
        "--cluster",
        default=d(DEFAULT_CLUSTER),
        help="a preset (dgx-a100-40gb, dgx-a100-80gb, dgx-h100, h100-pcie, dgx-h800, dgx-h200, "
        "dgx-b200, gb200-nvl72, mi300x) or a TOML file",
    )
    c.add_argument(
        "--nodes", type=int, default=d(None),
        help=f"default: the cluster file's nodes, else {DEFAULT_NODES}",
    )  # fmt: skip
    c.add_argument("--gpus-per-node", type=int, default=d(None))
    c.add_argument("--peak-tflops", type=float, default=d(None), help="dense bf16")
    c.add_argument("--fp8-tflops", type=float, default=d(None))
    c.add_argument("--hbm-gib", type=float, default=d(None))
    c.add_argument("--hbm-gbs", type=float, default=d(None), help="HBM GB/s")
    c.add_argument("--nvlink-gbs", type=float, default=d(None), help="per GPU, per direction")
    c.add_argument("--ib-gbs", type=float, default=d(None), help="per GPU, per direction")
    c.add_argument("--gemm-efficiency", type=float, default=d(None))
    w = p.add_argument_group("workload")
    w.add_argument("--seq-len", type=int, default=d(4096))
    w.add_argument("--global-batch", type=int, default=d(1024), help="sequences")
    w.add_argument("--global-batch-tokens", type=int, default=d(None))
    w.add_argument("--precision", choices=("bf16", "fp8"), default=d("bf16"))
    w.add_argument(
        "--reduce-dtype",
        choices=REDUCE_DTYPES,
        default=d(None),
        help="fp32: fp32 gradients (18 B/param); bf16: bf16 gradients (16 B/param); default: "
        "the --framework's (fp32; bf16 for nemo and deepspeed)",
    )
    w.add_argument(
        "--moments", choices=("fp32", "bf16"), default=d(None),
        help="Adam moment dtype (bf16 saves 4 B/param); default: fp32, bf16 for the recipes "
        "that set it (Megatron-Bridge's DeepSeek-V3)",
    )  # fmt: skip
    w.add_argument("--no-flash", action="store_true", default=d(False))
    w.add_argument(
        "--flops-convention", choices=FLOPS_CONVENTIONS, default=d("causal"),
        help="how MFU counts attention: causal (default), megatron (full s^2), palm (6N+12LHQT)",
    )  # fmt: skip
    w.add_argument("--expert-imbalance", type=float, default=d(1.0), help="MoE busiest/mean load")
    w.add_argument(
        "--ep-dispatcher", choices=("alltoall", "deepep", "hybridep"), default=d("alltoall"),
        help="MoE token dispatcher: NCCL all-to-all, DeepEP or HybridEP (one network copy per "
        "destination node)",
    )  # fmt: skip
    w.add_argument(
        "--ep-overlap", action="store_true", default=d(False),
        help="hide dispatch/combine behind the other micro-batch's compute (Megatron-Core "
        "--overlap-moe-expert-parallel-comm)",
    )  # fmt: skip
    w.add_argument(
        "--dualpipe", action="store_true", default=d(False),
        help="DeepSeek's DualPipe schedule: half the bubble, two weight copies, EP comm hidden",
    )  # fmt: skip
    w.add_argument("--tp-comm-overlap", action="store_true", default=d(False))
    w.add_argument("--no-dp-overlap", action="store_true", default=d(False))
    w.add_argument("--lora-rank", type=int, default=d(0), help="LoRA fine-tuning: adapter rank")
    w.add_argument("--qlora", action="store_true", default=d(False), help="frozen base in INT4")
    add_budget_flags(p.add_argument_group("budget and failures"), d)
    p.add_argument("--json", action="store_true", default=d(False), help="machine-readable output")
    p.add_argument("--plot", default=d(None), metavar="PNG", help="step-time breakdown chart")


def _plan_flags(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--top-k", type=int, default=10)
    plan.add_argument(
        "--why-not", default=None, metavar="SPEC",
        help="e.g. tp=16 or tp=8,pp=1,zero_stage=3: why no top plan uses these settings",
    )  # fmt: skip
    plan.add_argument(
        "--where", default=None, metavar="SPEC",
        help="rank only plans with these settings, e.g. tp=2,pp=2,sequence_parallel=false",
    )  # fmt: skip
    plan.add_argument(
        "--framework", choices=EMIT_FORMATS, default="llmopt",
        help="rank only plans this framework can run (its rules: llmopt/plan/frameworks.py)",
    )  # fmt: skip
    plan.add_argument(
        "--objective", choices=OBJECTIVES, default="time",
        help="minimise step time, inter-node bytes per GPU, memory per GPU, or GPUs used",
    )  # fmt: skip
    plan.add_argument(
        "--require", action="append", default=[], metavar="EXPR",
        help="hard limit, repeatable: zero_stage<=2, tp<=8, mem<=70GiB, no-forward-allgather "
        "(no ZeRO-3 weight all-gathers), tp-in-node",
    )  # fmt: skip
    plan.add_argument("--emit", default=None, metavar="FILE", help="write the plan as a config")
    plan.add_argument("--pick", type=int, default=1, help="rank of the plan --emit writes")
    plan.add_argument(
        "--emit-format", choices=EMIT_FORMATS, default=None,
        help="default: a framework named in FILE (x.megatron.sh) or llmopt (TOML/JSON by suffix)",
    )  # fmt: skip


def _estimate_flags(est: argparse.ArgumentParser) -> None:
    for name in ("tp", "pp", "cp", "micro-batch"):
        est.add_argument(f"--{name}", type=int, default=1)
    est.add_argument("--dp", type=int, default=None, help="default: GPUs / (tp*pp*cp)")
    est.add_argument("--ep", type=int, default=1, help="expert parallel (MoE), divides dp*cp")
    est.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default tp)")
    est.add_argument("--num-microbatches", type=int, default=None)
    est.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=False)
    est.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    est.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    est.add_argument("--virtual-stages", type=int, default=1)
    est.add_argument("--recompute", choices=RECOMPUTES, default="none")
    est.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="current")


def check_args(args: argparse.Namespace) -> None:
    """Every flag of `plan`, `plan estimate` and `plan compare` checked before the search."""
    from llmopt.plan.cli.inputs import build_plan, inputs
    from llmopt.plan.objectives import parse_require
    from llmopt.plan.rules import parse_constraints

    command = getattr(args, "plan_command", None)
    if command not in (None, "estimate", "compare"):  # e.g. `plan serve`: its own checks
        return
    _, work, cluster = inputs(args)
    if command == "estimate":
        build_plan(args, work, cluster)
    elif command is None:
        for flag in ("top_k", "pick"):
            if getattr(args, flag) <= 0:
                raise UsageError(
                    f"--{flag.replace('_', '-')}={getattr(args, flag)} must be positive"
                )
        given = [
            ("--why-not", args.why_not, parse_constraints),
            ("--where", args.where, parse_constraints),
        ]
        given += [("--require", expr, parse_require) for expr in args.require]
        for flag, spec, parse in given:
            if spec is None:
                continue
            if not spec.strip():  # an empty spec would silently mean "no constraint"
                raise UsageError(
                    f"{flag} {spec!r} names no setting; give key=value pairs such as tp=8,pp=2"
                )
            try:
                parse(spec)
            except ValueError as exc:  # name the flag unless the parser's message does
                if flag in str(exc):
                    raise
                raise UsageError(f"{flag} {spec!r}: {exc}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    from llmopt.plan.cli import run as cli_run

    plan = subparsers.add_parser(
        "plan",
        help="choose and explain the parallel mapping of a model on a cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # no prefix matching: `plan serve --gpu` must not be read as an abbreviation of the
        # plan options --gpus-per-node / --gpu-hour-price / --gpu-mtbf-hours
        allow_abbrev=False,
    )
    _common(plan, sub=False)
    _plan_flags(plan)
    plan.set_defaults(func=cli_run.run_plan, check=check_args)
    sub = plan.add_subparsers(dest="plan_command", metavar="{estimate,compare,serve}")
    est = sub.add_parser("estimate", help="evaluate one fully specified mapping")
    _common(est, sub=True)
    _estimate_flags(est)
    est.set_defaults(func=cli_run.run_estimate)
    cmp = sub.add_parser("compare", help="evaluate several mappings side by side")
    _common(cmp, sub=True)
    cmp.add_argument(
        "mappings", nargs="*", default=list(DEFAULT_COMPARE),
        help=f"mapping specs (unset fields chosen by the planner); default: {' '.join(DEFAULT_COMPARE)}",
    )  # fmt: skip
    cmp.set_defaults(func=cli_run.run_compare)
    from llmopt.plan.serve.cli import add_parser as add_serve

    add_serve(sub)
