"""This machine's attainable peaks, measured (not typed in): matmul FLOP/s and memory bandwidth.

A roofline is only as honest as its roofs. Datasheet numbers are unreachable on a shared CPU or a
clock-throttled GPU, so both roofs are the best of a few timed runs of the two kernels that
define them: a square matrix product (compute roof) and a large tensor copy (memory roof; a
copy reads and writes every byte once). `read_bytes_per_s` is the read-only roof a batch-1
decode step meets (it reads every weight once, writes almost nothing). These are the one
definition of each probe: `llmopt profile`, benchmarks/decode.py and
benchmarks/serve_vs_llamacpp.py all measure through them; `threads` pins torch's CPU thread
count for the measurement and restores it after.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from llmopt.errors import UsageError


@dataclass(frozen=True)
class MachinePeaks:
    flops_per_s: float  # best achieved dense matmul FLOP/s in `dtype`
    bytes_per_s: float  # best achieved copy bandwidth (read + write bytes / s)
    device: str
    dtype: str
    matmul_n: int
    copy_bytes: int

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the two roofs meet."""
        return self.flops_per_s / self.bytes_per_s

    def to_dict(self) -> dict:
        return {**asdict(self), "ridge_flop_per_byte": self.ridge}


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocation, thread pool start, kernel selection
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _matmul_seconds(n: int, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return _best_seconds(lambda: torch.mm(a, b, out=out), device, repeats)


def _copy_seconds(elems: int, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    src = torch.ones(elems, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    return _best_seconds(lambda: dst.copy_(src), device, repeats)


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with torch's CPU thread count set to `threads` (None: leave it)."""
    if threads is None:
        yield
        return
    if threads < 1:
        raise UsageError(f"threads={threads} must be >= 1 (or None for torch's current count)")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def read_bytes_per_s(
    device: torch.device | str = "cpu",
    *,
    mib: int = 512,
    repeats: int = 7,
    threads: int | None = None,
) -> float:
    """Bytes/s of streaming reads: the best of `repeats` sums over `mib` MiB of float32, a
    buffer far larger than the caches (the warm-up sum faults its pages in)."""
    device = torch.device(device)
    if mib < 1 or repeats < 1:
        raise UsageError(f"mib={mib} must be >= 1 and repeats={repeats} >= 1")
    buf = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    with torch_threads(threads):
        seconds = _best_seconds(buf.sum, device, repeats)
    return buf.numel() * 4 / seconds


def measure_peaks(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    matmul_n: int | None = None,
    copy_mib: int | None = None,
    repeats: int = 5,
    threads: int | None = None,
) -> MachinePeaks:
    """Time an n x n matmul and a copy of `copy_mib` MiB; sizes default by device type."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = matmul_n or (8192 if cuda else 1024)
    mib = copy_mib or (1024 if cuda else 64)
    if n < 16 or mib < 1 or repeats < 1:
        raise UsageError(f"matmul_n={n} must be >= 16, copy_mib={mib} >= 1, repeats={repeats} >= 1")
    elems = mib * 2**20 // torch.empty(0, dtype=dtype).element_size()
    with torch_threads(threads):
        mm_s = _matmul_seconds(n, device, dtype, repeats)
        copy_s = _copy_seconds(elems, device, dtype, repeats)
    moved = 2 * elems * torch.empty(0, dtype=dtype).element_size()
    return MachinePeaks(
        flops_per_s=2 * n**3 / mm_s,
        bytes_per_s=moved / copy_s,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        matmul_n=n,
        copy_bytes=moved,
    )
