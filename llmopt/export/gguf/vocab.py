"""A tokenizer as GGUF `tokenizer.ggml.*` metadata, written the way llama.cpp's converter does.

Two kinds, told apart by the HF `tokenizer.json` model:
- byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM): `tokenizer.ggml.model = "gpt2"` with the
  token list, merges and the pre-tokenizer name that selects llama.cpp's split regexes. The
  name is found as the converter finds it: encode llama.cpp's check text, hash the ids and look
  the hash up in its table (`pretokenizers.py`); an unknown hash is refused, since writing a
  wrong name makes llama.cpp split text differently without any error.
- SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Phi-3, Gemma):
  `"llama"` with per-token scores; llama.cpp merges the best-scoring adjacent pair first, so a
  piece's score is minus the rank of the first merge that makes it, which replays the merge
  order of the BPE it came from.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from llmopt.export.gguf.pretokenizers import CHECK_TEXT, PRE_BY_HASH
from llmopt.export.output import ExportError

# llama.cpp's token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def looks_special(token: str) -> bool:
    """Added tokens the converter marks CONTROL although the tokenizer does not say special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def check_hash(tokenizer: Any) -> str:
    """SHA-256 of the ids of llama.cpp's check text, special tokens added as HF's `encode` does
    (a tokenizer rebuilt from GGUF has no post-processor: its add-BOS flag stands in)."""
    ids = tokenizer.backend.encode(CHECK_TEXT, add_special_tokens=True).ids
    bos = tokenizer.bos_token_id
    if tokenizer.backend.post_processor is None and tokenizer.add_bos and bos is not None:
        ids = [bos, *ids]
    return hashlib.sha256(str(ids).encode()).hexdigest()


def detect_pre(tokenizer: Any) -> str:
    """llama.cpp's pre-tokenizer name for a byte-level BPE tokenizer (see the module doc)."""
    digest = check_hash(tokenizer)
    if digest not in PRE_BY_HASH:
        raise ExportError(
            f"llama.cpp knows no pre-tokenizer that tokenizes like this one (check-text hash "
            f"{digest}); pass tokenizer_pre=NAME with the llama.cpp name of its split rules "
            "(e.g. llama-bpe, qwen2, smollm, gpt-2)"
        )
    return PRE_BY_HASH[digest]


def _added_types(data: dict, size: int, types: list[int]) -> None:
    """CONTROL / USER_DEFINED for added tokens (an unknown or byte piece keeps its type)."""
    for added in data.get("added_tokens", []):
        if added["id"] < size and types[added["id"]] == NORMAL:
            special = added.get("special") or looks_special(added["content"])
            types[added["id"]] = CONTROL if special else USER_DEFINED


def _write_specials(writer: Any, tokenizer: Any) -> None:
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    if tokenizer.eos_token_id is not None:
        writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(bool(tokenizer.add_bos))
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _padded(tokens: list[str], types: list[int], vocab: int) -> None:
    """Embedding rows beyond the tokenizer (padded vocabularies): placeholders, as llama.cpp's
    converter writes them, so token count == vocab size."""
    size = len(tokens)
    tokens += [f"[PAD{i}]" for i in range(size, vocab)]
    types += [UNUSED] * (vocab - size)


def _byte_level(writer: Any, tokenizer: Any, data: dict, pre: str | None, vocab: int) -> None:
    size = tokenizer.vocab_size
    tokens = [tokenizer.id_to_token(i) for i in range(size)]
    types = [NORMAL] * size
    _added_types(data, size, types)
    _padded(tokens, types, vocab)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or detect_pre(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)


def _space_prefix(data: dict) -> bool:
    """Whether text gets a leading '▁' (a Prepend normalizer or a prepending Metaspace)."""
    text = json.dumps([data.get("normalizer"), data.get("pre_tokenizer")])
    if '"Prepend"' in text:
        return True
    scheme = re.search(r'"prepend_scheme": "(\w+)"', text)
    return bool(scheme and scheme.group(1) != "never") or '"add_prefix_space": true' in text


def _sentencepiece(writer: Any, tokenizer: Any, data: dict, vocab: int) -> None:
    model = data["model"]
    size = tokenizer.vocab_size
    tokens = [tokenizer.id_to_token(i) for i in range(size)]
    merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model.get("merges", [])]
    first_merge: dict[str, int] = {}
    for rank, (left, right) in enumerate(merges):
        first_merge.setdefault(left + right, rank)
    unk = model.get("unk_token")
    scores, types = [], []
    for token in tokens:
        if token == unk:
            kind, score = UNKNOWN, 0.0
        elif _BYTE_TOKEN.fullmatch(token):
            kind, score = BYTE, 0.0
        else:  # pieces no merge makes (single characters) rank after every merged one
            kind, score = NORMAL, -float(first_merge.get(token, len(merges)))
        types.append(kind)
        scores.append(score)
    _added_types(data, size, types)
    scores = [-1000.0 if t in (CONTROL, USER_DEFINED) else s for s, t in zip(scores, types)]
    _padded(tokens, types, vocab)
    scores += [-10000.0] * (vocab - size)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(_space_prefix(data))
    unk_id = tokenizer.token_to_id(unk) if unk else None
    if unk_id is not None:
        writer.add_unk_token_id(unk_id)


def add_tokenizer(writer: Any, tokenizer: Any, pre: str | None, vocab: int) -> None:
    """Write `tokenizer` into a GGUFWriter for a model whose embedding has `vocab` rows."""
    data = json.loads(tokenizer.backend.to_str())
    model = data.get("model", {})
    if tokenizer.vocab_size > vocab:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is {vocab}"
        )
    if model.get("type") != "BPE":
        raise ExportError(
            f"GGUF export writes BPE tokenizers (byte-level or SentencePiece-style); this one is "
            f"{model.get('type')}"
        )
    if model.get("byte_fallback"):
        if pre is not None:
            raise ExportError("tokenizer_pre applies to byte-level BPE tokenizers only")
        _sentencepiece(writer, tokenizer, data, vocab)
    else:
        _byte_level(writer, tokenizer, data, pre, vocab)
    _write_specials(writer, tokenizer)
