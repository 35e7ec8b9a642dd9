"""The engine thread: owns the `ServingEngine`, takes requests and aborts from the HTTP side.

PyTorch releases the GIL inside its kernels, so one engine thread next to the asyncio event
loop keeps the server responsive while the model runs. Everything that touches the engine
happens on this thread; the HTTP side only enqueues (submit/abort under a lock) and receives
`StepOutput`s through the sink callback it passed in.

Faults are contained where they can be attributed: a request whose admission or output
handling raises fails alone (its client gets a 500, its KV blocks are freed) and the others go
on. A failing `ServingEngine.step()` cannot be pinned on one request of the batch: every request in
flight fails, the worker marks itself failed (health and new requests answer 503) and the
operator restarts the server, as vLLM does when its engine core dies. Every outcome is counted
in `ServingMetrics` (finished by reason, rejected by HTTP status).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from llmopt.errors import UsageError
from llmopt.infer.batch import InvalidRequestError, SamplingParams, ServingEngine, StepOutput
from llmopt.serve.metrics import ServingMetrics

Sink = Callable[[StepOutput | BaseException], None]


class QueueFullError(RuntimeError):
    """The server holds max_queue unfinished requests already (HTTP 429)."""


class UnavailableError(RuntimeError):
    """The server is shutting down (draining) or its engine failed (HTTP 503)."""


@dataclass
class _Live:
    sink: Sink
    submitted: float
    last: float | None = None


class EngineWorker:
    def __init__(self, engine: ServingEngine, max_queue: int = 256) -> None:
        if max_queue < 1:
            raise UsageError(f"max_queue={max_queue} must be >= 1")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = ServingMetrics()
        self._cv = threading.Condition()
        self._pending: list[tuple[str, list[int], SamplingParams, str | None]] = []
        # requests waiting for another to compute their prompt (n > 1 shares its KV blocks)
        self._held: dict[str, list[tuple[str, list[int], SamplingParams]]] = {}
        self._aborts: list[str] = []
        self._live: dict[str, _Live] = {}
        self._draining = False  # no new requests; the accepted ones finish
        self._stopping = False  # end the thread once nothing is left
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="llmopt-engine", daemon=True)

    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    # ---- HTTP side ----
    def submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        sink: Sink,
        after: str | None = None,
    ) -> None:
        """Queue a request; raises InvalidRequestError (400), QueueFullError (429) or
        UnavailableError (503) now. `after`: a request with the same prompt submitted before;
        this one enters the engine once that one has computed the prompt, so its full KV
        blocks come from the prefix cache instead of being computed twice."""
        self.engine.check(prompt, params)  # reads only fixed configuration
        with self._cv:
            if self._failed is not None:
                raise UnavailableError(
                    f"the engine failed ({type(self._failed).__name__}: {self._failed}); "
                    "the server must be restarted"
                )
            if self._draining or self._stopping:
                raise UnavailableError("the server is shutting down")
            if len(self._live) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self._live)} requests are queued (max_queue={self.max_queue})"
                )
            self._live[request_id] = _Live(sink, time.monotonic())
            self._pending.append((request_id, prompt, params, after))
            self.metrics.prompt_tokens += len(prompt)
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            if request_id in self._live:
                self._aborts.append(request_id)
                self._cv.notify()

    def drain(self) -> None:
        """Refuse new requests (503) and let the accepted ones finish (SIGTERM)."""
        with self._cv:
            self._draining = True

    def stop(self, timeout: float | None = None) -> None:
        """Finish every request already accepted, then end the thread."""
        with self._cv:
            self._draining = self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    @property
    def status(self) -> str:
        """ok, draining (after SIGTERM) or failed (the engine raised; restart the server)."""
        if self._failed is not None or (self._thread.ident and not self._thread.is_alive()):
            return "failed" if not self._stopping else "stopped"
        return "draining" if self._draining else "ok"

    def gauges(self) -> dict[str, tuple[float, str]]:
        state = engine_state(self.engine)
        bs = state["block_size"]
        return {
            "llmopt_queue_depth": (len(self._pending) + state["waiting"], "Requests waiting."),
            "llmopt_running_requests": (state["running"], "Requests being decoded."),
            "llmopt_kv_blocks_total": (state["blocks_total"], f"KV blocks of {bs} tokens."),
            "llmopt_kv_blocks_used": (state["blocks_used"], "KV blocks referenced by requests."),
            "llmopt_kv_blocks_needed": (
                state["blocks_needed"],
                "ceil(computed tokens / block size), summed.",
            ),
            "llmopt_prefix_cache_hit_blocks_total": (state["prefix_hits"], "Reused blocks."),
            "llmopt_preemptions_total": (state["preemptions"], "Recompute preemptions."),
            "llmopt_unfinished_requests": (len(self._live), "Accepted requests not finished."),
            "llmopt_server_up": (1.0 if self.status in ("ok", "draining") else 0.0, "1 serving."),
        }

    # ---- engine thread ----
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._pending or self._aborts or self.engine.has_unfinished()):
                    if self._stopping:
                        return
                    self._cv.wait()
                pending, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, []
            for request_id, prompt, params, after in pending:
                leader = self._live.get(after) if after is not None else None
                if leader is not None and leader.last is None:  # its prompt is not done yet
                    self._held.setdefault(after, []).append((request_id, prompt, params))
                else:
                    self._add(request_id, prompt, params)
            for request_id in aborts:
                self.engine.abort(request_id)
                self._drop(request_id, "abort")
            try:
                outputs = self.engine.step()
            except Exception as exc:  # not attributable to one request: the engine is dead
                self._engine_failed(exc)
                return
            self._dispatch(outputs)

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        except InvalidRequestError as exc:  # the client's request (HTTP 400)
            entry = self._drop(request_id, "invalid")
            if entry is not None:
                entry.sink(exc)
        except Exception as exc:  # a bug admitting this request: it fails alone
            self._fail(request_id, exc)

    def _drop(self, request_id: str, reason: str | None) -> _Live | None:
        with self._cv:
            entry = self._live.pop(request_id, None)
        if entry is not None and reason is not None:
            self.metrics.finished[reason] += 1
        if self._held:
            self._release(request_id)
        return entry

    def _release(self, leader: str) -> None:
        """Admit the requests held for `leader`'s prompt (it is computed, or will not be)."""
        for request_id, prompt, params in self._held.pop(leader, ()):
            if request_id in self._live:  # not aborted while held
                self._add(request_id, prompt, params)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            entry = self._live.get(out.request_id)
            if entry is None:
                continue
            try:
                self._deliver(entry, out, now)
            except Exception as exc:  # this request's output handling failed: it alone fails
                self._fail(out.request_id, exc)

    def _deliver(self, entry: _Live, out: StepOutput, now: float) -> None:
        """Metrics and the client's sink for one request's step output."""
        if out.new_tokens:
            self.metrics.observe_tokens(len(out.new_tokens), now)
            if entry.last is None:
                self.metrics.ttft.observe(now - entry.submitted)
                rest, gap = len(out.new_tokens) - 1, 0.0
            else:
                rest, gap = len(out.new_tokens), (now - entry.last) / len(out.new_tokens)
            for _ in range(rest):
                self.metrics.itl.observe(gap)
            entry.last = now
        entry.sink(out)
        if self._held:
            self._release(out.request_id)
        if out.finished:
            self._drop(out.request_id, out.finish_reason or "stop")

    def _fail(self, request_id: str, exc: BaseException) -> None:
        """One request failed inside the server: free it, tell its client (500), log the bug."""
        self.engine.abort(request_id)  # False when it had finished: nothing to free
        entry = self._drop(request_id, "error")
        _report(f"request {request_id} failed", exc)
        if entry is not None:
            try:
                entry.sink(exc)
            except Exception:  # noqa: BLE001 - the sink itself was the fault; nothing to tell
                pass

    def _engine_failed(self, exc: BaseException) -> None:
        self._failed = exc
        _report("the engine step failed; every request in flight fails", exc)
        with self._cv:
            live, self._live = self._live, {}
            self._held.clear()
        for request_id, entry in live.items():
            self.metrics.finished["error"] += 1
            try:
                entry.sink(exc)
            except Exception:  # noqa: BLE001 - a closed client; it is failed already
                pass
            self.engine.abort(request_id)


