"""`llmopt generate --draft ...`: flags and their translation into the speculative API."""

from __future__ import annotations

import argparse
from typing import Any

from llmopt.errors import UsageError
from llmopt.infer.drafts import DRAFT_SPECS, SpeculativeConfig, make_draft
from llmopt.infer.sampling import SamplingParams
from llmopt.infer.speculative.loop import speculative_generate
from llmopt.infer.speculative.measure import calibrate, compare_with_plain
from llmopt.models.llama import Transformer


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """`--draft/--gamma/--adaptive-gamma/--stats` for `llmopt generate`."""
    group = parser.add_argument_group("speculative decoding")
    group.add_argument(
        "--draft",
        metavar="SPEC",
        default=None,
        help=f"decode speculatively with this draft: {DRAFT_SPECS}",
    )
    group.add_argument(
        "--gamma", type=int, default=4, help="draft tokens verified per target pass (default 4)"
    )
    group.add_argument(
        "--adaptive-gamma",
        action="store_true",
        help="grow gamma after a fully accepted round, shrink it after a rejection",
    )
    group.add_argument(
        "--stats",
        action="store_true",
        help="also run plain decoding and report acceptance, costs, measured and predicted "
        "speedup and the optimal gamma (JSON with --json)",
    )


def run_speculative_from_args(
    args: argparse.Namespace,
    model: Transformer,
    tokenizer,
    prompt_ids: list[int],
    sampling: SamplingParams,
) -> tuple[list[int], dict[str, Any]]:
    """Run `llmopt generate --draft ...`: (new token ids, statistics dict, empty without --stats).

    Reads args.draft, args.gamma, args.adaptive_gamma, args.stats, args.max_new_tokens and,
    when present, args.seed and args.ignore_eos.
    """
    if not args.draft:
        raise UsageError(f"--draft is required for speculative decoding; valid: {DRAFT_SPECS}")
    if args.gamma < 1:
        raise UsageError(f"--gamma {args.gamma} must be >= 1")
    config = SpeculativeConfig(
        gamma=args.gamma, adaptive=args.adaptive_gamma, gamma_max=max(12, args.gamma)
    )
    draft = make_draft(args.draft, model, tokenizer)
    eos = None if getattr(args, "ignore_eos", False) else getattr(tokenizer, "eos_token_ids", None)
    run = {
        "max_new_tokens": args.max_new_tokens,
        "sampling": sampling,
        "config": config,
        "seed": getattr(args, "seed", None),
        "eos_token_id": eos,
    }
    if not getattr(args, "stats", False):
        return speculative_generate(model, draft, prompt_ids, **run).tokens, {}
    result, comparison = compare_with_plain(model, draft, prompt_ids, **run)
    calibrate(result, model, draft=draft)
    stats = comparison.to_dict()
    stats["sampling"] = {
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
    }
    return result.tokens, stats
