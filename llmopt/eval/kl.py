"""KL divergence of a model's next-token distributions from a reference model's.

The statistics llama.cpp's `llama-perplexity --kl-divergence` reports, which is how quantized
and pruned models are judged against their original: per-token KL(ref || model) summarised by
mean, median and 99th percentile; how often both put the same token on top; and the RMS of the
change in the probability of the token that actually comes next (Δp).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmopt.errors import UsageError
from llmopt.eval.perplexity import as_token_tensor, check_window_args, window_logprobs, windows
from llmopt.models.llama import Transformer


@dataclass(frozen=True)
class KLResult:
    mean: float  # nats
    median: float
    p99: float
    top1_agreement: float  # fraction of positions whose argmax tokens agree
    rms_delta_p: float  # RMS of p_model(next) - p_ref(next)
    tokens: int
    ppl: float = math.nan  # the model's perplexity on the same windows
    ref_ppl: float = math.nan
    tokens_per_s: float = math.nan


@torch.inference_mode()
def kl_divergence(
    model: Transformer,
    ref_model: Transformer,
    token_ids,
    *,
    ctx: int = 512,
    stride: int | None = None,
    max_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> KLResult:
    """KL(ref || model) statistics over the perplexity windows (stride defaults to ctx // 2)."""
    stride = stride or max(1, ctx // 2)
    tokens = as_token_tensor(token_ids, max_tokens)
    n = tokens.numel()
    for m in (model, ref_model):
        check_window_args(m, n, ctx, stride)
    if model.config.vocab_size != ref_model.config.vocab_size:
        raise UsageError(
            f"vocabularies differ: model has {model.config.vocab_size} tokens, reference "
            f"{ref_model.config.vocab_size}; KL needs the same tokenizer"
        )
    if int(tokens.max()) >= model.config.vocab_size or int(tokens.min()) < 0:
        raise UsageError(f"token ids must be in [0, {model.config.vocab_size})")
    kls, delta_p = [], []
    agree = 0
    nll = ref_nll = 0.0
    start = time.perf_counter()
    for window in windows(n, ctx, stride):
        lp = window_logprobs(model, tokens, window)
        ref_lp = window_logprobs(ref_model, tokens, window).to(lp.device)
        targets = tokens[window.score_from : window.end].to(lp.device)[:, None]
        ref_p = ref_lp.exp()
        kls.append((ref_p * (ref_lp - lp)).sum(-1).clamp_min(0.0).cpu())
        agree += int((lp.argmax(-1) == ref_lp.argmax(-1)).sum())
        lp_next, ref_lp_next = lp.gather(1, targets)[:, 0], ref_lp.gather(1, targets)[:, 0]
        delta_p.append((lp_next.exp() - ref_lp_next.exp()).cpu())
        nll -= lp_next.sum().item()
        ref_nll -= ref_lp_next.sum().item()
        if progress is not None:
            progress(sum(k.numel() for k in kls), n - 1)
    seconds = time.perf_counter() - start
    kl = torch.cat(kls).double()
    dp = torch.cat(delta_p).double()
    count = kl.numel()
    return KLResult(
        mean=kl.mean().item(),
        median=kl.median().item(),
        p99=torch.quantile(kl, 0.99).item(),
        top1_agreement=agree / count,
        rms_delta_p=dp.pow(2).mean().sqrt().item(),
        tokens=count,
        ppl=math.exp(nll / count),
        ref_ppl=math.exp(ref_nll / count),
        tokens_per_s=count / seconds if seconds > 0 else float("inf"),
    )
