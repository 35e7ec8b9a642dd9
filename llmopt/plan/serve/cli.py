"""`llmopt plan serve`: predict (or, with a latency target, search) a serving deployment.

With no flags: Llama-3.1-8B on one H100, bf16 weights and KV, 1024 prompt / 256 output tokens,
32 concurrent clients. `--max-itl-ms` / `--max-ttft-ms` search TP and replicas on --num-gpus.
"""

from __future__ import annotations

import argparse
import math

from llmopt import jsonout
from llmopt.plan.serve.scenario import (
    KV_DTYPES,
    PRECISIONS,
    SCHEDULERS,
    Load,
    Scenario,
    ServeInputError,
)

DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_GPU = "h100"
DEFAULT_CONCURRENCY = 32
# flags that share a name with `llmopt plan`'s own options get a `serve_` dest so that the
# parent parser's defaults never leak into this subcommand
_DEST = {"model": "serve_model", "precision": "serve_precision", "json": "serve_json"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="KV capacity, batch, TTFT, ITL and tokens/s of a serving deployment",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--model", dest=_DEST["model"], default=DEFAULT_MODEL, help="preset name")
    p.add_argument("--gpu", default=DEFAULT_GPU, help="h100, h200, a100, b200, mi300x, ...")
    p.add_argument("--tp", type=int, default=None, help="default 1 (searched with a target)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks within tp (MoE)")
    p.add_argument("--num-gpus", type=int, default=None, help="whole deployment; default tp")
    p.add_argument("--precision", dest=_DEST["precision"], choices=PRECISIONS, default="bf16")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=None, help=f"default {DEFAULT_CONCURRENCY}")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, req/s")
    p.add_argument("--offline", action="store_true", help="all requests queued at once")
    p.add_argument("--max-itl-ms", type=float, default=None)
    p.add_argument("--max-ttft-ms", type=float, default=None)
    p.add_argument("--max-num-seqs", type=int, default=2048, help="scheduler batch cap")
    p.add_argument("--max-num-tokens", type=int, default=8192, help="tokens per iteration")
    p.add_argument("--kv-fraction", type=float, default=0.9, help="of memory left after weights")
    p.add_argument(
        "--scheduler",
        choices=SCHEDULERS,
        default="mixed",
        help="mixed: prompt chunks ride with decodes (vLLM, TRT-LLM); prefill-first: SGLang",
    )
    p.add_argument("--multi-step", type=int, default=1, help="decode steps per scheduling round")
    p.add_argument("--num-requests", type=int, default=1000, help="requests replayed at a rate")
    p.add_argument("--spec-tokens", type=int, default=0, help="speculative draft length k")
    p.add_argument("--spec-acceptance", type=float, default=0.0, help="per-token acceptance α")
    p.add_argument("--draft-cost", type=float, default=0.0, help="draft step / target step (c)")
    p.add_argument("--json", dest=_DEST["json"], action="store_true")
    p.set_defaults(func=run_serve)
    return p


def load_from_flags(concurrency: int | None, rate: float | None, offline: bool) -> Load:
    """Exactly one of the three load flags (none: the default concurrency)."""
    given = [
        n for n, v in (("--concurrency", concurrency), ("--request-rate", rate)) if v is not None
    ]
    if offline:
        given.append("--offline")
    if len(given) > 1:
        raise ServeInputError(
            f"{' and '.join(given)} are exclusive; give one of --concurrency N, "
            "--request-rate R, --offline"
        )
    if offline:
        return Load("offline")
    if rate is not None:
        return Load("rate", rate)
    return Load("concurrency", float(DEFAULT_CONCURRENCY if concurrency is None else concurrency))


def resolve(model_name: str, gpu_name: str, num_gpus: int):
    """The model preset and a cluster of enough nodes of `gpu_name` for `num_gpus` GPUs."""
    from llmopt.models.presets import PRESETS, get_preset
    from llmopt.plan.hardware import CLUSTER_ALIASES, CLUSTER_PRESETS, get_cluster

    try:
        model = get_preset(model_name)
    except KeyError:
        raise ServeInputError(
            f"unknown model {model_name!r}; known: {', '.join(sorted(PRESETS))}"
        ) from None
    key = CLUSTER_ALIASES.get(gpu_name.lower(), gpu_name.lower())
    if key not in CLUSTER_PRESETS:
        raise ServeInputError(
            f"unknown GPU {gpu_name!r}; known: {', '.join(CLUSTER_ALIASES)} or a cluster "
            f"preset ({', '.join(CLUSTER_PRESETS)})"
        )
    per_node = CLUSTER_PRESETS[key][3]
    return model, get_cluster(key, max(1, math.ceil(num_gpus / per_node)))


def run_serve(args: argparse.Namespace) -> int:
    from llmopt.plan.serve.estimate import estimate
    from llmopt.plan.serve.render import estimate_lines, search_lines, write
    from llmopt.plan.serve.search import search

    if args.tp is not None and args.tp <= 0:  # `args.tp or 1` would read 0 as "not given"
        raise ServeInputError(f"--tp={args.tp} must be a positive integer (GPUs per replica)")
    searching = args.max_itl_ms is not None or args.max_ttft_ms is not None
    searching |= args.tp is None and args.num_gpus is not None
    tp = 1 if args.tp is None else args.tp
    num_gpus = args.num_gpus if args.num_gpus is not None else tp
    base = Scenario(
        precision=getattr(args, _DEST["precision"]), kv_dtype=args.kv_dtype, tp=tp, ep=args.ep,
        num_gpus=None if searching else num_gpus, input_len=args.input_len,
        output_len=args.output_len,
        load=load_from_flags(args.concurrency, args.request_rate, args.offline),
        max_num_seqs=args.max_num_seqs, max_num_tokens=args.max_num_tokens,
        kv_fraction=args.kv_fraction, spec_tokens=args.spec_tokens, scheduler=args.scheduler,
        multi_step=args.multi_step, num_requests=args.num_requests,
        spec_acceptance=args.spec_acceptance, spec_draft_cost=args.draft_cost,
    )  # fmt: skip
    model, cluster = resolve(getattr(args, _DEST["model"]), args.gpu, num_gpus)
    as_json = getattr(args, _DEST["json"])
    if not searching:
        est = estimate(model, cluster, base)
        write([jsonout.dumps(est.to_dict(), indent=1)] if as_json else estimate_lines(est))
        return 0
    result = search(model, cluster, base, num_gpus, args.max_itl_ms, args.max_ttft_ms)
    lines = search_lines(result, args.max_itl_ms, args.max_ttft_ms)
    write([jsonout.dumps(result.to_dict(), indent=1)] if as_json else lines)
    return 0 if result.best else 1
