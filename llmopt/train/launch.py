"""Starting ranks: the one torchrun command line and the one local multi-process runner.

`torchrun_command(target, nproc_per_node, ...)` is how `llmopt train` and the benchmarks start
a job: `python -m torch.distributed.run ... <target>` (torchrun is the launcher, and its
multi-node flags the scale-out path). `spawn(fn, world, *args)` runs a Python function on
`world` local gloo processes (tests, CPU benchmarks): the group is initialised from a file
store in a temporary directory, so no port can collide with another job, and a rank that
raises, dies or overruns the timeout fails the call with a `SpawnError` naming it.

`run_job(cmd)` runs the torchrun command and owns its processes: SIGINT/SIGTERM/SIGHUP to the
launcher are forwarded to torchrun's process group and to every worker (torchrun starts each
in a session of its own), and whatever is still alive `grace_s` later is killed, so stopping
`llmopt train` never leaves workers training on; if the launcher itself is killed, torchrun
gets SIGTERM from the kernel.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_lib
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from llmopt.errors import LlmoptError, UsageError


class SpawnError(LlmoptError, RuntimeError):
    """A spawned rank failed; the message names the rank and carries its traceback."""


def torchrun_command(
    target: Sequence[str],
    nproc_per_node: int,
    nnodes: str = "1",
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> list[str]:
    """`python -m torch.distributed.run [flags] <target...>`; target is `-m module args` or a
    script and its arguments. One node without a port given runs `--standalone`."""
    if nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node={nproc_per_node} must be >= 1")
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--nproc-per-node", str(nproc_per_node), "--nnodes", str(nnodes)]
    for flag, value in (
        ("--node-rank", node_rank),
        ("--master-addr", master_addr),
        ("--master-port", master_port),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if str(nnodes) == "1" and master_port is None:
        cmd += ["--standalone"]
    return cmd + list(target)


def launch_env() -> dict[str, str]:
    """The environment for launched workers: one OpenMP thread each unless set."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below `pid` (Linux /proc; empty elsewhere). The
    start time tells a process from a later one that reuses its pid."""
    found: list[tuple[int, str]] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as handle:
                    children = [int(c) for c in handle.read().split()]
            except OSError:
                continue
            for child in children:
                found.append((child, _start_time(child)))
                stack.append(child)
    return found


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _signal_all(procs: list[tuple[int, str]], signum: int) -> None:
    for pid, started in procs:
        if _start_time(pid) == started:  # still the process we saw
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the launcher dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG), so torchrun then stops its workers itself."""
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG


def run_job(cmd: list[str], env: dict[str, str] | None = None, grace_s: float = 5.0) -> int:
    """Run `cmd` (torchrun) to the end and return its exit status; a forwarded signal ends it
    (status 128 + the signal) with no process of the job left alive."""
    linux = sys.platform.startswith("linux")
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent if linux else None
    )
    received: list[int] = []
    seen: dict[int, str] = {}

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        seen.update(descendants(proc.pid))
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass
        _signal_all(list(seen.items()), signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    deadline = None
    try:
        while True:
            try:
                status = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if received and deadline is None:
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                seen.update(descendants(proc.pid))
                _signal_all([(proc.pid, _start_time(proc.pid)), *seen.items()], signal.SIGKILL)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if received:  # workers that outlived torchrun (their own sessions) go too
            _signal_all(list(seen.items()), signal.SIGKILL)
    return 128 + received[0] if received else status


def spawn(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 600.0,
    pg_timeout_s: float = 60.0,
) -> list[Any]:
    """fn(rank, world, *args) on `world` local gloo processes; results by rank.

    `fn` must be importable (a module-level function): processes are spawned."""
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/init"
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world, init, args, results_q, pg_timeout_s))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            results = _collect(procs, results_q, world, timeout_s)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    failed = sorted((r, payload) for r, (ok, payload) in results.items() if not ok)
    if failed:  # the root cause is usually the first rank that raised
        rank, payload = failed[0]
        raise SpawnError(f"rank {rank} failed:\n{payload}")
    return [results[r][1] for r in range(world)]


def _collect(procs, results_q, world: int, timeout_s: float) -> dict[int, tuple[bool, Any]]:
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    grace: float | None = None  # after a failure, the others get a moment to report
    while len(results) < world:
        try:
            rank, ok, payload = results_q.get(timeout=0.2)
            results[rank] = (ok, payload)
            if not ok and grace is None:
                grace = time.monotonic() + 5
            continue
        except queue_lib.Empty:
            pass
        # A rank that died without reporting is the root cause (its peers then fail with
        # connection errors): it is named first.
        dead = [
            r
            for r, p in enumerate(procs)
            if r not in results and not p.is_alive() and p.exitcode not in (0, None)
        ]
        if dead:
            time.sleep(0.5)  # a rank that raised may still be reporting
            while True:
                try:
                    rank, ok, payload = results_q.get_nowait()
                except queue_lib.Empty:
                    break
                results[rank] = (ok, payload)
            dead = [r for r in dead if r not in results]
            if dead:
                raise SpawnError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
        now = time.monotonic()
        if grace is not None and now > grace:
            return results
        if now > deadline:
            if any(not ok for ok, _ in results.values()):
                return results
            missing = sorted(set(range(world)) - set(results))
            raise SpawnError(f"ranks {missing} did not finish within {timeout_s:.0f}s")
    return results


def _worker(fn, rank, world, init, args, results_q, pg_timeout_s) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=init,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        results_q.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results_q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
