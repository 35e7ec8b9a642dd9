"""`llmopt train`: launch the trainer under torchrun (or in this process for one rank).

`llmopt train --nproc-per-node 2 --config run.toml --steps 50` resolves the configuration
(defaults < file < flags), writes it to `<out_dir>/run_config.json` and runs
`python -m torch.distributed.run --nproc-per-node 2 -m llmopt.train --config <that file>`:
torchrun is the launcher (and its multi-node flags the scale-out path); there is no home-made
one. `python -m llmopt.train` is what each torchrun worker runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmopt.artifacts import atomic_write_text
from llmopt.jsonout import dumps
from llmopt.train.config import TrainConfig, TrainConfigError
from llmopt.train.flags import add_config_arguments, config_from_args
from llmopt.train.launch import launch_env, run_job, torchrun_command
from llmopt.train.rundir import check_run_dir
from llmopt.train.shapes import check_layout


def _worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llmopt.train",
        allow_abbrev=False,
        description="One training worker (run it through torchrun).",
    )
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON summary on rank 0")
    return parser


def _summary(result, cfg: TrainConfig) -> dict:
    return {
        "steps_done": len(result.losses),
        "start_step": result.start_step,
        "first_loss": result.losses[0] if result.losses else None,
        "last_loss": result.losses[-1] if result.losses else None,
        "losses": result.losses,
        "checkpoint": result.checkpoint,
        "log_file": result.log_file,
        "comm_last_step": result.comm_per_step,
        "out_dir": cfg.out_dir,
    }


def run_worker(args: argparse.Namespace) -> int:
    import os

    import torch.distributed as dist

    from llmopt.train.trainer import train

    cfg = config_from_args(args)
    result = train(cfg)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        summary = _summary(result, cfg)
        if args.json:
            print(dumps(summary))
        else:
            print(
                f"trained steps {result.start_step + 1}..{result.start_step + len(result.losses)}"
                f": loss {summary['first_loss']} -> {summary['last_loss']}; "
                f"log {result.log_file}; checkpoint {result.checkpoint}"
            )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def main_worker(argv: list[str] | None = None) -> int:
    args = _worker_parser().parse_args(argv)
    try:
        return run_worker(args)
    except Exception as exc:  # the boundary of `llmopt`: input errors in one line, bugs traced
        from llmopt.cli import fail

        return fail("train", exc)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="distributed training (TP/SP/PP/DP/ZeRO) launched by torchrun",
        description=__doc__.split("\n\n")[0],
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--nproc-per-node", type=int, default=1, help="processes per node (torchrun)"
    )
    parser.add_argument("--nnodes", default="1", help="torchrun --nnodes (e.g. 2 or 1:4)")
    parser.add_argument("--node-rank", type=int, default=None, help="torchrun --node-rank")
    parser.add_argument("--master-addr", default=None, help="torchrun --master-addr")
    parser.add_argument("--master-port", type=int, default=None, help="torchrun --master-port")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.set_defaults(func=handle)


def check_nnodes(value: str) -> None:
    """torchrun's --nnodes: N, or MIN:MAX for an elastic job (positive, MIN <= MAX)."""
    parts = str(value).split(":")
    ok = 1 <= len(parts) <= 2 and all(p.isdigit() and int(p) >= 1 for p in parts)
    if not ok or (len(parts) == 2 and int(parts[0]) > int(parts[1])):
        raise TrainConfigError(
            f"--nnodes {value!r} must be a node count N or an elastic range MIN:MAX of "
            "positive integers (e.g. 2 or 1:4)"
        )


def handle(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # validates before anything is launched
    check_nnodes(args.nnodes)
    if args.nproc_per_node < 1:
        raise TrainConfigError(f"--nproc-per-node={args.nproc_per_node} must be >= 1")
    single = args.nproc_per_node == 1 and str(args.nnodes) == "1"
    where = args.config or "the flags"
    if str(args.nnodes).isdigit():  # a fixed world: the layout, batch and model must fit it
        check_layout(cfg, args.nproc_per_node * int(args.nnodes), where)
    if single:
        return run_worker(args)
    out = Path(cfg.out_dir)
    check_run_dir(out, cfg.resume, cfg.overwrite, cfg.steps)  # before torchrun starts
    out.mkdir(parents=True, exist_ok=True)
    config_file = out / "run_config.json"
    atomic_write_text(config_file, dumps(cfg.to_dict(), indent=1))
    target = ["-m", "llmopt.train", "--config", str(config_file)]
    if args.json:
        target.append("--json")
    cmd = torchrun_command(
        target,
        args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )
    return run_job(cmd, env=launch_env())  # a signal to us stops torchrun and its workers