def _report(what: str, exc: BaseException) -> None:
    print(
        f"llmopt serve: {what}: a bug in llmopt; please report it with this traceback:",
        file=sys.stderr,
    )
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


def engine_state(engine: ServingEngine) -> dict[str, float]:
    """What /metrics reports of the engine's scheduler and KV cache. The one place the server
    reads engine internals (block manager, scheduler); a rewritten engine that lacks one of
    them reports NaN for it (never a reassuring 0) rather than breaking /metrics."""
    blocks = getattr(engine, "blocks", None)
    scheduler = getattr(engine, "scheduler", None)
    block_size = getattr(blocks, "block_size", engine.config.block_size)
    running = list(getattr(scheduler, "running", ()))
    unknown = float("nan")
    needed = unknown
    if blocks is not None and hasattr(blocks, "blocks_for"):
        needed = sum(blocks.blocks_for(r.num_computed) for r in running)
    return {
        "block_size": block_size,
        "waiting": getattr(engine, "num_waiting", 0),
        "running": getattr(engine, "num_running", len(running)),
        "blocks_total": getattr(blocks, "num_blocks", engine.config.num_blocks),
        "blocks_used": getattr(blocks, "num_used", unknown),
        "blocks_needed": needed,
        "prefix_hits": getattr(blocks, "prefix_hits", unknown),
        "preemptions": getattr(scheduler, "num_preemptions", unknown),
    }
