"""Draft proposers for speculative decoding.

A draft guesses the next few tokens cheaply; the target then checks them all in one pass.
Four kinds, from "needs a second model" to "needs nothing":

- `ModelDraft`: any causal LM with the target's vocabulary (a smaller model, or the target's
  own INT8/INT4 copy made by `llmopt.compress.quant.quantize_model`),
- `EarlyExitModel`: the target's first k layers plus its final norm and head, sharing weights
  (a self-draft with no extra memory),
- a distilled draft directory (`llmopt distill`) with `llmopt_draft_vocab.json` is a
  `ModelDraft` whose head scores only its frequent tokens (`llmopt.compress.distill.draft`),
- `NGramDraft`: prompt lookup — copy what followed the last occurrence of the current suffix.

Drafts are stateless towards the caller: `propose` receives the full committed context and
brings its own KV cache in line with it (longest common prefix + rollback), so the decoding
loop never has to tell a draft which of its guesses were rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from llmopt.errors import UsageError
from llmopt.infer.sampling import SamplingParams, logits_to_probs, sample
from llmopt.models.llama import KVCache, Transformer
from llmopt.models.spec import spec_for


@dataclass(frozen=True)
class SpeculativeConfig:
    """How many guesses a proposer is asked for: γ; adaptive γ grows by one after a fully
    accepted round and shrinks by one after a rejection, within [gamma_min, gamma_max]."""

    gamma: int = 4
    adaptive: bool = False
    gamma_min: int = 1
    gamma_max: int = 12

    def __post_init__(self) -> None:
        values = (self.gamma_min, self.gamma, self.gamma_max)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise UsageError(f"gamma values must be integers, got {values}")
        if not 1 <= self.gamma_min <= self.gamma <= self.gamma_max:
            raise UsageError(
                f"need 1 <= gamma_min={self.gamma_min} <= gamma={self.gamma} <= "
                f"gamma_max={self.gamma_max}"
            )


@dataclass
class Proposal:
    """Draft tokens and the draft distributions they were drawn from.

    `probs` is [len(tokens), vocab] in sampling mode for model drafts; None means the draft is
    deterministic (greedy mode, or the n-gram draft), i.e. q is one-hot on each token.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


