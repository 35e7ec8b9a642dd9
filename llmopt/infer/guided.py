"""Constrained decoding: grammars (JSON schema, regex, choices, Lark) over the model's tokenizer.

llguidance (the library vLLM and llama.cpp use) compiles a grammar against the tokenizer's
token trie and, at every step, says which tokens may come next; the engine masks all others
before sampling, so the output always belongs to the grammar (a JSON-schema output parses and
validates) unless max_tokens cuts it short. A `GrammarCompiler` belongs to one tokenizer: it
builds llguidance's tokenizer once (about a second for a 50k vocabulary) and caches compiled
grammars. A compiled `Grammar` is immutable and rides in `SamplingParams`; each request gets
its own `GrammarMatcher` (the parse state) from it.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from typing import Any

import torch

from llmopt.infer.sampling import InvalidRequestError

# Whitespace JSON may hold between tokens: none, one space, or one or two newlines and up to 20
# spaces/tabs of indentation (llama.cpp's json-schema grammars). Unbounded whitespace (vLLM's
# default) lets a model loop on blanks until max_tokens; a schema can still choose its own
# with llguidance's "x-guidance" key.
_log = logging.getLogger(__name__)
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"


class GrammarError(InvalidRequestError):
    """A grammar or schema that does not compile (the server answers 400)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # a declared dependency; only a broken install lacks it
        raise GrammarError(
            "constrained decoding needs the llguidance package: pip install llguidance"
        ) from exc
    return llguidance


class GrammarMatcher:
    """One request's parse state: the tokens allowed next, and advancing by the chosen one."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: list[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens the grammar accepts next (EOS once it may end).
        Never empty: should the parser fail (a bug), only EOS is allowed, which ends the
        request instead of the server's engine."""
        self._matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        bits = (self._words.unsqueeze(-1) >> self._shifts) & 1
        allowed = bits.view(-1)[: self.vocab_size].bool()
        if not allowed.any():
            _log.error("grammar %s allows no token: %s", self, self._matcher.get_error())
            allowed[self.eos_ids] = True
        return allowed

    def advance(self, token: int) -> None:
        """Consume the chosen token. A refused token (a bug) leaves the matcher stopped, so
        the request finishes (`finished`) rather than failing the engine step."""
        if not self._matcher.consume_token(int(token)):
            _log.error("grammar %s refused token %d: %s", self, token, self._matcher.get_error())

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits no further token (only EOS)."""
        return self._matcher.is_stopped()


class Grammar:
    """A compiled constraint (immutable); `matcher()` starts a fresh parse of it."""

    def __init__(
        self, description: str, prototype: Any, vocab_size: int, eos_ids: list[int]
    ) -> None:
        self.description = description
        self._prototype = prototype
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy(), self.vocab_size, self.eos_ids)

    def __repr__(self) -> str:
        return f"Grammar({self.description})"


class GrammarCompiler:
    """Compiles grammars for one tokenizer (`tokenizer_json`: its HF `tokenizer.json` text)
    over a model vocabulary of `vocab_size` ids (it may exceed the tokenizer's: padding ids
    are never allowed). `eos_ids`: the ids that end generation, allowed where the grammar may
    end. `json_whitespace`: a regex for the whitespace JSON may hold between tokens."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_ids: list[int],
        *,
        json_whitespace: str = JSON_WHITESPACE,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.json_whitespace = json_whitespace
        self._lock = threading.Lock()
        self._lltok: Any = None

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:
                llg = _llguidance()
                try:
                    self._lltok = llg.LLTokenizer(
                        self._tokenizer_json,
                        n_vocab=self.vocab_size,
                        eos_token=self.eos_ids or None,
                    )
                except (ValueError, RuntimeError) as exc:
                    raise GrammarError(
                        f"constrained decoding is unavailable for this tokenizer: {exc}"
                    ) from None
            return self._lltok

    def json_schema(self, schema: dict[str, Any] | None) -> Grammar:
        """JSON valid against `schema`; None: any JSON object (response_format json_object).
        Properties come in the schema's order (not sorted): the output follows it."""
        text = json.dumps({"type": "object"} if schema is None else schema)
        return self._compile("json_schema", text)

    def regex(self, pattern: str) -> Grammar:
        return self._compile("regex", pattern)

    def choice(self, options: list[str]) -> Grammar:
        return self._compile("choice", json.dumps(options))

    def lark(self, grammar: str) -> Grammar:
        return self._compile("lark", grammar)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one compiler per server, bounded cache
    def _compile(self, kind: str, text: str) -> Grammar:
        llg = _llguidance()
        defaults = {"whitespace_pattern": self.json_whitespace}
        try:
            if kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=defaults)
            else:
                grammar = llg.grammar_from(kind, text)
        except ValueError as exc:
            raise GrammarError(f"invalid {kind.replace('_', ' ')}: {exc}") from None
        tokenizer = self._tokenizer()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed:
            raise GrammarError(f"invalid {kind.replace('_', ' ')}: {messages[0]}")
        prototype = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if prototype.is_error():
            raise GrammarError(f"invalid {kind.replace('_', ' ')}: {prototype.get_error()}")
        return Grammar(kind, prototype, self.vocab_size, self.eos_ids)
