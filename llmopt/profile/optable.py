"""From torch.profiler events to per-phase statistics: the op table, op and launch counts.

Every ATen call is attributed to the llmopt phase range (`llmopt.profile.phases`) it ran
under. Self times (time in an op minus its child ops) add up without double counting, so a
phase's op-table total is the time its operators account for; the rest of the phase's wall time
is Python and framework overhead between ops (`outside_us`: the phase ranges' own self time).
Counts:
- ops: top-level ATen calls (those issued by the model code, not by other ops),
- kernel launches: CUDA runtime launch calls on a GPU; on CPU, the leaf ATen calls that do data
  work (each runs one CPU kernel; views and allocations are excluded).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

from llmopt.profile.costs import is_metadata, op_cost
from llmopt.profile.phases import PHASES

CUDA_LAUNCHES = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaGraphLaunch",
    }
)


@dataclass
class OpRow:
    name: str
    calls: int = 0
    self_cpu_us: float = 0.0
    self_device_us: float = 0.0
    flops: int | None = 0  # None: some call's cost is not derivable
    bytes: int | None = 0

    def add(self, cpu_us: float, device_us: float, flops: int | None, moved: int | None) -> None:
        self.calls += 1
        self.self_cpu_us += cpu_us
        self.self_device_us += device_us
        self.flops = None if flops is None or self.flops is None else self.flops + flops
        self.bytes = None if moved is None or self.bytes is None else self.bytes + moved


@dataclass
class PhaseStats:
    """What the profiler saw inside every range of one phase, summed over its ranges."""

    phase: str
    ranges: int = 0
    ops: int = 0
    kernel_launches: int = 0
    rows: dict[str, OpRow] = field(default_factory=dict)
    outside_us: float = 0.0  # range time outside every recorded op: Python, module calls

    @property
    def self_cpu_us(self) -> float:
        return sum(r.self_cpu_us for r in self.rows.values())

    @property
    def self_device_us(self) -> float:
        return sum(r.self_device_us for r in self.rows.values())

    def table(self, per: int = 1, on_device: bool = False) -> list[dict]:
        """Rows sorted by self time (device time on a GPU), each value divided by `per`."""
        key = "self_device_us" if on_device else "self_cpu_us"
        total = getattr(self, key) or 1.0
        out = []
        for row in sorted(self.rows.values(), key=lambda r: getattr(r, key), reverse=True):
            d = asdict(row)
            for name in ("calls", "self_cpu_us", "self_device_us", "flops", "bytes"):
                if d[name] is not None:
                    d[name] = d[name] / per
            d["percent"] = 100.0 * getattr(row, key) / total
            out.append(d)
        return out


def _phase_of(event) -> tuple[str | None, object | None]:
    """(phase name, the op's parent) for an event, walking up to the nearest phase range."""
    node = event.cpu_parent
    parent = node
    while node is not None:
        if node.name in PHASES:
            return node.name, parent
        node = node.cpu_parent
    return None, parent


def phase_stats(events, launches_on_device: bool) -> dict[str, PhaseStats]:
    """Per-phase op rows and counts from `profile.events()`."""
    stats: dict[str, PhaseStats] = defaultdict(lambda: PhaseStats(""))
    for event in events:
        if event.name in PHASES:
            s = stats[event.name]
            s.phase = event.name
            s.ranges += 1
            s.outside_us += event.self_cpu_time_total
            continue
        phase, parent = _phase_of(event)
        if phase is None:
            continue
        s = stats[phase]
        s.phase = phase
        if event.name in CUDA_LAUNCHES:
            s.kernel_launches += 1
        if not event.name.startswith("aten::"):  # runtime calls (launches, copies, syncs)
            row = s.rows.setdefault(event.name, OpRow(event.name, flops=None, bytes=None))
            row.add(event.self_cpu_time_total, event.self_device_time_total, None, None)
            continue
        if parent is not None and parent.name in PHASES:
            s.ops += 1
        is_leaf = not any(c.name.startswith("aten::") for c in event.cpu_children)
        if not launches_on_device and is_leaf and not is_metadata(event.name):
            s.kernel_launches += 1
        flops, moved = op_cost(event.name, event.input_shapes or [], event.input_dtypes or [])
        row = s.rows.setdefault(event.name, OpRow(event.name))
        row.add(event.self_cpu_time_total, event.self_device_time_total, flops, moved)
    return dict(stats)


def memory_timeline(events, on_device: bool, baseline: int) -> list[tuple[float, int]]:
    """(ms since the first event, bytes held) after each event that allocated or freed memory.

    Each allocation and free is attributed to exactly one event's *self* memory, so the running
    sum over events in start order is the net allocation; `baseline` is what was held before
    (weights, the warm-up's cached blocks on a GPU).
    """
    key = "self_device_memory_usage" if on_device else "self_cpu_memory_usage"
    ordered = sorted(events, key=lambda e: e.time_range.start)
    if not ordered:
        return []
    t0 = ordered[0].time_range.start
    held = baseline
    points = [(0.0, baseline)]
    for event in ordered:
        delta = getattr(event, key, 0) or 0
        if delta:
            held += delta
            points.append(((event.time_range.start - t0) / 1000.0, held))
    return points
