"""Calibration batches: fixed token windows of real text, disjoint from the evaluation slice.

Evaluation (benchmarks, `eval ppl`) reads web-bible from its beginning; calibration windows
are drawn from the second half of the corpus, so a method cannot overfit the text it is
scored on.
"""

from __future__ import annotations

import torch

from llmopt.data.corpus import load_text

CALIB_START_FRACTION = 0.5
_CHARS_PER_WINDOW_TOKEN = 10  # ~4.5 chars/token in English: about 2x more windows than drawn


def calibration_tokens(
    tokenizer,
    spec: str = "corpus:web-bible",
    n_samples: int = 16,
    seq_len: int = 512,
    seed: int = 0,
) -> torch.Tensor:
    """[n_samples, seq_len] token ids from random windows of the text's second half."""
    if n_samples < 1 or seq_len < 2:
        raise ValueError(f"need n_samples >= 1 and seq_len >= 2; got {n_samples}, {seq_len}")
    text = load_text(spec)
    start = int(len(text) * CALIB_START_FRACTION)
    # tokenize only what the windows need (tokenizing megabytes costs seconds)
    chars = n_samples * seq_len * _CHARS_PER_WINDOW_TOKEN
    while True:
        piece = text[start : start + chars]
        ids = torch.tensor(tokenizer.encode(piece), dtype=torch.long)
        if ids.numel() // seq_len >= n_samples or start + chars >= len(text):
            return windows(ids, n_samples, seq_len, seed)
        chars *= 2


def windows(ids: torch.Tensor, n_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """n random (seeded) non-overlapping windows of seq_len from a 1-D id tensor."""
    slots = ids.numel() // seq_len
    if slots < n_samples:
        raise ValueError(
            f"calibration text has {ids.numel()} tokens: too few for {n_samples} x {seq_len}"
        )
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(slots, generator=gen)[:n_samples].sort().values
    return torch.stack([ids[i * seq_len : (i + 1) * seq_len] for i in chosen.tolist()])
