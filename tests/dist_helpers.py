"""Run a function on N CPU processes with gloo, for tests.

`run_distributed(fn, world_size, *args)` spawns `world_size` processes, initialises a gloo
process group in each (free port, retried if the port was taken meanwhile), runs
`fn(rank, world_size, *args)` and returns the per-rank results. A rank that raises, dies or
exceeds the timeout fails the call with an AssertionError naming the rank and its traceback.
Each process uses one OpenMP thread (mp.spawn does not set it; on 2 cores oversubscription
makes everything crawl).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

ADDRESS_IN_USE = ("address already in use", "EADDRINUSE", "Address in use")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, queue, pg_timeout_s):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "init_error", f"{type(exc).__name__}: {exc}"))
        return
    try:
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    retries: int = 3,
) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` gloo processes; returns results by rank.

    `fn` must be importable (a module-level function) since processes are spawned.
    """
    last_error = ""
    for _attempt in range(retries):
        outcome = _launch(fn, world_size, args, timeout_s, pg_timeout_s)
        if isinstance(outcome, list):
            return outcome
        last_error = outcome
        if not any(marker in outcome for marker in ADDRESS_IN_USE):
            raise AssertionError(outcome)
    raise AssertionError(f"gave up after {retries} attempts (port in use): {last_error}")


def _launch(fn, world_size, args, timeout_s, pg_timeout_s) -> list[Any] | str:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue, pg_timeout_s))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            try:
                rank, status, payload = queue.get(timeout=0.2)
                results[rank] = (status, payload)
                continue
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
            dead = [
                r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
            ]
            dead = [r for r in dead if r not in results]
            if dead:
                time.sleep(0.5)  # let the others report first if they can
                while not queue.empty():
                    rank, status, payload = queue.get()
                    results[rank] = (status, payload)
                dead = [r for r in dead if r not in results]
                if dead:
                    return f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                errors = _errors(results)
                return errors or f"ranks {missing} did not finish within {timeout_s:.0f}s"
            if any(s != "ok" for s, _ in results.values()):
                # One failed: give the others a moment to report, then stop waiting.
                grace = time.monotonic() + 5
                while len(results) < world_size and time.monotonic() < grace:
                    try:
                        rank, status, payload = queue.get(timeout=0.2)
                        results[rank] = (status, payload)
                    except Exception:  # noqa: BLE001
                        pass
                return _errors(results)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = _errors(results)
    if errors:
        return errors
    return [results[r][1] for r in range(world_size)]


def _errors(results: dict[int, tuple[str, Any]]) -> str:
    # The root cause is usually the first rank that raised something other than a timeout.
    failed = sorted((r, p) for r, (s, p) in results.items() if s != "ok")
    if not failed:
        return ""
    rank, payload = failed[0]
    return f"rank {rank} failed:\n{payload}"
