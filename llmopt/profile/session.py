"""Profile `generate` (prefill and every decode step) and gather the numbers into one summary.

Generation itself is `llmopt.infer.generate.generate`, unmodified: phase ranges are opened and
closed from its `on_token` callback (prefill ends when the first token is chosen, each decode
step when the next one is), so what is profiled is exactly what users run. A warm-up run and an
unprofiled timed run (NVTX ranges only) come first, so the summary also says how much the
profiler slowed steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from llmopt.errors import UsageError
from llmopt.infer.generate import generate
from llmopt.peaks import MachinePeaks
from llmopt.profile.optable import memory_timeline, phase_stats
from llmopt.profile.phases import DECODE_STEP, PREFILL, PhaseMarker


@dataclass
class StepClock:
    """Wall-clock boundaries of prefill and each decode step, taken in `on_token`."""

    marker: PhaseMarker | None
    new_tokens: int
    stamps: list[float] = field(default_factory=list)

    def start(self) -> None:
        self.stamps = [time.perf_counter()]
        if self.marker is not None:
            self.marker.begin(PREFILL)

    def on_token(self, _token: int) -> None:
        # `generate` has already synchronised (int(token)) when it calls back
        self.stamps.append(time.perf_counter())
        if self.marker is not None:
            self.marker.end()
            if len(self.stamps) <= self.new_tokens:  # another forward pass follows
                self.marker.begin(DECODE_STEP)

    @property
    def prefill_s(self) -> float:
        return self.stamps[1] - self.stamps[0]

    @property
    def decode_s(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps[1:], self.stamps[2:])]


def _timed_run(model, prompt_ids, new_tokens, marker=None, fast: bool = False) -> StepClock:
    clock = StepClock(marker, new_tokens)
    clock.start()
    try:
        out = generate(
            model, prompt_ids, max_new_tokens=new_tokens, on_token=clock.on_token, fast=fast
        )
    finally:
        if marker is not None:
            marker.close_all()
    if len(out) != new_tokens:
        raise RuntimeError(f"generate returned {len(out)} tokens, expected {new_tokens}")
    return clock


def _weights_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def profile_generate(
    model: torch.nn.Module,
    prompt_ids: list[int],
    new_tokens: int,
    peaks: MachinePeaks,
    *,
    trace_path=None,
    fast: bool = False,
) -> dict[str, Any]:
    """Summary dict of a profiled greedy generation; writes the Chrome trace to `trace_path`.

    fast=False profiles the eager model op by op (what the op table and roofline are for);
    fast=True the fused C++ decode step `generate` uses by default (one op per step)."""
    if new_tokens < 2:
        raise UsageError(f"new_tokens={new_tokens} must be >= 2 (at least one decode step)")
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    _timed_run(model, prompt_ids, 2, fast=fast)  # warm-up
    # timed without torch.profiler, but with the phase ranges: under `nsys profile` (which
    # cannot share CUPTI with torch.profiler) this is the run whose NVTX ranges to read
    plain = _timed_run(model, prompt_ids, new_tokens, PhaseMarker(), fast=fast)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        baseline = _weights_bytes(model)
    marker = PhaseMarker()
    with profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
        clock = _timed_run(model, prompt_ids, new_tokens, marker, fast=fast)
    events = prof.events()
    stats = phase_stats(events, launches_on_device=cuda)
    if trace_path is not None:
        from llmopt.artifacts import atomic_write

        atomic_write(trace_path, lambda tmp: prof.export_chrome_trace(str(tmp)))
    timeline = memory_timeline(events, on_device=cuda, baseline=baseline)
    peak = torch.cuda.max_memory_allocated(device) if cuda else max(b for _, b in timeline)
    steps = new_tokens - 1
    decode, prefill = stats[DECODE_STEP], stats[PREFILL]
    if decode.ranges != steps or prefill.ranges != 1:
        raise RuntimeError(
            f"profiler saw {prefill.ranges} prefill and {decode.ranges} decode ranges, "
            f"expected 1 and {steps}"
        )
    decode_wall_us = 1e6 * sum(clock.decode_s)
    return {
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": new_tokens,
        "peaks": peaks.to_dict(),
        "time_basis": "device" if cuda else "cpu",
        "launch_kind": "CUDA runtime launches" if cuda else "CPU leaf ops (one kernel each)",
        "nvtx": marker.nvtx,
        "prefill": {
            "wall_ms": 1e3 * clock.prefill_s,
            "unprofiled_wall_ms": 1e3 * plain.prefill_s,
            "op_self_ms": prefill.self_cpu_us / 1e3,
            "op_self_device_ms": prefill.self_device_us / 1e3,
            "outside_ops_ms": prefill.outside_us / 1e3,
            "ops": prefill.ops,
            "kernel_launches": prefill.kernel_launches,
            "table": prefill.table(on_device=cuda),
        },
        "decode": {
            "steps": steps,
            "wall_ms_per_step": decode_wall_us / steps / 1e3,
            "unprofiled_wall_ms_per_step": 1e3 * sum(plain.decode_s) / steps,
            "op_self_ms_per_step": decode.self_cpu_us / steps / 1e3,
            "op_self_device_ms_per_step": decode.self_device_us / steps / 1e3,
            "outside_ops_ms_per_step": decode.outside_us / steps / 1e3,
            "op_coverage": decode.self_cpu_us / decode_wall_us,
            "profile_coverage": (decode.self_cpu_us + decode.outside_us) / decode_wall_us,
            "ops_per_step": decode.ops / steps,
            "kernel_launches_per_step": decode.kernel_launches / steps,
            "table": decode.table(per=steps, on_device=cuda),
        },
        "memory": {
            "basis": "torch.cuda allocator" if cuda else "profiler allocation events + weights",
            "baseline_bytes": baseline,
            "peak_bytes": int(peak),
            "timeline_ms_bytes": timeline,
        },
    }
