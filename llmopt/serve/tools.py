"""Tool calling: the `tools` / `tool_choice` fields of chat requests and reading tool calls
back out of the model's text.

A chat template that renders tools teaches the model one output format; the parser follows
the template (vLLM's `--tool-call-parser`, chosen here by reading the template):
- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them after optional text;
- `llama3_json` (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}`
  (several joined by "; "), optionally after `<|python_tag|>`.
`tool_choice="required"` and a named function do not need a parser: constrained decoding makes
the model write the call as JSON (an array of {name, parameters} / the function's arguments),
as vLLM does, so they work with any template.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from llmopt.serve.errors import APIError

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (the OpenAI wire format)

    def wire(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _call(obj: Any, key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("parameters" if key == "arguments" else "arguments", {}))
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    name = "hermes"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(_HERMES_START)
        if start < 0:
            return text, []
        calls = []
        for piece in text[start:].split(_HERMES_START)[1:]:
            body = piece.split(_HERMES_END)[0].strip()
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a well-formed call: the text stays content (as vLLM)
                return text, []
            calls.append(call)
        content = text[:start]
        return (content if content.strip() else None), calls

    def streamable(self, text: str) -> str:
        """The part of partial output that is content whatever follows."""
        start = text.find(_HERMES_START)
        if start >= 0:
            return text[:start]
        for k in range(min(len(_HERMES_START) - 1, len(text)), 0, -1):
            if text.endswith(_HERMES_START[:k]):
                return text[:-k]
        return text


class Llama3JsonParser:
    name = "llama3_json"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.lstrip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        try:
            while True:
                obj, at = decoder.raw_decode(body, at)
                call = _call(obj, "parameters")
                if call is None:
                    return text, []
                calls.append(call)
                rest = body[at:].lstrip()
                if not rest:
                    break
                if not rest.startswith(";"):  # text after the call: not a tool-call answer
                    return text, []
                at = len(body) - len(rest[1:].lstrip())
        except json.JSONDecodeError:
            return text, []
        return None, calls

    def streamable(self, text: str) -> str:
        body = text.lstrip()
        if not body or body.startswith(("{", _PYTHON_TAG[: len(body)])):
            return ""  # may be (the start of) a call: hold it until the end
        return text


def parser_for_template(template: str | None) -> HermesParser | Llama3JsonParser | None:
    """The tool-call format a chat template teaches, or None when it renders no tools."""
    if not template:
        return None
    if _HERMES_START in template and "arguments" in template and "<function=" not in template:
        return HermesParser()
    if "<|start_header_id|>" in template and "parameters" in template and "tools" in template:
        return Llama3JsonParser()
    return None


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools: `mode` auto (parse the text), required / named
    (constrained JSON), or none (tools only shown to the model)."""

    tools: list[dict[str, Any]]
    mode: str
    function: str | None = None  # the named function
    parallel: bool = True

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema constrained decoding enforces (required / named), else None."""
        params = {t["function"]["name"]: _parameters(t) for t in self.tools}
        if self.mode == "named":
            return params[self.function]
        if self.mode != "required":
            return None
        options = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in params.items()
        ]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
        return array | ({} if self.parallel else {"maxItems": 1})

    def calls(self, text: str) -> list[ToolCall]:
        """The calls of a constrained (required / named) output."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:  # cut short by max_tokens
            return [ToolCall(self.function, text)] if self.mode == "named" else []
        if self.mode == "named":
            return [ToolCall(self.function, json.dumps(value, ensure_ascii=False))]
        items = value
        return [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    schema = tool["function"].get("parameters")
    return schema if isinstance(schema, dict) else {"type": "object", "properties": {}}


def parse_tools(body: dict[str, Any], template_parser: Any) -> ToolRequest | None:
    """Validate `tools`, `tool_choice` and `parallel_tool_calls` (APIError 400)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise APIError(
            400, f"'parallel_tool_calls' must be a boolean, got {parallel!r}", "parallel_tool_calls"
        )
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list of function tools", "tools")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(
                400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools"
            )
        if not isinstance(fn.get("name"), str) or not re.fullmatch(
            r"[A-Za-z0-9_.-]{1,64}", fn["name"]
        ):
            raise APIError(
                400, f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -", "tools"
            )
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError(
                400, f"tools[{i}].function.parameters must be a JSON schema object", "tools"
            )
        names.append(fn["name"])
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise APIError(
                400,
                f"'tool_choice' {choice!r} must name one of the tools: {', '.join(names)}",
                "tool_choice",
            )
        return ToolRequest(tools, "named", name, parallel)
    if choice not in ("auto", "required", "none"):
        raise APIError(
            400,
            f"'tool_choice' must be 'auto', 'required', 'none' or a named function, got {choice!r}",
            "tool_choice",
        )
    if choice == "auto" and template_parser is None:
        raise APIError(
            400,
            "'tools' with tool_choice 'auto' need a chat template that teaches a tool-call format "
            "(hermes <tool_call> or Llama 3 JSON); this model's has none. Use tool_choice "
            "'required' or a named function (constrained decoding) instead",
            "tools",
        )
    return ToolRequest(tools, choice, None, parallel)
