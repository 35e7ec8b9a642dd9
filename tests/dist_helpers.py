"""Run a function on N CPU processes with gloo, for tests.

`run_distributed(fn, world_size, *args)` is `llmopt.train.launch.spawn` (the one local
multi-process runner, shared with the benchmarks) with test semantics: a rank that raises,
dies or exceeds the timeout fails the call with an AssertionError naming the rank and its
traceback. Each process uses one OpenMP thread (on 2 cores oversubscription makes everything
crawl).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmopt.train.launch import SpawnError, spawn


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` gloo processes; returns results by rank.

    `fn` must be importable (a module-level function) since processes are spawned.
    """
    try:
        return spawn(fn, world_size, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
    except SpawnError as exc:
        raise AssertionError(str(exc)) from None
