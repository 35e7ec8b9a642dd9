"""OpenAI wire format, request side: a completions / chat body -> the engine requests it asks for.

The surface of vLLM's server: `n` choices per prompt (seeds `seed + i`, as vLLM derives them),
batched prompts (strings or token-id lists), `echo`, `logprobs` / `top_logprobs`, content-part
messages, the penalties, `min_p`, `logit_bias`, `response_format` (JSON object / JSON schema
through constrained decoding) and `tools`. Every other field is refused with a 400 naming it
unless it carries the value that changes nothing (`best_of` = n, `suffix` = "", null...): a
field the server would silently ignore is never answered with a 200.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llmopt.errors import LlmoptError
from llmopt.infer.batch import InvalidRequestError, SamplingParams
from llmopt.infer.guided import GrammarCompiler, GrammarError
from llmopt.infer.sampling import MAX_LOGPROBS
from llmopt.models.tokenizer import Tokenizer
from llmopt.serve.errors import APIError
from llmopt.serve.messages import template_messages
from llmopt.serve.tools import ToolRequest, parse_tools, parser_for_template

__all__ = ["APIError", "Choice", "Parsed", "RequestParser"]

MAX_N = 128  # choices per prompt
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream",
    "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
    "logit_bias", "ignore_eos", "ngram", "user", "response_format", "logprobs", "best_of",
}  # fmt: skip
_FIELDS = {
    False: _COMMON | {"prompt", "echo"},
    True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                     "parallel_tool_calls"},
}  # fmt: skip
# fields not implemented, accepted only with the value that changes nothing
_NO_OP = {
    "suffix": ("",), "store": (False,), "service_tier": ("auto", "default"), "echo": (False,),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "add_generation_prompt": (True,),
    "continue_final_message": (False,), "modalities": (["text"],), "metadata": ({},),
}  # fmt: skip


@dataclass
class Choice:
    """One engine request: choice `index` of the response. `after`: the index of the choice
    that computes the same prompt first (its KV blocks then serve this one from the prefix
    cache); None to start at once."""

    index: int
    prompt: list[int]
    params: SamplingParams
    prompt_text: str = ""
    after: int | None = None


@dataclass
class Parsed:
    choices: list[Choice]
    prompt_tokens: int  # each prompt once, however many choices it has
    stream: bool
    include_usage: bool
    echo: bool = False
    echo_only: bool = False  # max_tokens=0 with echo: the prompt (and its logprobs) only
    logprobs: int | None = None  # alternatives per token in the response, when asked for
    tools: ToolRequest | None = None
    tool_parser: Any = None  # reads tool calls out of the text (tool_choice auto)


def _get(body: dict, key: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise APIError(400, f"'{key}' must be {names}, got {value!r}", key)
    return value


def _token_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


class RequestParser:
    """Validates request bodies for one served model (APIError 400 otherwise)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        served_name: str,
        context: int,
        vocab_size: int,
        default_ngram: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.served_name = served_name
        self.context = context
        self.vocab_size = vocab_size
        self.default_ngram = default_ngram
        self.tool_parser = parser_for_template(tokenizer.chat_template)
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        if self._grammars is None:
            eos = getattr(self.tokenizer, "eos_token_ids", None) or [self.tokenizer.eos_token_id]
            self._grammars = GrammarCompiler(
                self.tokenizer.backend.to_str(),
                self.vocab_size,
                [t for t in eos if t is not None],
            )
        return self._grammars

    def __call__(self, body: Any, *, chat: bool) -> Parsed:
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        self._check_fields(body, chat)
        model = body.get("model", self.served_name)
        if model != self.served_name:
            raise APIError(
                400,
                f"model {model!r} does not exist; this server serves {self.served_name!r}",
                "model",
                "model_not_found",
            )
        n = _get(body, "n", (int,), 1)
        if not 1 <= n <= MAX_N:
            raise APIError(400, f"'n' must be in [1, {MAX_N}], got {n}", "n")
        if body.get("best_of") not in (None, n):
            raise APIError(400, f"'best_of' other than n={n} is not supported", "best_of")
        tools = parse_tools(body, self.tool_parser) if chat else None
        echo = False if chat else _get(body, "echo", (bool,), False)
        logprobs = self._logprobs(body, chat)
        if chat:
            prompts = [(self.chat_prompt(body.get("messages"), tools), "")]
        else:
            prompts = self._completion_prompts(body.get("prompt"), echo)
        max_tokens = self._max_tokens(body, chat, min(len(p) for p, _ in prompts))
        echo_only = echo and max_tokens == 0
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (
            not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)
        ):
            raise APIError(
                400, f"'stop' must be a string or a list of strings, got {stop!r}", "stop"
            )
        options = self._stream_options(body)
        bias = _get(body, "logit_bias", (dict,), {})
        try:
            bias = tuple((int(k), max(-100.0, min(100.0, float(v)))) for k, v in bias.items())
        except (TypeError, ValueError):
            raise APIError(
                400, "'logit_bias' must map token ids to numbers", "logit_bias"
            ) from None
        try:
            params = SamplingParams(
                max_tokens=1 if echo_only else max_tokens,
                temperature=_get(body, "temperature", (int, float), 1.0),
                top_p=_get(body, "top_p", (int, float), 1.0),
                top_k=_get(body, "top_k", (int,), 0),
                seed=_get(body, "seed", (int,), None),
                stop=tuple(stop or ()),
                ignore_eos=_get(body, "ignore_eos", (bool,), False),
                ngram=_get(body, "ngram", (int,), self.default_ngram),
                presence_penalty=_get(body, "presence_penalty", (int, float), 0.0),
                frequency_penalty=_get(body, "frequency_penalty", (int, float), 0.0),
                repetition_penalty=_get(body, "repetition_penalty", (int, float), 1.0),
                min_p=_get(body, "min_p", (int, float), 0.0),
                logit_bias=bias,
                logprobs=logprobs,
                prompt_logprobs=logprobs if echo else None,
                grammar=self._grammar(body, tools),
            )
        except InvalidRequestError as exc:
            raise APIError(400, str(exc)) from exc
        choices = []
        for p, (prompt, text) in enumerate(prompts):
            self._check_room(prompt, params.max_tokens)
            for i in range(n):
                seed = None if params.seed is None else params.seed + i
                after = None if i == 0 or echo else p * n
                choice_params = params if i == 0 else dataclasses.replace(params, seed=seed)
                choices.append(Choice(p * n + i, prompt, choice_params, text, after))
        return Parsed(
            choices,
            sum(len(prompt) for prompt, _ in prompts),
            bool(_get(body, "stream", (bool,), False)),
            bool(options.get("include_usage")),
            echo=echo,
            echo_only=echo_only,
            logprobs=logprobs,
            tools=tools,
            tool_parser=self.tool_parser if tools is not None and tools.mode == "auto" else None,
        )

    # ---- pieces ----
    def _check_fields(self, body: dict, chat: bool) -> None:
        for key, value in body.items():
            if key in _FIELDS[chat] or value is None:
                continue
            if key in _NO_OP and value in _NO_OP[key]:
                continue
            where = "chat completions" if chat else "completions"
            raise APIError(400, f"'{key}' is not supported for {where} by this server", key)

    def _stream_options(self, body: dict) -> dict:
        options = _get(body, "stream_options", (dict,), {})
        if options and not body.get("stream"):
            raise APIError(400, "'stream_options' needs 'stream': true", "stream_options")
        for key, value in options.items():
            if key == "include_usage" and isinstance(value, bool):
                continue
            if key == "continuous_usage_stats" and value in (None, False):
                continue
            raise APIError(
                400, f"'stream_options.{key}'={value!r} is not supported", "stream_options"
            )
        return options

    def _logprobs(self, body: dict, chat: bool) -> int | None:
        if not chat:
            value = _get(body, "logprobs", (int,), None)
        else:
            top = _get(body, "top_logprobs", (int,), None)
            if not _get(body, "logprobs", (bool,), False):
                if top is not None:
                    raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
                return None
            value = top or 0
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            key = "top_logprobs" if chat else "logprobs"
            raise APIError(400, f"'{key}' must be in [0, {MAX_LOGPROBS}], got {value}", key)
        return value

    def _completion_prompts(self, raw: Any, echo: bool) -> list[tuple[list[int], str]]:
        if isinstance(raw, str) or _token_list(raw):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise APIError(
                400,
                "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists",
                "prompt",
            )
        prompts = []
        for i, item in enumerate(raw):
            if isinstance(item, str):
                ids = self.tokenizer.encode(item, add_bos=self.tokenizer.add_bos)
                prompts.append((ids, item))
            elif _token_list(item):
                bad = [t for t in item if not 0 <= t < self.vocab_size]
                if bad:
                    raise APIError(
                        400,
                        f"prompt[{i}] token ids {bad[:5]} are outside the vocabulary "
                        f"[0, {self.vocab_size})",
                        "prompt",
                    )
                prompts.append((list(item), self.tokenizer.decode(item) if echo else ""))
            else:
                raise APIError(
                    400, f"prompt[{i}] must be a string or a non-empty list of token ids", "prompt"
                )
            if not prompts[-1][0]:
                raise APIError(400, "the prompt is empty", "prompt")
        return prompts

    def chat_prompt(self, raw: Any, tools: ToolRequest | None) -> list[int]:
        """The prompt token ids of chat messages (validated) and tool definitions."""
        messages = template_messages(raw)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools.tools if tools is not None else None
            )
        except (LlmoptError, ValueError) as exc:
            raise APIError(400, str(exc), "messages") from exc
        prompt = self.tokenizer.encode(text, add_bos=False)
        if not prompt:
            raise APIError(400, "the prompt is empty", "messages")
        return prompt

    def _max_tokens(self, body: dict, chat: bool, shortest: int) -> int:
        room = self.context - shortest
        if room < 1:
            raise APIError(
                400,
                f"prompt of {shortest} tokens does not fit the model context of {self.context} "
                "tokens",
                "prompt",
                "context_length_exceeded",
            )
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        return _get(body, key, (int,), min(256, room) if chat else min(16, room))

    def _check_room(self, prompt: list[int], max_tokens: int) -> None:
        room = self.context - len(prompt)
        if room < 1:
            raise APIError(
                400,
                f"prompt of {len(prompt)} tokens does not fit the model context of "
                f"{self.context} tokens",
                "prompt",
                "context_length_exceeded",
            )
        if len(prompt) + max_tokens > self.context:
            raise APIError(
                400,
                f"prompt of {len(prompt)} tokens + max_tokens={max_tokens} exceeds the model "
                f"context of {self.context} tokens; use max_tokens <= {room}",
                "max_tokens",
                "context_length_exceeded",
            )

    def _grammar(self, body: dict, tools: ToolRequest | None):
        schema, param, fmt = None, "response_format", body.get("response_format")
        if fmt is not None:
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            if kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(
                        400,
                        "response_format json_schema needs {'json_schema': {'name': ..., "
                        "'schema': {...}}}",
                        param,
                    )
            elif kind == "json_object":
                schema = {"type": "object"}
            elif kind != "text":
                raise APIError(
                    400,
                    f"response_format type {kind!r} is not supported; use 'text', "
                    "'json_object' or 'json_schema'",
                    param,
                )
        tool_schema = tools.schema() if tools is not None else None
        if tool_schema is not None:
            if schema is not None:
                raise APIError(
                    400,
                    "response_format and tool_choice required/named both constrain the "
                    "output; send one of them",
                    "tool_choice",
                )
            schema, param = tool_schema, "tools"
        if schema is None:
            return None
        try:
            return self.grammars.json_schema(schema)
        except GrammarError as exc:
            raise APIError(400, str(exc), param) from exc
