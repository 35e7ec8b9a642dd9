"""OpenAI wire format: request bodies -> (prompt ids, SamplingParams), and response objects.

Only what the engine supports is accepted; anything else a client could rely on (n > 1,
logprobs, echo, suffix) is refused with a 400 naming the field rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from llmopt.infer.batch import InvalidRequestError, SamplingParams
from llmopt.models.tokenizer import Tokenizer


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 429:
            kind = "rate_limit_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


@dataclass
class Parsed:
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


_UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "best_of", "logit_bias", "tools")


def _get(body: dict, key: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise APIError(400, f"'{key}' must be {names}, got {value!r}", key)
    return value


def parse_request(
    body: Any,
    *,
    chat: bool,
    served_name: str,
    tokenizer: Tokenizer,
    context: int,
    default_ngram: int = 0,
) -> Parsed:
    """Validate an OpenAI completions / chat-completions body (APIError 400 otherwise)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model", served_name)
    if model != served_name:
        raise APIError(
            400,
            f"model {model!r} does not exist; this server serves {served_name!r}",
            "model",
            "model_not_found",
        )
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, False, 0, [], {}):
            raise APIError(400, f"'{key}' is not supported by this server", key)
    if _get(body, "n", (int,), 1) != 1:
        raise APIError(400, "only n=1 is supported", "n")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(
                400, "'messages' must be a non-empty list of {role, content}", "messages"
            )
        for m in messages:
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise APIError(400, f"message {m!r} needs string 'role' and 'content'", "messages")
        try:
            text = tokenizer.apply_chat_template(
                [{"role": m["role"], "content": m["content"]} for m in messages]
            )
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from exc
        prompt = tokenizer.encode(text, add_bos=False)
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if isinstance(raw, str):
            prompt = tokenizer.encode(raw, add_bos=tokenizer.add_bos)
        elif (
            isinstance(raw, list)
            and raw
            and all(isinstance(t, int) and not isinstance(t, bool) for t in raw)
        ):
            prompt = list(raw)
        else:
            raise APIError(
                400, "'prompt' must be a string, a one-string list or a list of token ids", "prompt"
            )
    if not prompt:
        raise APIError(400, "the prompt is empty", "prompt")
    room = context - len(prompt)
    if room < 1:
        raise APIError(
            400,
            f"prompt of {len(prompt)} tokens does not fit the model context of {context} tokens",
            "prompt",
            "context_length_exceeded",
        )
    default_max = min(256, room) if chat else min(16, room)
    max_tokens = _get(
        body,
        "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
        (int,),
        default_max,
    )
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)
    ):
        raise APIError(400, f"'stop' must be a string or a list of strings, got {stop!r}", "stop")
    options = _get(body, "stream_options", (dict,), {})
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_get(body, "temperature", (int, float), 1.0),
            top_p=_get(body, "top_p", (int, float), 1.0),
            top_k=_get(body, "top_k", (int,), 0),
            seed=_get(body, "seed", (int,), None),
            stop=tuple(stop or ()),
            ignore_eos=_get(body, "ignore_eos", (bool,), False),
            ngram=_get(body, "ngram", (int,), default_ngram),
        )
    except InvalidRequestError as exc:
        raise APIError(400, str(exc)) from exc
    if len(prompt) + params.max_tokens > context:
        raise APIError(
            400,
            f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} exceeds the model "
            f"context of {context} tokens; use max_tokens <= {room}",
            "max_tokens",
            "context_length_exceeded",
        )
    return Parsed(
        prompt,
        params,
        bool(_get(body, "stream", (bool,), False)),
        bool(options.get("include_usage")),
    )


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(rid: str, model: str, chat: bool, text: str, reason: str | None, use: dict) -> dict:
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice |= {"text": text, "logprobs": None}
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chunk(
    rid: str, model: str, chat: bool, delta: str | None, reason: str | None, role: bool = False
) -> dict:
    """One streamed chunk; `delta=None` yields an empty-choices chunk (for the usage trailer)."""
    choices: list[dict[str, Any]] = []
    if delta is not None:
        if chat:
            d: dict[str, Any] = (
                {"role": "assistant", "content": delta}
                if role
                else ({"content": delta} if delta else {})
            )
            choices = [{"index": 0, "delta": d, "finish_reason": reason}]
        else:
            choices = [{"index": 0, "text": delta, "logprobs": None, "finish_reason": reason}]
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def stream_safe(text: str, stops: tuple[str, ...]) -> str:
    """The part of partial output text that can be sent now: hold back an incomplete UTF-8
    character and any tail that might still grow into a stop string."""
    base = text.rstrip("\ufffd")
    hold = 0
    for s in stops:
        hold = max(
            hold,
            next((k for k in range(min(len(s) - 1, len(base)), 0, -1) if base.endswith(s[:k])), 0),
        )
    return base[: len(base) - hold]
