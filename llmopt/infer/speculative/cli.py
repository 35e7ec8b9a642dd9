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
        "--tree",
        metavar="DxKxN",
        default="3x2x4",
        help="with a feature-head --draft: expansion depth D, top-K per node, N nodes "
        "verified per pass (DxK... 'D x 1 x D' is a chain; default 3x2x4)",
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
    from llmopt.models.feature_head import is_feature_head

    if is_feature_head(args.draft):
        return _run_feature_head(args, model, tokenizer, prompt_ids, sampling)
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


def parse_tree(text: str):
    """`DxKxN` -> TreeConfig(depth=D, top_k=K, budget=N)."""
    from llmopt.infer.speculative.tree_decode import TreeConfig

    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise UsageError(f"--tree {text!r}: want DEPTHxTOPKxBUDGET, e.g. 3x2x4")
    return TreeConfig(*(int(p) for p in parts))


def _run_feature_head(args, model, tokenizer, prompt_ids, sampling):
    """`--draft DIR` naming a feature head: tree speculation on the fused kernels."""
    import torch

    from llmopt.infer.fast import FastDecoder
    from llmopt.infer.speculative.tree_decode import FeatureTreeDecoder, calibrate_tree
    from llmopt.models.feature_head import load_feature_head

    tree = parse_tree(args.tree)
    head = load_feature_head(args.draft, model)
    eos_ids = (
        None if getattr(args, "ignore_eos", False) else getattr(tokenizer, "eos_token_ids", None)
    )
    eos = tuple(eos_ids) if eos_ids else None
    n = args.max_new_tokens
    max_len = min(model.config.max_seq_len, len(prompt_ids) + n + tree.depth + 2)
    seed = getattr(args, "seed", None)
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    decoder = FeatureTreeDecoder(model, head, max_len, tree)
    ids = decoder.generate(prompt_ids, n, sampling, gen, eos)
    if not getattr(args, "stats", False):
        return ids, {}
    stats = decoder.stats.to_dict()
    if sampling.greedy:  # plain decoding on the same kernels, for the speedup and identity
        want, plain_s = FastDecoder(model, max_len).greedy(prompt_ids, len(ids))
        stats["identical_to_plain"] = want == ids
        stats["measured_speedup"] = plain_s / stats["decode_s"] if stats["decode_s"] else None
    costs = calibrate_tree(FeatureTreeDecoder(model, head, max_len, tree), prompt_ids)
    stats["costs"] = costs.to_dict()
    stats["predicted_speedup"] = costs.predict(
        decoder.stats.tokens_per_pass, tree.depth, tree.budget
    )
    stats["tree"] = {"depth": tree.depth, "top_k": tree.top_k, "budget": tree.budget}
    return ids, stats
