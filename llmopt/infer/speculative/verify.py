"""Verification of a draft's guesses: the rule that makes speculative decoding exact.

- greedy: a guess is kept iff it equals the target's argmax at its position, and the token
  after the kept prefix is the target's own argmax, so the output is the target's greedy output.
- sampling: the modified rejection sampling of Leviathan et al. 2023 / Chen et al. 2023 — keep
  guess x with probability min(1, p(x)/q(x)), else draw from norm(max(0, p - q)) and stop; if
  all γ are kept, draw one more token from p. The emitted tokens are distributed exactly as the
  target's, whatever the draft.
"""

from __future__ import annotations

import torch

from llmopt.infer.sampling import sample


def verify_greedy(target_argmax: list[int], guesses: list[int]) -> tuple[int, int]:
    """(number of guesses kept, the token that follows them) for greedy decoding."""
    n = 0
    while n < len(guesses) and guesses[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def verify_sampled(
    p: torch.Tensor,
    q: torch.Tensor | None,
    guesses: list[int],
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Leviathan/Chen rejection sampling: (number of guesses kept, the token that follows).

    p: target probabilities [γ+1, vocab]; q: draft probabilities [γ, vocab], or None when
    the draft is deterministic (q one-hot on each guess).
    """
    k = len(guesses)
    if k:
        idx = torch.tensor(guesses, device=p.device)
        rows = torch.arange(k, device=p.device)
        p_x = p[rows, idx]
        q_x = q[rows, idx] if q is not None else torch.ones_like(p_x)
        u = torch.rand(k, generator=generator, device=p.device)
        rejected = (u * q_x >= p_x).nonzero()  # accept iff u < p(x)/q(x)
        if len(rejected):
            i = int(rejected[0, 0])
            if q is not None:
                residual = (p[i] - q[i]).clamp_(min=0.0)
            else:
                residual = p[i].clone()
                residual[guesses[i]] = 0.0
            total = residual.sum()
            # p == q up to rounding leaves no residual mass; then p itself is the right law
            residual = residual / total if total > 0 else p[i]
            return i, int(sample(residual, generator))
    return k, int(sample(p[k], generator))
