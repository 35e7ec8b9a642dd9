"""Tokenizers: a thin wrapper over HF `tokenizers`, built from a `tokenizer.json` or GGUF metadata.

GGUF files carry two kinds: byte-level BPE (`tokenizer.ggml.model = "gpt2"`: SmolLM, Llama 3,
Qwen2) and SentencePiece (`"llama"`: Llama 2, Mistral, TinyLlama). llama.cpp tokenizes the
latter by merging adjacent pieces best-score-first, with `<0xXX>` byte tokens for characters
the vocabulary lacks and `▁` for spaces; that is a BPE whose merges are ranked by the score
of the merged piece, which is how it is rebuilt here.

The wrapper adds what generation needs and `tokenizers` lacks: BOS/EOS ids (with every id that
ends a turn: `generation_config.json`'s EOS list), the model's chat template (rendered as
transformers renders it: `llmopt.models.chat_template`), and a save format HF tools read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from llmopt.artifacts import atomic_write_text
from llmopt.config_files import ConfigFileError, read_text
from llmopt.errors import UsageError
from llmopt.models.chat_template import ChatTemplateError, render_chat
from llmopt.models.hf_schema import GENERATION_CONFIG, HF_CONFIG, TOKENIZER_CONFIG, read_hf_json

# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6
_SPACE = "\u2581"  # SentencePiece's space marker

# llama.cpp's Llama 3 pre-tokenizers: whole-word vocabulary hits skip the merges, and BOS is
# added unless the file says otherwise (llama-vocab.cpp)
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe")

# How text is split before byte-level BPE, by `tokenizer.ggml.pre` (llama.cpp's names). Each
# reproduces the pre-tokenizer of the model's original `tokenizer.json`.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in ("smollm", "starcoder", "refact"):  # digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = {
        "llama-bpe": _LLAMA3_SPLIT,
        "llama3": _LLAMA3_SPLIT,
        "smaug-bpe": _LLAMA3_SPLIT,
        "qwen2": _QWEN2_SPLIT,
        "deepseek-r1-qwen": _QWEN2_SPLIT,
        "gpt2": _GPT2_SPLIT,
        "gpt-2": _GPT2_SPLIT,
        "default": _GPT2_SPLIT,
    }.get(pre)
    if split is None:
        raise UsageError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: smollm, starcoder, refact, "
            "llama-bpe, llama3, smaug-bpe, qwen2, deepseek-r1-qwen, gpt-2, gpt2, default"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


__all__ = ["ChatTemplateError", "Tokenizer"]


class Tokenizer:
    """Text <-> token ids, plus the special ids and chat template of one model."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None = None,
        add_bos: bool = False,
        eos_token_ids: tuple[int, ...] | list[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos  # whether the model was trained with BOS in front of text
        ids = [eos_token_id] if eos_token_id is not None else []
        for token_id in eos_token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise ValueError(
                    f"eos_token_ids holds {token_id!r}; expected token ids (ints >= 0)"
                )
            if token_id not in ids:
                ids.append(token_id)
        # every id that ends generation (Llama 3: <|end_of_text|>, <|eom_id|>, <|eot_id|>)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_start|>`) stay whole."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise UsageError("add_bos=True but this tokenizer has no BOS token")
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}]), exactly as
        transformers' `apply_chat_template(..., tokenize=False)` renders it; `kwargs` are
        template variables (e.g. `enable_thinking=False`)."""
        if not self.chat_template:
            raise UsageError("this tokenizer has no chat template; drop --chat for plain text")
        for message in messages:
            if not isinstance(message, dict) or "role" not in message:
                raise UsageError(f"chat message {message!r} needs a 'role' key")
        specials = {"bos_token": self._token_text(self.bos_token_id)}
        specials["eos_token"] = self._token_text(self.eos_token_id)
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            special_tokens={k: v for k, v in specials.items() if v},
            **kwargs,
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id) or ""

    # ---- persistence (HF layout: tokenizer.json + tokenizer_config.json) ----
    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token_text(self.bos_token_id) or None,
            "eos_token": self._token_text(self.eos_token_id) or None,
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        atomic_write_text(directory / "tokenizer.json", self.backend.to_str())
        atomic_write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2))

    @classmethod
    def from_directory(cls, directory: str | Path) -> Tokenizer:
        """A HF tokenizer directory: `tokenizer.json` (+ `tokenizer_config.json` if present)."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise UsageError(f"{path} is not a valid tokenizer.json: {exc}") from exc
        config: dict[str, Any] = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            config = read_hf_json(config_path, "tokenizer config", TOKENIZER_CONFIG)
        model_config: dict[str, Any] = {}
        if (directory / "config.json").is_file():
            model_config = read_hf_json(directory / "config.json", "HF config", HF_CONFIG)

        def special(name: str) -> int | None:
            token = config.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            if token:
                found = backend.token_to_id(token)
                if found is None:  # a typo would silently mean "never stop"
                    raise ConfigFileError(
                        f"{config_path}: {name} = {token!r} is not a token of {path}"
                    )
                return found
            value = model_config.get(f"{name}_id")
            return value[0] if isinstance(value, list) else value

        template = config.get("chat_template")
        if template is None and (directory / "chat_template.jinja").is_file():
            template = read_text(directory / "chat_template.jinja", "chat template")
        return cls(
            backend,
            bos_token_id=special("bos_token"),
            eos_token_id=special("eos_token"),
            chat_template=template if isinstance(template, str) else None,
            add_bos=bool(config.get("add_bos_token", False)),
            eos_token_ids=_eos_list(directory, model_config),
        )

    @classmethod
    def from_gguf_metadata(cls, fields: dict[str, Any]) -> Tokenizer:
        """Rebuild a byte-level BPE or SentencePiece tokenizer from `tokenizer.ggml.*` values."""
        kind = fields.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise UsageError(
                f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level "
                "BPE: SmolLM, Llama 3, Qwen2), 'llama' (SentencePiece: Llama 2, Mistral)"
            )
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types = fields.get("tokenizer.ggml.token_type") or []
        if types and len(types) != len(tokens):
            raise UsageError(f"GGUF has {len(types)} token types for {len(tokens)} tokens")
        if kind == "llama":
            backend = _sentencepiece_backend(fields, tokens, types)
        else:
            merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
            vocab = {token: i for i, token in enumerate(tokens)}
            pre = fields.get("tokenizer.ggml.pre") or "default"
            backend = Backend(
                models.BPE(
                    vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE
                )
            )
            backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
            backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types)
                if t == _CONTROL
            ]
        )
        backend.add_tokens(
            [
                AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types)
                if t == _USER_DEFINED
            ]
        )
        ends = ("eot", "eom")  # llama.cpp's end-of-turn / end-of-message ids also stop it
        return cls(
            backend,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
            eos_token_ids=[
                fields[f"tokenizer.ggml.{e}_token_id"]
                for e in ends
                if fields.get(f"tokenizer.ggml.{e}_token_id") is not None
            ],
            chat_template=fields.get("tokenizer.chat_template"),
            # llama.cpp adds BOS to SentencePiece and Llama 3 vocabularies unless the file
            # says otherwise
            add_bos=bool(
                fields.get(
                    "tokenizer.ggml.add_bos_token",
                    kind == "llama" or fields.get("tokenizer.ggml.pre") in _LLAMA3_PRE,
                )
            ),
        )


