"""The OpenAI-compatible ASGI app (Starlette): completions, chat, SSE streaming, metrics.

Each HTTP request becomes one engine request; its tokens come back from the engine thread
through an asyncio queue. A client that goes away (mid-stream or while waiting for a
non-streamed answer) has its request aborted, which frees its KV blocks at the next step.
A body larger than `max_body_bytes` is refused (413) before it is read whole; while the server
drains (SIGTERM) or after its engine failed, new requests get 503 with Retry-After; a full
queue gets 429. Every refusal is counted by status in /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from llmopt.infer.batch import InvalidRequestError, StepOutput
from llmopt.models.tokenizer import Tokenizer
from llmopt.serve.protocol import (
    APIError,
    Parsed,
    chunk,
    completion,
    new_id,
    parse_request,
    stream_safe,
    usage,
)
from llmopt.serve.worker import EngineWorker, QueueFullError, UnavailableError

_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there
MAX_BODY_BYTES = 8 << 20  # a request body beyond this is refused (413) unread


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or APIError 413 as soon as it is known to exceed `limit` bytes (from its
    Content-Length, else while it streams in): a client cannot make the server buffer GBs."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise APIError(413, f"request body exceeds the {limit}-byte limit")
        chunks.append(piece)
    return b"".join(chunks)


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def create_app(
    worker: EngineWorker,
    tokenizer: Tokenizer,
    served_name: str,
    *,
    default_ngram: int = 0,
    drain_timeout_s: float = 60.0,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> Starlette:
    """The app; the lifespan starts `worker` and, at shutdown, lets it finish its requests."""
    context = worker.engine.max_len
    created = int(time.time())

    def error(exc: APIError) -> JSONResponse:
        worker.metrics.rejected[str(exc.status)] += 1
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def health(_: Request) -> Response:
        status = worker.status
        body = {"status": status, "running": worker.engine.num_running}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def models(_: Request) -> Response:
        card = {"id": served_name, "object": "model", "created": created, "owned_by": "llmopt"}
        return JSONResponse({"object": "list", "data": [card | {"max_model_len": context}]})

    async def metrics(_: Request) -> Response:
        text = worker.metrics.render(worker.gauges())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def generate(request: Request, chat: bool) -> Response:
        try:
            try:
                body = json.loads(await _read_body(request, max_body_bytes))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise APIError(400, f"malformed JSON body: {exc}") from exc
            parsed = parse_request(
                body,
                chat=chat,
                served_name=served_name,
                tokenizer=tokenizer,
                context=context,
                default_ngram=default_ngram,
            )
            rid = new_id(chat)
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()

            def sink(item: StepOutput | BaseException) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, item)

            try:
                worker.submit(rid, parsed.prompt, parsed.params, sink)
            except InvalidRequestError as exc:
                raise APIError(400, str(exc)) from exc
            except QueueFullError as exc:
                raise APIError(429, f"server busy: {exc}; retry later") from exc
            except UnavailableError as exc:
                raise APIError(503, f"server unavailable: {exc}") from exc
        except APIError as exc:
            return error(exc)
        if parsed.stream:
            events = _stream(worker, queue, rid, served_name, chat, parsed)
            return StreamingResponse(events, media_type="text/event-stream")
        return await _collect(worker, request, queue, rid, served_name, chat)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(worker.stop, drain_timeout_s)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ],
        lifespan=lifespan,
    )


def _failure(exc: BaseException) -> APIError:
    """What a request that failed inside the server answers: 400 for a request the engine
    refused at admission, else 500 (a bug, logged with its traceback by the worker)."""
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def _server_error(exc: BaseException) -> JSONResponse:
    failure = _failure(exc)
    return JSONResponse(failure.body(), status_code=failure.status)


async def _collect(
    worker: EngineWorker, request: Request, queue: asyncio.Queue, rid: str, model: str, chat: bool
) -> Response:
    while True:
        try:
            item = await asyncio.wait_for(queue.get(), _POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                worker.abort(rid)
                return Response(status_code=499)
            continue
        if isinstance(item, BaseException):
            return _server_error(item)
        if item.finished:
            use = usage(item.num_prompt_tokens, item.num_output_tokens)
            return JSONResponse(completion(rid, model, chat, item.text, item.finish_reason, use))


async def _stream(
    worker: EngineWorker, queue: asyncio.Queue, rid: str, model: str, chat: bool, parsed: Parsed
) -> AsyncIterator[str]:
    sent, done = "", False
    stops = parsed.params.stop
    try:
        if chat:
            yield _sse(chunk(rid, model, chat, "", None, role=True))
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                yield _sse(_failure(item).body())
                done = True
                return
            text = item.text if item.finished else stream_safe(item.text, stops)
            delta = text[len(sent) :] if text.startswith(sent) else ""
            if len(text) > len(sent):
                sent = text
            if item.finished:
                yield _sse(chunk(rid, model, chat, delta, item.finish_reason))
                if parsed.include_usage:
                    trailer = chunk(rid, model, chat, None, None)
                    trailer["usage"] = usage(item.num_prompt_tokens, item.num_output_tokens)
                    yield _sse(trailer)
                yield _sse("[DONE]")
                done = True
                return
            if delta:
                yield _sse(chunk(rid, model, chat, delta, None))
    finally:
        if not done:  # the client went away (the response task was cancelled)
            worker.abort(rid)
