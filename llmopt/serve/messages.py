"""Chat messages as clients send them -> as chat templates read them (vLLM's conversions):
text content parts joined with newlines (any other part type is refused, naming it), tool-call
arguments given as JSON text turned into objects, unknown message keys refused unless empty.
"""

from __future__ import annotations

import json
from typing import Any

from llmopt.serve.errors import APIError

_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def template_messages(raw: Any) -> list[dict[str, Any]]:
    """Chat messages as the template reads them: text parts joined, tool-call arguments as
    objects (as vLLM passes them)."""
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "'messages' must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] needs a string 'role', got {m!r}", "messages")
        for key, value in m.items():
            if key not in _MESSAGE_KEYS and value not in (None, [], {}, ""):
                raise APIError(400, f"messages[{i}].{key} is not supported", "messages")
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(_text_parts(content, i))
        elif content is None and not m.get("tool_calls"):
            raise APIError(400, f"messages[{i}] needs 'content'", "messages")
        elif content is not None and not isinstance(content, str):
            raise APIError(
                400, f"messages[{i}].content must be a string or a list of parts", "messages"
            )
        message: dict[str, Any] = {"role": m["role"], "content": content}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                message[key] = m[key]
        if m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], i)
        out.append(message)
    return out


def _text_parts(parts: list, i: int) -> list[str]:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise APIError(
                400,
                f"messages[{i}].content[{j}]: content part type {kind!r} is not supported "
                "(this model reads text parts only)",
                "messages",
            )
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"messages[{i}].content[{j}] needs a string 'text'", "messages")
        texts.append(part["text"])
    return texts


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise APIError(400, f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"messages[{i}].tool_calls[{j}] needs function.name", "messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise APIError(
                    400,
                    f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {exc}",
                    "messages",
                ) from None
        call = {k: v for k, v in call.items() if k != "function"}
        out.append(call | {"type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
