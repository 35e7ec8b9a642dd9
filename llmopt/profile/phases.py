"""Named ranges for llmopt's phases (prefill, decode step) in every timeline.

One marker feeds two tools: a torch.profiler `record_function` range (Chrome/Perfetto trace,
and the op table's attribution of each operator to its phase) and, on CUDA, an NVTX range so
`nsys profile` shows the same phases over the kernels. Ranges are opened and closed by explicit
calls because phase boundaries fall inside callbacks (a decode step ends when a token is chosen),
not around Python blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from llmopt.errors import UsageError

PREFILL = "llmopt.prefill"
DECODE_STEP = "llmopt.decode_step"
PHASES = (PREFILL, DECODE_STEP)


def nvtx_available() -> bool:
    """NVTX ranges need a CUDA build with a visible GPU; elsewhere markers skip them."""
    return torch.cuda.is_available()


class PhaseMarker:
    """A stack of open phase ranges; `nvtx=None` enables NVTX exactly when CUDA is usable."""

    def __init__(self, nvtx: bool | None = None) -> None:
        self.nvtx = nvtx_available() if nvtx is None else nvtx
        if self.nvtx and not nvtx_available():
            raise UsageError("nvtx=True needs CUDA (torch.cuda.is_available() is False)")
        self._open: list[torch.profiler.record_function] = []

    def begin(self, name: str) -> None:
        if name not in PHASES:
            raise UsageError(f"unknown phase {name!r}; phases are {', '.join(PHASES)}")
        record = torch.profiler.record_function(name)
        record.__enter__()
        self._open.append(record)
        if self.nvtx:
            torch.cuda.nvtx.range_push(name)

    def end(self) -> None:
        if not self._open:
            raise RuntimeError("PhaseMarker.end() without an open phase")
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        self._open.pop().__exit__(None, None, None)

    def close_all(self) -> None:
        while self._open:
            self.end()

    @property
    def depth(self) -> int:
        return len(self._open)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end()
