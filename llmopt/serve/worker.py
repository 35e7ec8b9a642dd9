"""The engine thread: owns the `Engine`, takes requests and aborts from the HTTP side.

PyTorch releases the GIL inside its kernels, so one engine thread next to the asyncio event
loop keeps the server responsive while the model runs. Everything that touches the engine
happens on this thread; the HTTP side only enqueues (submit/abort under a lock) and receives
`StepOutput`s through the sink callback it passed in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmopt.errors import UsageError
from llmopt.infer.batch import Engine, SamplingParams, StepOutput
from llmopt.serve.metrics import ServingMetrics

Sink = Callable[[StepOutput | BaseException], None]


class QueueFullError(RuntimeError):
    """The server holds max_queue unfinished requests already (HTTP 429)."""


@dataclass
class _Live:
    sink: Sink
    submitted: float
    last: float | None = None


class EngineWorker:
    def __init__(self, engine: Engine, max_queue: int = 256) -> None:
        if max_queue < 1:
            raise UsageError(f"max_queue={max_queue} must be >= 1")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = ServingMetrics()
        self._cv = threading.Condition()
        self._pending: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._live: dict[str, _Live] = {}
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="llmopt-engine", daemon=True)

    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    # ---- HTTP side ----
    def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, sink: Sink
    ) -> None:
        """Queue a request; raises InvalidRequestError (bad request) or QueueFullError now."""
        self.engine.check(prompt, params)  # reads only fixed configuration
        with self._cv:
            if self._error is not None:
                raise RuntimeError(f"the engine thread failed: {self._error!r}")
            if self._stopping:
                raise QueueFullError("the server is shutting down")
            if len(self._live) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self._live)} requests are queued (max_queue={self.max_queue})"
                )
            self._live[request_id] = _Live(sink, time.monotonic())
            self._pending.append((request_id, prompt, params))
            self.metrics.prompt_tokens += len(prompt)
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            if request_id in self._live:
                self._aborts.append(request_id)
                self._cv.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Finish every request already accepted, then end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    def gauges(self) -> dict[str, tuple[float, str]]:
        e = self.engine
        bs = e.blocks.block_size
        needed = sum(e.blocks.blocks_for(r.num_computed) for r in list(e.scheduler.running))
        return {
            "llmopt_queue_depth": (len(self._pending) + e.num_waiting, "Requests waiting."),
            "llmopt_running_requests": (e.num_running, "Requests being decoded."),
            "llmopt_kv_blocks_total": (e.blocks.num_blocks, f"KV blocks of {bs} tokens."),
            "llmopt_kv_blocks_used": (e.blocks.num_used, "KV blocks referenced by requests."),
            "llmopt_kv_blocks_needed": (needed, "ceil(computed tokens / block size), summed."),
            "llmopt_prefix_cache_hit_blocks_total": (e.blocks.prefix_hits, "Reused blocks."),
            "llmopt_preemptions_total": (e.scheduler.num_preemptions, "Recompute preemptions."),
        }

    # ---- engine thread ----
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._pending or self._aborts or self.engine.has_unfinished()):
                        if self._stopping:
                            return
                        self._cv.wait()
                    pending, self._pending = self._pending, []
                    aborts, self._aborts = self._aborts, []
                for request_id, prompt, params in pending:
                    self._add(request_id, prompt, params)
                for request_id in aborts:
                    self.engine.abort(request_id)
                    self._drop(request_id, "abort")
                self._dispatch(self.engine.step())
        except BaseException as exc:  # a bug: fail every waiting client instead of hanging
            self._error = exc
            with self._cv:
                live, self._live = self._live, {}
            for entry in live.values():
                entry.sink(exc)
            raise

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        except ValueError as exc:
            entry = self._drop(request_id, None)
            if entry is not None:
                entry.sink(exc)

    def _drop(self, request_id: str, reason: str | None) -> _Live | None:
        with self._cv:
            entry = self._live.pop(request_id, None)
        if entry is not None and reason is not None:
            self.metrics.finished[reason] += 1
        return entry

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            entry = self._live.get(out.request_id)
            if entry is None:
                continue
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
            if out.finished:
                self._drop(out.request_id, out.finish_reason or "stop")
            entry.sink(out)
