"""Chat templates rendered as transformers renders them (`apply_chat_template`).

transformers is not a dependency of llmopt, so its Jinja environment is mirrored here
(transformers 5.x, `utils/chat_template_utils.py`): a sandboxed environment with
`trim_blocks`/`lstrip_blocks`, the loop controls extension (`{% break %}`, `{% continue %}`),
a `{% generation %}` block (rendered as its body: transformers only records where it lies),
`tojson` as `json.dumps` (no HTML escaping, non-ASCII kept, `indent`/`separators`/
`sort_keys`), and the globals `raise_exception`, `strftime_now`, a plain `dict` and a
`namespace` that refuses underscore names. The inputs are normalised the same way: keys whose
value is None are dropped from messages, and a message's reasoning is visible under
`reasoning_content` and `thinking` whichever name it came in. Equality with transformers'
own rendering is tested on the real templates of every registered architecture.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from llmopt.errors import LlmoptError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(LlmoptError, ValueError):
    """A chat template (the model's, not ours) that does not compile or render."""


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: marks the assistant's tokens; renders as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore attributes on a namespace: {name!r}"
                )

    class PlainDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = PlainDict()
    env.globals["namespace"] = Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"the chat template does not compile (line {exc.lineno}): {exc.message}"
        ) from None


def _plain(value: Any) -> Any:
    """JSON-like data only (what the sandbox may see); other objects become their str()."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    for kind in (bool, str, int, float):
        if isinstance(value, kind):
            return kind(value)
    return str(value)


def _normalise(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"chat message {message!r} needs a 'role' key")
        message = {k: v for k, v in _plain(message).items() if v is not None}
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    special_tokens: dict[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text of `messages` under template `source`, as transformers renders it.

    `special_tokens` ({"bos_token": ..., "eos_token": ...}) are visible to the template as
    transformers' `special_tokens_map` is; `kwargs` (e.g. `enable_thinking`) override them.
    `continue_final_message`: end the text inside the last message (no end-of-turn), for a
    model to continue it."""
    from jinja2.exceptions import TemplateError

    if not messages:
        raise ValueError("cannot render an empty conversation; pass at least one message")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt exclude each other")
    chat = _normalise(messages)
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise ValueError("continue_final_message needs a final message with text content")
        chat[-1]["content"] = final + _CONTINUE_TAG
    template = compile_template(source)
    variables = {**(special_tokens or {}), **_plain(kwargs)}
    try:
        text = template.render(
            messages=chat,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except (TemplateError, TypeError, AttributeError, IndexError, KeyError) as exc:
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line else ""
        raise ChatTemplateError(
            f"the chat template fails{where}: {type(exc).__name__}: {exc}"
        ) from None
    if final is not None:
        tag = _CONTINUE_TAG.strip()
        if tag not in text:
            raise ChatTemplateError("the chat template drops the final message's text")
        at = text.rindex(tag)
        keeps_space = text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG
        text = text[:at] if keeps_space else text[:at].rstrip()
    return text
