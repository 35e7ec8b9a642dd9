"""`llmopt distill`: train a student on a teacher's soft targets (KL at temperature T, mixed
with the LM loss), with the trainer (DP/ZeRO on torchrun), resumable.

    llmopt distill --teacher smollm2-135m --student init:teacher-layers=0,1,29 \\
        --text corpus:web-bible --steps 200 --seq-len 256 --out runs/draft3

`--feature-head` trains an EAGLE-style feature draft head instead (no --student): the
teacher's own features over --text and its own continuations of prompts from it
(`llmopt.compress.distill.feature`); `llmopt generate --draft <out>/head` uses it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmopt.compress.distill.objective import DistillConfigError
from llmopt.compress.distill.run import DistillSettings, distill
from llmopt.compress.distill.student import STUDENT_SPECS
from llmopt.train.config import FIELD_HELP, TrainConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "distill",
        help="distil a teacher into a student (KL at temperature T + LM loss)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--teacher", required=True, help="teacher model spec (name, .gguf, dir)")
    p.add_argument("--student", default=None, help=f"student: {STUDENT_SPECS}")
    p.add_argument(
        "--feature-head",
        action="store_true",
        help="train a feature draft head (one layer over the teacher's features) instead of "
        "a student; --draft-vocab sets its vocabulary (default 8192)",
    )
    p.add_argument(
        "--windows", type=int, default=400, help="--feature-head: text windows of --seq-len"
    )
    p.add_argument(
        "--generations",
        type=int,
        default=40,
        help="--feature-head: prompts from the text the teacher continues (its own outputs)",
    )
    p.add_argument("--text", default="corpus:web-bible", help="corpus:NAME or a text file")
    p.add_argument("--out", required=True, help="output directory (not the teacher's)")
    p.add_argument("--temperature", type=float, default=1.0, help="KD temperature T (> 0)")
    p.add_argument("--alpha", type=float, default=0.5, help="weight of T²·KL; 1-alpha: LM loss")
    p.add_argument("--steps", type=int, default=200, help=FIELD_HELP["steps"])
    p.add_argument("--seq-len", type=int, default=256, help=FIELD_HELP["seq_len"])
    p.add_argument("--global-batch", type=int, default=4, help=FIELD_HELP["global_batch"])
    p.add_argument("--micro-batch", type=int, default=2, help=FIELD_HELP["micro_batch"])
    p.add_argument("--lr", type=float, default=5e-4, help=FIELD_HELP["lr"])
    p.add_argument("--min-lr", type=float, default=5e-5, help=FIELD_HELP["min_lr"])
    p.add_argument("--warmup-steps", type=int, default=10, help=FIELD_HELP["warmup_steps"])
    p.add_argument("--zero-stage", type=int, default=0, help="ZeRO stage 0-3 (data parallel)")
    p.add_argument("--precision", default="fp32", help="fp32 or bf16 (the student's compute)")
    p.add_argument("--max-chars", type=int, default=None, help="read at most this much text")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0, help=FIELD_HELP["seed"])
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an --out holding a run: replace what a run writes there "
        "(checkpoints, log, plot, model), keep other files",
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="data-parallel processes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="K",
        help="make <out>/model a speculative draft that scores only the K most frequent tokens "
        "of the text (a K-row head; verification stays exact)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=handle)


def train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        corpus=args.text,
        max_chars=args.max_chars,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        steps=args.steps,
        lr=args.lr,
        min_lr=args.min_lr,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        out_dir=args.out,
        save_every=args.save_every,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    ).replace(zero_stage=args.zero_stage, precision=args.precision)


def handle(args: argparse.Namespace) -> int:
    if args.draft_vocab is not None and args.draft_vocab < 1:
        raise DistillConfigError(f"--draft-vocab {args.draft_vocab} must be a positive token count")
    if args.feature_head:
        return _feature_head(args)
    if args.student is None:
        raise DistillConfigError(
            f"--student is required (or --feature-head); valid: {STUDENT_SPECS}"
        )
    settings = DistillSettings(args.teacher, args.student, args.temperature, args.alpha)
    summary = distill(settings, train_config(args), nproc=args.nproc_per_node)
    if "returncode" in summary:
        if summary["returncode"]:
            return int(summary["returncode"])
        summary["model"] = str(Path(args.out) / "model")
    if args.draft_vocab is not None:
        from llmopt.compress.distill.draft import write_draft_vocab

        vocab = write_draft_vocab(
            summary["model"], args.text, args.teacher, args.draft_vocab, max_chars=args.max_chars
        )
        summary["draft_vocab"] = json.loads(vocab.read_text())["coverage"]
        if not args.json:
            print(
                f"draft vocabulary: {args.draft_vocab} tokens cover "
                f"{summary['draft_vocab']:.2%} of the text ({vocab})"
            )
    if "returncode" in summary:
        return 0
    if args.json:
        print(json.dumps(summary))
    else:
        kl = [k for k in summary["kd_kl"] if k is not None]
        first, last = summary["start_step"] + 1, summary["start_step"] + len(summary["losses"])
        print(
            f"distilled steps {first}..{last}: loss {summary['first_loss']} -> "
            f"{summary['last_loss']}; KL {kl[0] if kl else None} -> {kl[-1] if kl else None}; "
            f"model {summary['model']}"
        )
    return 0


def _feature_head(args: argparse.Namespace) -> int:
    from llmopt.compress.distill.feature import FeatureTrainConfig, train_on_text
    from llmopt.compress.distill.run import check_out

    if args.student is not None:
        raise DistillConfigError("--feature-head trains a head, not a --student; drop one of them")
    cfg = FeatureTrainConfig(
        draft_vocab=args.draft_vocab or 8192, seq_len=args.seq_len, steps=args.steps,
        batch=args.global_batch, lr=args.lr, min_lr=args.min_lr,
        warmup=max(1, args.warmup_steps), save_every=args.save_every or 100, seed=args.seed,
    )  # fmt: skip
    out = check_out(args.out, args.teacher)
    summary = train_on_text(
        args.teacher, args.text, out, cfg, windows=args.windows, generations=args.generations,
        resume=args.resume, quiet=args.json,
    )  # fmt: skip
    print(json.dumps(summary) if args.json else f"feature head: {summary['head']} "
          f"(step {summary['step']}, eval top-1 agreement {summary.get('eval_top1')})")  # fmt: skip
    return 0
