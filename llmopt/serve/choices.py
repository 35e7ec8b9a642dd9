"""One HTTP request's engine requests (its choices) and what each sends back.

A request with n choices over p prompts is n x p engine requests; their outputs come back
through one asyncio queue tagged with the choice index. `Choices` submits them (all or none:
a refusal aborts those already queued), accumulates each one's tokens, logprobs and text, and
shapes them as OpenAI choices, whole or as streamed deltas.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from llmopt.infer.batch import InvalidRequestError, StepOutput
from llmopt.serve.errors import APIError
from llmopt.serve.protocol import Choice, Parsed
from llmopt.serve.responses import TokenText, stream_safe
from llmopt.serve.worker import EngineWorker, QueueFullError, UnavailableError


@dataclass
class _State:
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    finished: bool = False
    # streaming: text sent so far, the logprobs text offset, whether the prompt was echoed
    sent: str = ""
    offset: int = 0
    started: bool = False


class Choices:
    def __init__(self, worker: EngineWorker, rid: str, parsed: Parsed, text: TokenText) -> None:
        self.worker, self.rid, self.parsed, self.text = worker, rid, parsed, text
        self.states = [_State() for _ in parsed.choices]
        self.queue: asyncio.Queue[tuple[int, StepOutput | BaseException]] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None

    def _id(self, index: int) -> str:
        return f"{self.rid}-{index}"

    def submit(self) -> None:
        """Queue every choice in the engine, or none (APIError 400/429/503)."""
        self._loop = asyncio.get_running_loop()
        done = []
        try:
            for c in self.parsed.choices:
                after = None if c.after is None else self._id(c.after)
                self.worker.submit(
                    self._id(c.index), c.prompt, c.params, self._sink(c.index), after
                )
                done.append(c.index)
        except InvalidRequestError as exc:
            self._abort(done)
            raise APIError(400, str(exc)) from exc
        except QueueFullError as exc:
            self._abort(done)
            raise APIError(429, f"server busy: {exc}; retry later") from exc
        except UnavailableError as exc:
            self._abort(done)
            raise APIError(503, f"server unavailable: {exc}") from exc

    def _sink(self, index: int):
        def sink(item: StepOutput | BaseException) -> None:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, (index, item))

        return sink

    def _abort(self, indices) -> None:
        for index in indices:
            self.worker.abort(self._id(index))

    def abort(self) -> None:
        """Stop every choice still running (the client went away, or one choice failed)."""
        self._abort(i for i, s in enumerate(self.states) if not s.finished)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.states)

    def absorb(self, index: int, out: StepOutput) -> _State:
        state = self.states[index]
        state.tokens += out.new_tokens
        if out.logprobs:
            state.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = out.prompt_logprobs
        state.text = out.text
        state.finished, state.finish_reason = out.finished, out.finish_reason
        return state

    def usage_counts(self) -> tuple[int, int]:
        generated = 0 if self.parsed.echo_only else sum(len(s.tokens) for s in self.states)
        return self.parsed.prompt_tokens, generated

    # ---- whole responses ----
    def completion(self, index: int) -> dict[str, Any]:
        choice, state, parsed = self.parsed.choices[index], self.states[index], self.parsed
        tokens, entries, text = [], [], ""
        if parsed.echo:
            tokens, entries, text = (
                list(choice.prompt),
                list(state.prompt_logprobs),
                choice.prompt_text,
            )
        if not parsed.echo_only:
            tokens += state.tokens
            entries += state.logprobs
            text += state.text
        logprobs = None
        if parsed.logprobs is not None:
            logprobs, _ = self.text.completion_logprobs(tokens, entries)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": state.finish_reason,
        }

    def chat(self, index: int) -> dict[str, Any]:
        state = self.states[index]
        content, calls, reason = self._tool_calls(state)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        logprobs = None
        if self.parsed.logprobs is not None:
            logprobs = {"content": self.text.chat_logprobs(state.tokens, state.logprobs)}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def _tool_calls(self, state: _State) -> tuple[str | None, list[dict], str | None]:
        """(content, tool_calls, finish_reason) of a finished chat choice."""
        tools, reason = self.parsed.tools, state.finish_reason
        if tools is None or tools.mode == "none":
            return state.text, [], reason
        if tools.mode in ("named", "required"):
            content, calls = None, tools.calls(state.text)
        else:
            content, calls = self.parsed.tool_parser.parse(state.text)
        if not tools.parallel:
            calls = calls[:1]
        if calls and tools.mode != "named":
            reason = "tool_calls"  # OpenAI: a named call finishes with "stop"
        return content, [c.wire() for c in calls], reason

    # ---- streamed deltas ----
    def completion_delta(self, index: int, out: StepOutput) -> dict[str, Any] | None:
        choice, state, parsed = self.parsed.choices[index], self.states[index], self.parsed
        text = state.text if state.finished else stream_safe(state.text, choice.params.stop)
        tokens, entries, delta = [], [], ""
        if parsed.echo and not state.started:
            tokens, entries, delta = (
                list(choice.prompt),
                list(state.prompt_logprobs),
                choice.prompt_text,
            )
        state.started = True
        if not parsed.echo_only:
            if text.startswith(state.sent) and len(text) > len(state.sent):
                delta += text[len(state.sent) :]
                state.sent = text
            tokens += out.new_tokens
            entries += out.logprobs or []
        logprobs = None
        if parsed.logprobs is not None and tokens:
            logprobs, state.offset = self.text.completion_logprobs(tokens, entries, state.offset)
        if not (delta or logprobs or state.finished):
            return None
        reason = state.finish_reason if state.finished else None
        return {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}

    def chat_deltas(self, index: int, out: StepOutput) -> list[dict[str, Any]]:
        """The chunks' choices for one output of a chat choice (tool calls come whole, at
        the end: the text before them streams as content)."""
        choice, state, parsed = self.parsed.choices[index], self.states[index], self.parsed
        tools = parsed.tools
        held = tools is not None and tools.mode in ("named", "required")
        text = state.text if state.finished else stream_safe(state.text, choice.params.stop)
        if held:
            text = ""
        elif parsed.tool_parser is not None and not state.finished:
            text = parsed.tool_parser.streamable(text)
        calls: list[dict] = []
        reason = state.finish_reason
        if state.finished and tools is not None and tools.mode != "none":
            content, calls, reason = self._tool_calls(state)
            text = content if content is not None and content.startswith(state.sent) else state.sent
        delta = ""
        if text.startswith(state.sent) and len(text) > len(state.sent):
            delta, state.sent = text[len(state.sent) :], text
        logprobs = None
        if parsed.logprobs is not None and out.new_tokens:
            logprobs = {"content": self.text.chat_logprobs(out.new_tokens, out.logprobs or [])}
        deltas = []
        if delta or logprobs:
            deltas.append(_chat_delta(index, {"content": delta}, logprobs, None))
        if calls:
            for k, call in enumerate(calls):
                call["index"] = k
            deltas.append(_chat_delta(index, {"tool_calls": calls}, None, None))
        if state.finished:
            deltas.append(_chat_delta(index, {}, None, reason))
        return deltas


def _chat_delta(index: int, delta: dict, logprobs: dict | None, reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


def first_chat_delta(index: int) -> dict[str, Any]:
    return _chat_delta(index, {"role": "assistant", "content": ""}, None, None)


__all__ = ["Choice", "Choices", "first_chat_delta"]
