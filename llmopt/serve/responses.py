"""OpenAI wire format, response side: choices, logprobs objects, streamed chunks, usage.

Log-probabilities are shaped as vLLM shapes them: completions give `tokens`, `token_logprobs`,
`top_logprobs` (a {token: logprob} dict per position holding the chosen token and the
`logprobs` best) and `text_offset`; chat gives `content` entries {token, logprob, bytes,
top_logprobs}. A token's text is its own decoding (`tokenizer.decode([id])`), -inf is sent as
-9999.0, and an echoed prompt's first position has no logprob (null).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from llmopt.infer.batch.request import TokenLogprobs
from llmopt.models.tokenizer import Tokenizer

_FLOOR = -9999.0  # what JSON gets for -inf (vLLM's and OpenAI's convention)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def body(rid: str, model: str, chat: bool, choices: list[dict], use: dict | None) -> dict:
    """A whole response (`use` given) or one streamed chunk (`use` None)."""
    if use is None:
        kind = "chat.completion.chunk" if chat else "text_completion"
    else:
        kind = "chat.completion" if chat else "text_completion"
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": model}
    out["choices"] = choices
    if use is not None:
        out["usage"] = use
    return out


class TokenText:
    """Token ids -> their text as logprobs report it (cached: a vocabulary is finite)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self.tokenizer.decode([token])
        return text

    def completion_logprobs(
        self,
        tokens: list[int],
        entries: list[TokenLogprobs | None],
        offset: int = 0,
    ) -> tuple[dict[str, list], int]:
        """The completions `logprobs` object of `tokens` and the text offset after them."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        out["text_offset"] = []
        for token, entry in zip(tokens, entries, strict=True):
            text = self(token)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            logprob, top = entry
            out["token_logprobs"].append(max(logprob, _FLOOR))
            alternatives = {text: max(logprob, _FLOOR)}
            for alt, value in top:
                alternatives.setdefault(self(alt), max(value, _FLOOR))
            out["top_logprobs"].append(alternatives)
        return out, offset

    def _chat_entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self(token)
        value = max(logprob, _FLOOR)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8", "replace"))}

    def chat_logprobs(self, tokens: list[int], entries: list[TokenLogprobs]) -> list[dict]:
        """The chat `logprobs.content` entries of `tokens`."""
        content = []
        for token, (logprob, top) in zip(tokens, entries, strict=True):
            entry = self._chat_entry(token, logprob)
            entry["top_logprobs"] = [self._chat_entry(t, v) for t, v in top]
            content.append(entry)
        return content


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
