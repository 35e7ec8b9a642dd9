"""All communication of the engine goes through here, so it can be counted.

A `Group` is one process group with a name ("tp", "dp", "pp", "cp", "world") and a shared
`CommCounter`. Every collective and point-to-point transfer is a method of `Group`; each call
records one entry keyed by (group name, op).

Byte convention (what the planner predicts, per rank, per call):

- ``all_reduce``: bytes of the tensor being reduced (the full logical tensor).
- ``all_gather``: bytes of the gathered *output* (the full tensor = group size x input bytes).
- ``reduce_scatter``: bytes of the *input* (the full tensor = group size x output bytes).
- ``broadcast``: bytes of the tensor.
- ``send`` / ``recv``: bytes of the tensor sent / received, counted on the sending / receiving
  rank only.
- ``all_to_all``: bytes of this rank's *input* (everything it hands the collective, its own
  chunk included). For a MoE dispatch that is top_k copies of each local token's hidden state,
  whatever the routing; the combine's input is what this rank's experts received.

So for the three collectives the count is always "the unsharded tensor", independent of the
algorithm (ring, tree) that moves it; the wire traffic of a ring is 2(n-1)/n of it for
all-reduce and (n-1)/n for all-gather / reduce-scatter. Calls on a group of size 1 are skipped
entirely and count nothing (no communication happens). Counts are per rank: each rank records
the calls it makes. Scalar reductions for metrics and clipping, and checkpoint gathers, run
inside `CommCounter.paused()` and are not counted: the counts describe the model's traffic.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "all_to_all")
ReduceOp = Literal["sum", "max", "min", "avg"]

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "avg": "AVG"}

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases only have these.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

CountTable = dict[str, dict[str, dict[str, int]]]  # group -> op -> {"calls", "bytes"}


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CommCounter:
    """Calls and bytes per (group, op). One per process; shared by all of its groups."""

    def __init__(self) -> None:
        self._table: CountTable = {}
        self.enabled = True

    def record(self, group: str, op: str, nbytes: int) -> None:
        if not self.enabled:
            return
        if op not in OPS:
            raise ValueError(f"unknown communication op {op!r}; known: {', '.join(OPS)}")
        entry = self._table.setdefault(group, {}).setdefault(op, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += int(nbytes)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Do not count inside this block (metric reductions, checkpoint gathers)."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def snapshot(self) -> CountTable:
        """A deep copy of the current table (JSON-serialisable)."""
        return copy.deepcopy(self._table)

    def reset(self) -> None:
        self._table = {}

    def calls(self, group: str | None = None, op: str | None = None) -> int:
        return self._sum("calls", group, op)

    def bytes(self, group: str | None = None, op: str | None = None) -> int:
        return self._sum("bytes", group, op)

    def _sum(self, key: str, group: str | None, op: str | None) -> int:
        total = 0
        for g, ops in self._table.items():
            if group is not None and g != group:
                continue
            for o, entry in ops.items():
                if op is None or o == op:
                    total += entry[key]
        return total

    @staticmethod
    def delta(after: CountTable, before: CountTable) -> CountTable:
        """Counts recorded between two snapshots (entries that did not change are dropped)."""
        out: CountTable = {}
        for g, ops in after.items():
            for o, entry in ops.items():
                prev = before.get(g, {}).get(o, {"calls": 0, "bytes": 0})
                calls, nbytes = entry["calls"] - prev["calls"], entry["bytes"] - prev["bytes"]
                if calls or nbytes:
                    out.setdefault(g, {})[o] = {"calls": calls, "bytes": nbytes}
        return out


@dataclass
class Group:
    """A named process group. `ranks` are global ranks; `rank` is this process's index in them.

    `pg` is None for a group of size 1 (or when torch.distributed is not initialised): every
    collective is then the identity and nothing is counted.
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    pg: dist.ProcessGroup | None
    counter: CommCounter

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, local: int) -> int:
        return self.ranks[local]

    def _active(self) -> bool:
        return self.size > 1 and self.pg is not None

    # ---- collectives ----
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = "sum", async_op: bool = False
    ) -> dist.Work | None:
        """In-place all-reduce of `tensor`."""
        if not self._active():
            return None
        self.counter.record(self.name, "all_reduce", tensor_bytes(tensor))
        reduce_op = getattr(dist.ReduceOp, _REDUCE_OPS[op])
        return dist.all_reduce(tensor, op=reduce_op, group=self.pg, async_op=async_op)

    def all_gather_into(
        self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False
    ) -> dist.Work | None:
        """output (numel = size x shard numel) <- concatenation of every rank's shard."""
        if not self._active():
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard.view_as(output))
            return None
        self.counter.record(self.name, "all_gather", tensor_bytes(output))
        return _ALL_GATHER(output, shard, group=self.pg, async_op=async_op)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """A new tensor: every rank's `tensor` concatenated along `dim`."""
        if not self._active():
            return tensor
        moved = tensor.movedim(dim, 0).contiguous()
        out = torch.empty(
            (self.size * moved.shape[0], *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device
        )
        self.all_gather_into(out, moved)
        return out.movedim(0, dim)

    def reduce_scatter_into(
        self,
        output: torch.Tensor,
        full: torch.Tensor,
        op: ReduceOp = "sum",
        async_op: bool = False,
    ) -> dist.Work | None:
        """output <- this rank's 1/size slice (along dim 0 of the flat order) of sum(full)."""
        if not self._active():
            if output.data_ptr() != full.data_ptr():
                output.copy_(full.view_as(output))
            return None
        self.counter.record(self.name, "reduce_scatter", tensor_bytes(full))
        reduce_op = getattr(dist.ReduceOp, _REDUCE_OPS[op])
        return _REDUCE_SCATTER(output, full, op=reduce_op, group=self.pg, async_op=async_op)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """A new tensor: this rank's slice along `dim` of the sum over ranks."""
        if not self._active():
            return tensor
        moved = tensor.movedim(dim, 0).contiguous()
        if moved.shape[0] % self.size:
            raise ValueError(
                f"reduce_scatter on {self.name}: dim {dim} of size {moved.shape[0]} is not "
                f"divisible by the group size {self.size}"
            )
        out = torch.empty(
            (moved.shape[0] // self.size, *moved.shape[1:]),
            dtype=tensor.dtype,
            device=tensor.device,
        )
        self.reduce_scatter_into(out, moved)
        return out.movedim(0, dim)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
    ) -> None:
        """Rows input[sum(input_splits[:j]) ...][: input_splits[j]] go to rank j; output
        receives input_splits-sized chunks from every rank, output_splits[j] rows from rank j
        (dim 0)."""
        if not self._active():
            output.copy_(input)
            return
        self.counter.record(self.name, "all_to_all", tensor_bytes(input))
        dist.all_to_all_single(
            output, input, list(output_splits), list(input_splits), group=self.pg
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place broadcast from group-local rank `src`."""
        if not self._active():
            return
        self.counter.record(self.name, "broadcast", tensor_bytes(tensor))
        dist.broadcast(tensor, src=self.ranks[src], group=self.pg)

    def barrier(self) -> None:
        if self._active():
            dist.barrier(group=self.pg)

    # ---- point to point (peers are group-local ranks) ----
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.batch_p2p([("send", tensor, dst)], wait=True)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.batch_p2p([("recv", tensor, src)], wait=True)

    def batch_p2p(
        self,
        ops: Sequence[tuple[Literal["send", "recv"], torch.Tensor, int]],
        wait: bool = False,
    ) -> list[dist.Work]:
        """Issue sends/receives together (`batch_isend_irecv`), e.g. a pipeline step.

        Each entry is (kind, tensor, group-local peer). Returns the works unless `wait`.
        """
        if not ops:
            return []
        if self.pg is None:
            raise RuntimeError(f"point-to-point on group {self.name!r} without a process group")
        p2p = []
        for kind, tensor, peer in ops:
            if kind not in ("send", "recv"):
                raise ValueError(f"p2p kind {kind!r} must be 'send' or 'recv'")
            if not 0 <= peer < self.size or peer == self.rank:
                raise ValueError(f"p2p peer {peer} is not another rank of group {self.name}")
            self.counter.record(self.name, kind, tensor_bytes(tensor))
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, tensor, self.ranks[peer], group=self.pg))
        works = dist.batch_isend_irecv(p2p)
        if wait:
            for work in works:
                work.wait()
            return []
        return works


def local_group(name: str, counter: CommCounter | None = None) -> Group:
    """A size-1 group for single-process runs (every collective is the identity)."""
    return Group(name=name, ranks=(0,), rank=0, pg=None, counter=counter or CommCounter())
