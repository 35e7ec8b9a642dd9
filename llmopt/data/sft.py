"""Supervised fine-tuning data: records -> token ids + a loss mask -> fixed-length rows.

Formats (`fmt`, or "auto" from each record's keys):
- ``text``: {"text": ...}; every token is supervised (continued pre-training).
- ``prompt_completion``: {"prompt": ..., "completion": ...}; only the completion (and the EOS
  that ends it) carries loss.
- ``messages``: {"messages": [{"role", "content"}, ...]} rendered with the model's own chat
  template; only assistant turns carry loss (their content and the template's end-of-turn
  text). The conversation is cut at each assistant turn's boundaries by rendering the prefixes
  (`messages[:i]` with the generation prompt, `messages[:i+1]` without): a template whose
  renderings are not prefixes of each other is refused rather than mis-masked.

Rows: without packing, each example is one row (a long ``text`` record several, cut every
seq_len tokens), truncated to seq_len+1 tokens and padded with
EOS whose labels are IGNORE_INDEX (right padding: causal attention never looks at it, so no
attention mask is needed). With packing, examples are concatenated (EOS-separated) and cut into
rows; the label that would predict a new document from the previous one is ignored, but
attention is *not* masked at document boundaries (a later document sees earlier ones).

Labels of unsupervised tokens are IGNORE_INDEX, so the engine's loss is the mean over
supervised tokens of the global batch. A held-out split (a seeded `eval_fraction` of the
examples) gives the eval loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from llmopt.data.sft_sources import SFTDataError, read_located_records
from llmopt.data.tokens import TokenData
from llmopt.errors import LlmoptError
from llmopt.parallel.pipeline.executor import IGNORE_INDEX

FORMATS = ("auto", "text", "prompt_completion", "messages")
_KEYS = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}


def detect_format(record: dict[str, Any]) -> str:
    for fmt, keys in _KEYS.items():
        if all(k in record for k in keys):
            return fmt
    raise SFTDataError(
        f"record with keys {sorted(record)} fits no format: need 'messages', "
        "'prompt' + 'completion', or 'text'"
    )


def encode_record(record: dict[str, Any], fmt: str, tokenizer) -> tuple[list[int], list[bool]]:
    """(token ids, supervised flag per token) of one record."""
    if fmt == "auto":
        fmt = detect_format(record)
    if fmt not in _KEYS:
        raise SFTDataError(f"format={fmt!r} is not valid; choose one of {FORMATS}")
    missing = [k for k in _KEYS[fmt] if k not in record]
    if missing:
        raise SFTDataError(f"format {fmt!r} needs keys {list(_KEYS[fmt])}; record lacks {missing}")
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    if fmt == "text":
        ids = tokenizer.encode(_string(record, "text")) + eos
        return ids, [True] * len(ids)
    if fmt == "prompt_completion":
        prompt = tokenizer.encode(_string(record, "prompt"))
        completion = tokenizer.encode(_string(record, "completion")) + eos
        return prompt + completion, [False] * len(prompt) + [True] * len(completion)
    return _encode_chat(record["messages"], tokenizer)


def _string(record: dict[str, Any], key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise SFTDataError(f"record[{key!r}] must be a string, got {type(value).__name__}")
    return value


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Any) -> None:
    """A non-empty list of {role, content} objects, role one of CHAT_ROLES, content a string;
    the error names the message and the field."""
    if not isinstance(messages, list) or not messages:
        raise SFTDataError(
            f"'messages' = {messages!r:.60} must be a non-empty list of {{role, content}} objects"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise SFTDataError(f"messages[{i}] is a {type(message).__name__}, not an object")
        for key in ("role", "content"):
            if key not in message:
                raise SFTDataError(f"messages[{i}] has no {key!r} (keys: {sorted(message)})")
        if message["role"] not in CHAT_ROLES:
            raise SFTDataError(
                f"messages[{i}].role = {message['role']!r}; valid: {', '.join(CHAT_ROLES)}"
            )
        if not isinstance(message["content"], str):
            raise SFTDataError(
                f"messages[{i}].content must be a string, got {type(message['content']).__name__}"
            )


def _encode_chat(messages: Any, tokenizer) -> tuple[list[int], list[bool]]:
    check_messages(messages)
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    # Character spans [start, end) of each assistant turn in the full rendering.
    spans = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], add_generation_prompt=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise SFTDataError(
                "the chat template does not render conversations as prefixes of each other; "
                "cannot locate assistant turns to mask (use format prompt_completion)"
            )
        spans.append((len(before), len(through)))
    if not spans:
        raise SFTDataError("a 'messages' record has no assistant turn: nothing to learn")
    ids: list[int] = []
    mask: list[bool] = []
    cursor = 0
    for start, end in spans:
        for text, supervised in ((full[cursor:start], False), (full[start:end], True)):
            piece = tokenizer.encode(text) if text else []
            ids += piece
            mask += [supervised] * len(piece)
        cursor = end
    tail = tokenizer.encode(full[cursor:]) if cursor < len(full) else []
    return ids + tail, mask + [False] * len(tail)


@dataclass
class SFTStats:
    examples: int = 0
    train_examples: int = 0
    eval_examples: int = 0
    truncated: int = 0
    dropped: int = 0  # no supervised token left after truncation
    supervised_tokens: int = 0
    formats: dict[str, int] = field(default_factory=dict)


def _rows(
    examples: list[tuple[list[int], list[bool]]], seq_len: int, pad: int, packing: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) [n, seq_len] from encoded examples."""
    width = seq_len + 1
    if packing:
        ids: list[int] = []
        keep: list[bool] = []
        for tokens, mask in examples:
            ids += tokens
            keep += [False] + mask[1:]  # never predict a document's first token from the last
        n = -(-len(ids) // width)  # the last row is padded (ignored labels)
        ids += [pad] * (n * width - len(ids))
        keep += [False] * (n * width - len(keep))
        seqs = [ids[i * width : (i + 1) * width] for i in range(n)]
        masks = [keep[i * width : (i + 1) * width] for i in range(n)]
    else:
        seqs = [t + [pad] * (width - len(t)) for t, _ in examples]
        masks = [m + [False] * (width - len(m)) for _, m in examples]
    if not seqs:
        empty = torch.zeros(0, seq_len, dtype=torch.long)
        return empty, empty.clone()
    tokens = torch.tensor(seqs, dtype=torch.long)
    supervised = torch.tensor(masks, dtype=torch.bool)
    labels = tokens[:, 1:].masked_fill(~supervised[:, 1:], IGNORE_INDEX)
    return tokens[:, :-1].contiguous(), labels.contiguous()


class SFTData(TokenData):
    """Rows of (inputs, labels) in TokenData's seeded, stateless order, plus a held-out split."""

    def __init__(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        seed: int,
        eval_inputs: torch.Tensor,
        eval_labels: torch.Tensor,
        stats: SFTStats,
    ) -> None:
        if inputs.shape[0] < 1:
            raise SFTDataError("no training example left (all held out, empty or dropped)")
        self.inputs, self.targets = inputs, labels
        self.num_sequences = inputs.shape[0]
        self.seed = seed
        self._orders: dict[int, torch.Tensor] = {}
        self.eval_inputs, self.eval_labels = eval_inputs, eval_labels
        self.stats = stats

    @classmethod
    def build(
        cls,
        source: str,
        tokenizer,
        seq_len: int,
        seed: int,
        *,
        fmt: str = "auto",
        packing: bool = False,
        eval_fraction: float = 0.1,
    ) -> SFTData:
        if fmt not in FORMATS:
            raise SFTDataError(f"format={fmt!r} is not valid; choose one of {FORMATS}")
        records = read_located_records(source)
        stats = SFTStats(examples=len(records))
        encoded = []
        for where, record in records:
            try:  # every error names the record's file and line (or list index)
                kind = fmt if fmt != "auto" else detect_format(record)
                ids, mask = encode_record(record, kind, tokenizer)
            except LlmoptError as exc:
                raise SFTDataError(f"{where}: {exc}") from None
            stats.formats[kind] = stats.formats.get(kind, 0) + 1
            if kind == "text" and not packing:
                # plain text is cut into rows (sharing one token), not truncated
                pieces = [ids[i : i + seq_len + 1] for i in range(0, max(len(ids) - 1, 1), seq_len)]
                encoded += [(p, [True] * len(p)) for p in pieces if len(p) > 1]
                continue
            if not packing and len(ids) > seq_len + 1:
                stats.truncated += 1
                ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
            if not any(mask[1:]):
                stats.dropped += 1
                continue
            encoded.append((ids, mask))
        gen = torch.Generator().manual_seed(seed + 7)
        order = torch.randperm(len(encoded), generator=gen).tolist()
        n_eval = round(eval_fraction * len(encoded)) if len(encoded) > 1 else 0
        held = set(order[:n_eval])
        train = [e for i, e in enumerate(encoded) if i not in held]
        evals = [e for i, e in enumerate(encoded) if i in held]
        stats.train_examples, stats.eval_examples = len(train), len(evals)
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        inputs, labels = _rows(train, seq_len, pad, packing)
        eval_inputs, eval_labels = _rows(evals, seq_len, pad, packing)
        stats.supervised_tokens = int((labels != IGNORE_INDEX).sum())
        return cls(inputs, labels, seed, eval_inputs, eval_labels, stats)

    def supervised(self, step: int, global_batch: int) -> int:
        """Supervised tokens of the whole global batch of `step` (every rank computes it)."""
        rows = self.global_rows(step, global_batch)
        return int((self.targets[rows] != IGNORE_INDEX).sum())

    def eval_shard(self, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's share of the held-out rows (rows r, r+dp, ...)."""
        return self.eval_inputs[dp_rank::dp], self.eval_labels[dp_rank::dp]
