"""The OpenAI-compatible ASGI app (Starlette): completions, chat, SSE streaming, metrics.

Each HTTP request becomes one engine request per choice (n choices of each prompt); their
tokens come back from the engine thread through an asyncio queue. A client that goes away
(mid-stream or while waiting for a non-streamed answer) has its requests aborted, which frees
their KV blocks at the next step. vLLM's tokenizer endpoints (/tokenize, /detokenize,
/tokenizer_info) let clients such as lm-eval's `local-completions` count tokens as we do.
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

from llmopt.infer.batch import InvalidRequestError
from llmopt.models.tokenizer import Tokenizer
from llmopt.serve.choices import Choices, first_chat_delta
from llmopt.serve.errors import APIError
from llmopt.serve.protocol import RequestParser
from llmopt.serve.responses import TokenText, body, new_id, usage
from llmopt.serve.worker import EngineWorker

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


# bodies whose parsing may compile a grammar (a second on first use): parsed off the event loop
_HEAVY = ("response_format", "tools", "tool_choice")


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
    parser = RequestParser(
        tokenizer,
        served_name=served_name,
        context=context,
        vocab_size=worker.engine.vocab_size,
        default_ngram=default_ngram,
    )
    token_text = TokenText(tokenizer)

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

    async def read_json(request: Request) -> object:
        try:
            return json.loads(await _read_body(request, max_body_bytes))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"malformed JSON body: {exc}") from exc

    async def generate(request: Request, chat: bool) -> Response:
        try:
            data = await read_json(request)
            if isinstance(data, dict) and any(data.get(k) is not None for k in _HEAVY):
                parsed = await asyncio.to_thread(parser, data, chat=chat)
            else:
                parsed = parser(data, chat=chat)
            choices = Choices(worker, new_id(chat), parsed, token_text)
            choices.submit()
        except APIError as exc:
            return error(exc)
        if parsed.stream:
            events = _stream(choices, served_name, chat)
            return StreamingResponse(events, media_type="text/event-stream")
        return await _collect(choices, request, served_name, chat)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def tokenize(request: Request) -> Response:
        try:
            data = await read_json(request)
            ids = _tokenize(parser, data)
        except APIError as exc:
            return error(exc)
        return JSONResponse(
            {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": None}
        )

    async def detokenize(request: Request) -> Response:
        try:
            data = await read_json(request)
            ids = data.get("tokens") if isinstance(data, dict) else None
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < parser.vocab_size
                for t in ids
            ):
                raise APIError(400, "'tokens' must be a list of token ids of this model", "tokens")
        except APIError as exc:
            return error(exc)
        return JSONResponse({"prompt": tokenizer.decode(ids)})

    async def tokenizer_info(_: Request) -> Response:
        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tokenizer.id_to_token(token_id)

        return JSONResponse(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": text(tokenizer.bos_token_id),
                "eos_token": text(tokenizer.eos_token_id),
                "pad_token": None,
                "add_bos_token": tokenizer.add_bos,
                "chat_template": tokenizer.chat_template,
                "model_max_length": context,
            }
        )

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
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/tokenizer_info", tokenizer_info),
        ],
        lifespan=lifespan,
    )


def _tokenize(parser: RequestParser, data: object) -> list[int]:
    """vLLM's /tokenize: {"prompt": text, "add_special_tokens"} or {"messages": [...]}."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    tokenizer = parser.tokenizer
    if "messages" in data:
        return parser.chat_prompt(data["messages"], None)
    prompt = data.get("prompt")
    if not isinstance(prompt, str):
        raise APIError(400, "'prompt' must be a string (or send 'messages')", "prompt")
    special = data.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise APIError(400, "'add_special_tokens' must be a boolean", "add_special_tokens")
    return tokenizer.encode(prompt, add_bos=special and tokenizer.add_bos)


def _failure(exc: BaseException) -> APIError:
    """What a request that failed inside the server answers: 400 for a request the engine
    refused at admission, else 500 (a bug, logged with its traceback by the worker)."""
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def _server_error(exc: BaseException) -> JSONResponse:
    failure = _failure(exc)
    return JSONResponse(failure.body(), status_code=failure.status)


async def _collect(choices: Choices, request: Request, model: str, chat: bool) -> Response:
    while not choices.finished:
        try:
            index, item = await asyncio.wait_for(choices.queue.get(), _POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                choices.abort()
                return Response(status_code=499)
            continue
        if isinstance(item, BaseException):
            choices.abort()
            return _server_error(item)
        choices.absorb(index, item)
    shape = choices.chat if chat else choices.completion
    result = [shape(i) for i in range(len(choices.states))]
    return JSONResponse(body(choices.rid, model, chat, result, usage(*choices.usage_counts())))


async def _stream(choices: Choices, model: str, chat: bool) -> AsyncIterator[str]:
    rid, done = choices.rid, False
    try:
        if chat:
            for i in range(len(choices.states)):
                yield _sse(body(rid, model, chat, [first_chat_delta(i)], None))
        while not choices.finished:
            index, item = await choices.queue.get()
            if isinstance(item, BaseException):
                choices.abort()
                yield _sse(_failure(item).body())
                done = True
                return
            choices.absorb(index, item)
            if chat:
                for delta in choices.chat_deltas(index, item):
                    yield _sse(body(rid, model, chat, [delta], None))
            else:
                delta = choices.completion_delta(index, item)
                if delta is not None:
                    yield _sse(body(rid, model, chat, [delta], None))
        if choices.parsed.include_usage:
            trailer = body(rid, model, chat, [], None)
            trailer["usage"] = usage(*choices.usage_counts())
            yield _sse(trailer)
        yield _sse("[DONE]")
        done = True
    finally:
        if not done:  # the client went away (the response task was cancelled)
            choices.abort()
