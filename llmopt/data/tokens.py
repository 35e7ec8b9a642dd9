"""Training data: a tokenised corpus cut into fixed-length sequences, in a seeded order.

The order is a function of (seed, epoch) only, and step s reads global-batch rows
[s*G, (s+1)*G) of it, so any rank can compute its own rows of any step without state: data
order survives a restart exactly (resume reproduces the loss trajectory) and DP ranks never
overlap (rank r takes rows [r*G/dp, (r+1)*G/dp) of the global batch). TP peers read the same
rows.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from llmopt.artifacts import atomic_write, sha256_file
from llmopt.errors import UsageError

CACHE_DIR = Path(os.environ.get("LLMOPT_CACHE", Path.home() / ".cache" / "llmopt"))


def _content_key(corpus: str) -> str:
    """What a cache entry of a text-file corpus depends on besides its name: the SHA-256 of its
    bytes (hashing is ~100x cheaper than tokenising), so an edited file — or another file of
    the same relative name — is tokenised afresh. Named corpora (`corpus:NAME`) are packaged
    data: their name is their key."""
    if corpus.startswith("corpus:"):
        return ""
    path = Path(corpus)
    if not path.is_file():
        return ""  # load_text names the missing file
    return sha256_file(path)


def _tokenise_cached(corpus: str, tokenizer_spec: str, max_chars: int | None) -> np.ndarray:
    """Token ids of a corpus, cached on disk (written atomically) so ranks share the work."""
    from llmopt.data.corpus import load_text

    key = hashlib.sha256(
        f"{corpus}|{_content_key(corpus)}|{tokenizer_spec}|{max_chars}".encode()
    ).hexdigest()[:16]
    path = CACHE_DIR / f"tokens-{key}.npy"
    if path.is_file():
        return np.load(path)
    from llmopt.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_spec)
    text = load_text(corpus, max_chars=max_chars)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int32)

    def save(tmp: Path) -> None:
        with tmp.open("wb") as handle:  # a file object: np.save would append ".npy" to a name
            np.save(handle, ids)

    atomic_write(path, save)
    return ids


class TokenData:
    """Sequences of seq_len+1 tokens (inputs and shifted targets) in a seeded order."""

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_len: int, seed: int) -> None:
        tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
        n = (tokens.numel() - 1) // seq_len
        if n < 1:
            raise UsageError(
                f"the corpus has {tokens.numel()} tokens: too few for one sequence of "
                f"seq_len={seq_len}"
            )
        # Non-overlapping windows; targets reuse the next window's first token.
        self.inputs = tokens[: n * seq_len].view(n, seq_len)
        self.targets = tokens[1 : n * seq_len + 1].view(n, seq_len)
        self.num_sequences = n
        self.seed = seed
        self._orders: dict[int, torch.Tensor] = {}

    @classmethod
    def from_config(cls, corpus: str, tokenizer: str, max_chars, seq_len, seed, vocab_size):
        if corpus == "random" or corpus.startswith("random:"):
            # Synthetic tokens for tests and benchmarks: a repeating random pattern, learnable.
            gen = torch.Generator().manual_seed(seed + 12345)
            pattern = torch.randint(0, vocab_size, (4 * seq_len + 1,), generator=gen)
            return cls(pattern.repeat(64), seq_len, seed)
        return cls(_tokenise_cached(corpus, tokenizer, max_chars), seq_len, seed)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(self.num_sequences, generator=gen)}
        return self._orders[epoch]

    def global_rows(self, step: int, global_batch: int) -> torch.Tensor:
        """Sequence indices of the global batch of `step` (wrapping into later epochs)."""
        flat = torch.arange(step * global_batch, (step + 1) * global_batch)
        epochs, positions = flat // self.num_sequences, flat % self.num_sequences
        return torch.stack([self._order(int(e))[int(p)] for e, p in zip(epochs, positions)])

    def supervised(self, step: int, global_batch: int) -> int:
        """Supervised tokens of the global batch of `step`: all of them (raw text)."""
        return global_batch * self.inputs.shape[1]

    def batch(
        self, step: int, global_batch: int, dp_rank: int, dp: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) [global_batch/dp, seq_len] of this DP rank at `step`."""
        rows = self.global_rows(step, global_batch)
        per_rank = global_batch // dp
        mine = rows[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        return self.inputs[mine], self.targets[mine]