def _eos_list(directory: Path, model_config: dict[str, Any]) -> list[int]:
    """The EOS ids of `generation_config.json` (what transformers' generate stops on), else of
    config.json; either may hold one id or a list."""
    found: Any = None
    path = directory / "generation_config.json"
    if path.is_file():
        found = read_hf_json(path, "generation config", GENERATION_CONFIG).get("eos_token_id")
    if found is None:
        found = model_config.get("eos_token_id")
    ids = found if isinstance(found, list) else [] if found is None else [found]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{directory}: eos_token_id {found!r} is not a token id or a list of them")
    return ids


def _sentencepiece_backend(fields: dict[str, Any], tokens: list[str], types: list[int]) -> Backend:
    """A byte-fallback BPE equal to llama.cpp's SentencePiece tokenizer (see the module doc)."""
    scores = fields.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        count = "none" if scores is None else len(scores)
        raise UsageError(
            f"a SentencePiece GGUF needs one tokenizer.ggml.scores entry per token; got {count} "
            f"for {len(tokens)} tokens"
        )
    bad = [s for s in scores if not math.isfinite(s)]
    if bad:
        raise UsageError(f"tokenizer.ggml.scores holds non-finite values, e.g. {bad[0]}")
    vocab = {token: i for i, token in enumerate(tokens)}
    mergeable = {t for i, t in enumerate(tokens) if not types or types[i] in (_NORMAL, _UNKNOWN)}
    unk_id = fields.get("tokenizer.ggml.unknown_token_id", 0 if tokens else None)
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=_score_ranked_merges(tokens, scores, mergeable),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _score_ranked_merges(
    tokens: list[str], scores: list[float], mergeable: set[str]
) -> list[tuple[str, str]]:
    """Every (left, right) split of a piece into two pieces, best merged score first (ties:
    longer left part, then vocabulary order), as SentencePiece's BPE applies them."""
    rank = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if piece not in mergeable:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[i], -len(left), -len(right), i, rank[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
