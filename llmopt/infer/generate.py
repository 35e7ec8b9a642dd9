"""Autoregressive generation of one prompt: the serving engine at batch 1.

There is one decode loop (`llmopt.infer.batch.ServingEngine`); `generate` sizes a paged cache for
prompt + max_new_tokens, feeds the whole prompt in one step, then one token (plus a proposer's
guesses when `draft` is given) per step. The runner is the fused CPU step whenever its kernels
build and the model's weights are kernel kinds, else the eager model over the same cache;
`fast=False` forces eager, `fast=True` fails with the reason instead of falling back.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from llmopt.errors import UsageError
from llmopt.infer.drafts import Draft, SpeculativeConfig
from llmopt.infer.sampling import SamplingParams

BLOCK_SIZE = 16


def check_context(model: nn.Module, prompt_len: int, max_new_tokens: int) -> None:
    """Fail early, naming the numbers, when prompt + generation cannot fit the context."""
    ctx = model.config.max_seq_len
    if prompt_len == 0:
        raise UsageError("the prompt is empty; generation needs at least one token")
    if prompt_len >= ctx:
        raise UsageError(
            f"prompt of {prompt_len} tokens is longer than the model context max_seq_len={ctx} "
            "(it must leave room for at least one new token)"
        )
    if prompt_len + max_new_tokens > ctx:
        raise UsageError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the model "
            f"context max_seq_len={ctx}; use max_new_tokens <= {ctx - prompt_len}"
        )


def runner_for(fast: bool | None) -> str:
    """The engine runner a `fast` setting asks for (None: the fused step when available)."""
    return {None: "auto", True: "fused", False: "eager"}[fast]


def decode_path(
    model: nn.Module, fast: bool | None, int8_head: bool = False
) -> tuple[str, str | None]:
    """("fused" | "eager", why the fused step is not used or None)."""
    if fast is False:
        return "eager", "eager requested"
    from llmopt.infer.fast import fused_unavailable

    reason = fused_unavailable(model, int8_head)
    if reason is None:
        return "fused", None
    if fast:
        raise UsageError(f"fast decode requested but unavailable: {reason}")
    return "eager", reason


def batch_one_engine(
    model: nn.Module,
    max_len: int,
    *,
    fast: bool | None = None,
    int8_head: bool = False,
    threads: int | None = None,
    speculative: SpeculativeConfig | None = None,
    prompt_len: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
):
    """An engine whose cache holds exactly one sequence of `max_len` tokens."""
    from llmopt.infer.batch import EngineConfig, ServingEngine

    speculative = speculative or SpeculativeConfig()
    config = EngineConfig(
        num_blocks=-(-max_len // BLOCK_SIZE),
        block_size=BLOCK_SIZE,
        max_num_seqs=1,
        max_batched_tokens=max(512, prompt_len + speculative.gamma_max + 1),
        prefix_caching=False,
        runner=runner_for(fast),
        threads=threads,
        int8_head=int8_head,
        speculative=speculative,
    )
    return ServingEngine(model, config, eos_token_id=eos_token_id)


@torch.inference_mode()
def generate(
    model: nn.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    on_token: Callable[[int], None] | None = None,
    fast: bool | None = None,
    int8_head: bool = False,
    threads: int | None = None,
    draft: Draft | None = None,
    speculative: SpeculativeConfig | None = None,
    stats: dict[str, Any] | None = None,
) -> list[int]:
    """New token ids after `prompt_ids` (the prompt is not repeated).

    Stops after `max_new_tokens` or right after emitting an id of `eos_token_id` (included).
    `on_token(id)` is called as each token is chosen, for streaming. A `seed` makes sampling
    reproducible; greedy decoding ignores it. `fast`: None = fused step when available, True =
    require it, False = eager. `int8_head` (fused step only) reads the output head as per-row
    INT8 codes: 4x fewer bytes than fp32, not exact. `draft`: speculate with this proposer
    (`speculative` sets its guesses per step). A `stats` dict receives the path taken and
    prefill/decode seconds (decode excludes the prefill that yields the first token), and the
    speculative counters under "speculative" when a draft ran.
    """
    if max_new_tokens < 0:
        raise UsageError(f"max_new_tokens={max_new_tokens} must be >= 0")
    prompt_ids = [int(t) for t in prompt_ids]
    check_context(model, len(prompt_ids), max_new_tokens)
    vocab = model.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise UsageError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if max_new_tokens == 0:
        return []
    engine = batch_one_engine(
        model,
        len(prompt_ids) + max_new_tokens,
        fast=fast,
        int8_head=int8_head,
        threads=threads,
        speculative=speculative,
        prompt_len=len(prompt_ids),
        eos_token_id=eos_token_id,
    )
    params = dataclasses.replace(
        sampling or SamplingParams(),
        max_tokens=max_new_tokens,
        seed=seed,
        ignore_eos=False,
        stop=(),
        ngram=0,
        num_speculative=(speculative or SpeculativeConfig()).gamma,
    )
    request = engine.add_request("generate", prompt_ids, params, draft=draft)
    t0 = time.perf_counter()
    t1, first = None, 0
    while not request.finished:
        for out in engine.step():
            if t1 is None and out.new_tokens:
                t1, first = time.perf_counter(), len(out.new_tokens)
            if on_token is not None:
                for token in out.new_tokens:
                    on_token(token)
    if stats is not None:
        stats.update(
            path=engine.runner.name,
            fallback_reason=engine.fused_reason,
            int8_head=int8_head and engine.runner.name == "fused",
            prefill_tokens=len(prompt_ids),
            prefill_s=(t1 or t0) - t0,
            decode_tokens=len(request.output) - first,
            decode_s=time.perf_counter() - (t1 or t0),
        )
        if request.spec is not None:
            stats["speculative"] = request.spec
    return request.output