class Draft(Protocol):
    name: str
    vocab_size: int | None  # None: works with any vocabulary (n-gram)
    forward_calls: int  # model forward passes so far (0 for drafts without a model)

    def start(self, prompt_ids: list[int], max_len: int) -> None:
        """Prepare for a new generation whose context will never exceed max_len tokens."""

    def propose(
        self,
        context: list[int],
        gamma: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Up to gamma guesses for the tokens following `context`."""


class EarlyExitModel(Transformer):
    """The first `num_layers` blocks of a target, then the target's own final norm and head.

    Modules are shared with the target, not copied: the self-draft costs no memory and sees
    every weight change of the target (e.g. quantization applied afterwards).
    """

    def __init__(self, target: Transformer, num_layers: int) -> None:
        spec = spec_for(target)
        blocks = list(spec.blocks_of(target))
        total = len(blocks)
        if not 1 <= num_layers < total:
            raise UsageError(
                f"early-exit layer count {num_layers} must be in [1, {total - 1}] "
                f"for a target with {total} layers"
            )
        nn.Module.__init__(self)  # Transformer.__init__ would allocate fresh weights
        self.config = target.config.replace(num_layers=num_layers)
        self.rotary = target.rotary
        for role in ("embedding", "final_norm", "head"):
            setattr(self, getattr(spec, role), spec.top_module(target, role))
        setattr(self, spec.blocks, nn.ModuleList(blocks[:num_layers]))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelDraft:
    """A draft that runs a causal LM with its own KV cache."""

    def __init__(self, model: nn.Module, name: str = "model") -> None:
        self.model = model
        self.name = name
        self.vocab_size = model.config.vocab_size
        self.forward_calls = 0
        self._cache: KVCache | None = None
        self._cached: list[int] = []  # the token ids whose keys/values the cache holds

    @torch.inference_mode()
    def start(self, prompt_ids: list[int], max_len: int) -> None:
        """Allocate the cache and prefill all prompt tokens but the last, like the target,
        so the prefill is paid (and timed) with the target's, not inside the first round."""
        self._cache = KVCache.for_model(self.model, 1, max_len)
        self._cached = []
        if len(prompt_ids) > 1:
            self._step(list(prompt_ids[:-1]))
        self.forward_calls = 0

    def _step(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens after the cached ones; logits of the last position, [vocab]."""
        device = self._cache.k.device
        x = torch.tensor([tokens], dtype=torch.long, device=device)
        logits = self.model(x, self._cache, last_only=True)[0, -1]
        self._cached.extend(tokens)
        self.forward_calls += 1
        return logits

    @torch.inference_mode()
    def propose(
        self,
        context: list[int],
        gamma: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        if self._cache is None:
            raise RuntimeError("call start() before propose()")
        if gamma <= 0:
            return Proposal([])
        # Keep what the cache shares with the context, drop rejected guesses, and always
        # leave at least the last context token to feed (its logits give the first guess).
        keep = min(_common_prefix(self._cached, context), len(context) - 1)
        self._cache.rollback(keep)
        del self._cached[keep:]
        pending = context[keep:]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for _ in range(gamma):
            logits = self._step(pending)
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                q = logits_to_probs(logits, sampling)
                token = int(sample(q, generator))
                probs.append(q)
            tokens.append(token)
            pending = [token]
        # The last guess is not fed: if accepted, the next propose() feeds it with the rest.
        return Proposal(tokens, torch.stack(probs) if probs else None)


class NGramDraft:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (longest n first, n <= max_n) and propose the tokens that followed it.

    Free to run (no model), so it pays off whenever the output copies from the context —
    quotations, code edits, repetitive documents — and costs nothing when it finds no match.
    """

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise UsageError(f"n-gram sizes need 1 <= min_n={min_n} <= max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.name = f"ngram:{max_n}"
        self.vocab_size = None
        self.forward_calls = 0
        self._context: list[int] = []
        # n -> {n-gram: end position of its latest occurrence that has a following token}
        self._index: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed = 0  # n-grams ending before this position are indexed
        self.start([], 0)

    def start(self, prompt_ids: list[int], max_len: int) -> None:
        self._context = []
        self._index = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self._indexed = 0

    def _extend(self, context: list[int]) -> None:
        if context[: len(self._context)] != self._context:  # not append-only: rebuild
            self.start(context, 0)
        self._context = list(context)
        # index n-grams that end at positions [indexed, len-2]: each has a following token
        for end in range(self._indexed, len(context) - 1):
            for n in range(self.min_n, self.max_n + 1):
                if end + 1 >= n:
                    self._index[n][tuple(context[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, len(context) - 1)

    def propose(
        self,
        context: list[int],
        gamma: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        if gamma <= 0:
            return Proposal([])
        self._extend(context)
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            end = self._index[n].get(tuple(context[-n:]))
            if end is not None:
                # Copy what followed; past the context's end keep copying periodically (the
                # match repeats with period len(context)-1-end), so repetitions fill all γ.
                out: list[int] = []
                for i in range(end + 1, end + 1 + gamma):
                    out.append(context[i] if i < len(context) else out[i - len(context)])
                return Proposal(out)
        return Proposal([])


def check_vocabularies(
    target: nn.Module, draft: Draft, target_tokenizer=None, draft_tokenizer=None
):
    """Raise a clear ValueError when draft and target do not share one vocabulary.

    Speculative decoding compares token ids, so ids must mean the same strings for both.
    """
    target_vocab = target.config.vocab_size
    if draft.vocab_size is not None and draft.vocab_size != target_vocab:
        raise UsageError(
            f"draft {draft.name!r} has a vocabulary of {draft.vocab_size} tokens but the target "
            f"has {target_vocab}: speculative decoding needs a draft with the target's tokenizer"
        )
    if target_tokenizer is not None and draft_tokenizer is not None:
        probe = "The quick brown fox, 1234 — ünïcödé!\n  def f(x): return x"
        a, b = target_tokenizer.encode(probe), draft_tokenizer.encode(probe)
        if a != b or target_tokenizer.vocab_size != draft_tokenizer.vocab_size:
            raise UsageError(
                f"draft {draft.name!r} uses a different tokenizer than the target (same text "
                f"encodes to different ids): speculative decoding needs the target's tokenizer"
            )


DRAFT_SPECS = (
    "a model spec (name, .gguf, HF dir), a feature-head directory (llmopt distill "
    "--feature-head), early-exit:K, int8, int4, ngram[:N]"
)


def make_draft(
    spec: str,
    target: Transformer,
    target_tokenizer=None,
    *,
    group_size: int = 128,
) -> Draft:
    """Build a draft from a CLI spec (see DRAFT_SPECS) for `target`, checking its vocabulary."""
    spec = spec.strip()
    if not spec:
        raise UsageError(f"empty draft spec; valid: {DRAFT_SPECS}")
    kind, _, arg = spec.partition(":")
    kind = kind.lower()
    if kind == "early-exit":
        try:
            k = int(arg)
        except ValueError:
            raise UsageError(
                f"draft spec {spec!r}: early-exit needs a layer count, e.g. early-exit:8"
            ) from None
        draft: Draft = ModelDraft(EarlyExitModel(target, k), name=f"early-exit:{k}")
    elif kind == "ngram":
        try:
            n = int(arg) if arg else 3
        except ValueError:
            raise UsageError(
                f"draft spec {spec!r}: ngram takes an n-gram size, e.g. ngram:3"
            ) from None
        draft = NGramDraft(max_n=n)
    elif kind in ("int8", "int4") and not arg:
        draft = ModelDraft(quantized_copy(target, int(kind[3:]), group_size), name=kind)
    else:
        from llmopt.models.loading import load_model, load_tokenizer

        param = next(target.parameters())
        try:
            model = load_model(spec, dtype=param.dtype, device=param.device).eval()
        except (KeyError, FileNotFoundError, ValueError) as exc:
            reason = exc.args[0] if exc.args else exc
            raise UsageError(f"draft {spec!r}: {reason}; valid draft specs: {DRAFT_SPECS}") from exc
        from llmopt.compress.distill.draft import read_draft_vocab, with_reduced_head

        ids = read_draft_vocab(spec) if Path(spec).is_dir() else None
        if ids is not None:  # a distilled draft that scores only its frequent tokens
            model = with_reduced_head(model, ids)
        draft = ModelDraft(model, name=spec)
        draft_tokenizer = load_tokenizer(spec) if target_tokenizer is not None else None
        check_vocabularies(target, draft, target_tokenizer, draft_tokenizer)
    check_vocabularies(target, draft)
    return draft


def quantized_copy(target: Transformer, bits: int, group_size: int = 128) -> nn.Module:
    """The target's RTN-quantized copy (INT8/INT4), the self-draft that needs no second model."""
    try:
        from llmopt.compress.quant import quantize_model
    except ImportError as exc:
        raise UsageError(
            f"int{bits} self-draft needs llmopt.compress.quant.quantize_model ({exc})"
        ) from exc
    cfg = target.config
    if bits == 8:
        group = -1  # per output channel: accurate at 8 bits, and runs the int8 matmul kernel
    else:  # the largest group size <= group_size dividing every linear layer's input width
        group = math.gcd(group_size, cfg.hidden_size, cfg.intermediate_size, cfg.q_size)
    model = quantize_model(target, method="rtn", bits=bits, group_size=group)
    return model.eval()
