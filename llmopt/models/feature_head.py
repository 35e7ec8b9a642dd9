"""A feature-level draft head (EAGLE, Li et al. 2024): one decoder layer that predicts the
target's next hidden feature from its current one and the next token.

Why features: the target's last hidden state already holds what its head turns into the next
token, so a single layer over [feature ; next-token embedding] predicts the following feature
(and token) far better than a small model reading tokens alone (a distilled 135M->3-layer draft
was accepted at α = 0.23, docs/benchmarks/distill.md).

Shape of the head, for a target with hidden size h:
    x_p = fc([embed(token_p) ; f_{p-1}])               fc: 2h -> h
    g_p = norm(block(x_p))                              one block of the target's architecture
    logits over the draft vocabulary = head(g_p)       K frequent ids, mapped to the target's
The feature f is the target's final-norm hidden state (what its own head reads); at depth > 1
the draft reads its own g in place of f. The block, norm and head are a one-layer `Transformer`
built from the target's config (its spec), so the fused CPU kernels run the draft too, with
`inputs=` in place of the embedding lookup. The token embedding is the target's (frozen, kept
as fp32 rows here so the draft needs nothing of the target at run time).

Saved as a directory: `feature_head.json` (format version, target, config, draft vocabulary)
and `feature_head.safetensors`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from llmopt.artifacts import atomic_write, atomic_write_text
from llmopt.errors import LlmoptError
from llmopt.models import ModelConfig, build_model

CONFIG_FILE = "feature_head.json"
WEIGHTS_FILE = "feature_head.safetensors"
FORMAT = "llmopt-feature-head"
VERSION = 1


class FeatureHeadError(LlmoptError, ValueError):
    """A feature head that cannot be built, loaded or used with this target."""


@dataclass(frozen=True)
class FeatureHeadConfig:
    """What a head is: the target it reads (name, hidden size, vocabulary) and its layer."""

    target: str
    target_vocab: int
    layer: dict  # the one-layer ModelConfig's fields (vocab_size = draft vocabulary size)

    def model_config(self) -> ModelConfig:
        fields = dict(self.layer)
        if isinstance(fields.get("eos_token_ids"), list):
            fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
        return ModelConfig(**fields)


def layer_config(target: ModelConfig, draft_vocab: int) -> dict:
    """The draft layer's config: the target's block, one layer, a `draft_vocab` head tied to
    its (unused) embedding so the head's weights exist once."""
    fields = {k: v for k, v in asdict(target).items() if k not in ("extra", "moe", "mla")}
    fields.update(
        name=f"{target.name}-feature-head",
        vocab_size=draft_vocab,
        num_layers=1,
        tie_embeddings=True,
        final_softcap=None,
        sliding_window=None,
        full_attention_every=None,
    )
    return fields


class FeatureHead(nn.Module):
    """fc over [embedding ; feature], one block + norm + a head over `ids` (draft vocabulary)."""

    def __init__(self, config: FeatureHeadConfig, ids: torch.Tensor, embed: torch.Tensor):
        super().__init__()
        mcfg = config.model_config()
        h = mcfg.hidden_size
        if embed.shape != (config.target_vocab, h):
            raise FeatureHeadError(
                f"target embedding {tuple(embed.shape)} does not fit a head of hidden size {h} "
                f"over a {config.target_vocab}-token vocabulary"
            )
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.numel() != mcfg.vocab_size or ids.unique().numel() != ids.numel():
            raise FeatureHeadError(
                f"draft vocabulary must be {mcfg.vocab_size} distinct ids, got {ids.numel()}"
            )
        if int(ids.min()) < 0 or int(ids.max()) >= config.target_vocab:
            raise FeatureHeadError(f"draft vocabulary ids must lie in [0, {config.target_vocab})")
        self.config = config
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = build_model(mcfg, seed=0)
        self.layer.embed_tokens.weight.requires_grad_(True)  # tied: it is the draft head
        self.register_buffer("embed", embed.detach().float().contiguous(), persistent=False)
        self.register_buffer("ids", ids, persistent=True)
        # target id -> draft index (-1: not in the draft vocabulary)
        index = torch.full((config.target_vocab,), -1, dtype=torch.long)
        index[ids] = torch.arange(ids.numel())
        self.register_buffer("index", index, persistent=False)
        with torch.no_grad():  # start as "the embedding passes through, the feature adds in"
            self.fc.weight.zero_()
            self.fc.weight[:, :h].copy_(torch.eye(h))
            self.fc.weight[:, h:].copy_(torch.eye(h))
            self.fc.bias.zero_()

    @torch.no_grad()
    def set_draft_head(self, rows: torch.Tensor) -> None:
        """The draft head's rows (one per draft-vocabulary id), e.g. the target's own."""
        weight = self.layer.lm_head.weight  # tied to the layer's (unused) embedding
        if rows.shape != weight.shape:
            raise FeatureHeadError(
                f"draft head rows {tuple(rows.shape)}, want {tuple(weight.shape)}"
            )
        weight.copy_(rows)

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc([embed(tokens) ; features]): [..., h] inputs of the draft layer."""
        return self.fc(torch.cat([self.embed[tokens], features], dim=-1))

    def forward(self, tokens: torch.Tensor, features: torch.Tensor):
        """(draft features g [B, T, h], draft-vocabulary logits [B, T, K]) for token p and
        feature p-1 at each position (teacher forcing: the target's features)."""
        layer = self.layer
        x = self.inputs(tokens, features)
        cos, sin = layer.rotary(0, x.shape[1], x.dtype)
        for block in layer.held_blocks():
            x = block(x, cos, sin, None)
        g = layer.norm(x)
        return g, layer.lm_head(g)

    # ---- saving and loading ----
    def save(self, directory: str | Path, **info) -> Path:
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        tensors.pop("layer.lm_head.weight", None)  # tied to the layer's embedding
        atomic_write(out / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp)))
        meta = {"format": FORMAT, "version": VERSION, **asdict(self.config), **info}
        atomic_write_text(out / CONFIG_FILE, json.dumps(meta, indent=1))
        return out


def is_feature_head(directory: str | Path) -> bool:
    return (Path(directory) / CONFIG_FILE).is_file()


def load_feature_head(directory: str | Path, target: nn.Module) -> FeatureHead:
    """The head saved in `directory`, checked against `target` (name, hidden size, vocab)."""
    from safetensors.torch import load_file

    path = Path(directory)
    meta_path = path / CONFIG_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise FeatureHeadError(f"{meta_path}: not a feature head ({exc})") from exc
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise FeatureHeadError(
            f"{meta_path}: format {meta.get('format')!r} version {meta.get('version')!r}; this "
            f"llmopt reads {FORMAT!r} version {VERSION}"
        )
    config = FeatureHeadConfig(meta["target"], meta["target_vocab"], meta["layer"])
    tcfg = target.config
    if config.target_vocab != tcfg.vocab_size or config.layer["hidden_size"] != tcfg.hidden_size:
        raise FeatureHeadError(
            f"{path} was trained for {config.target} (vocab {config.target_vocab}, hidden "
            f"{config.layer['hidden_size']}); this target is {tcfg.name} (vocab "
            f"{tcfg.vocab_size}, hidden {tcfg.hidden_size})"
        )
    tensors = load_file(str(path / WEIGHTS_FILE))
    head = FeatureHead(config, tensors["ids"], target_embedding(target))
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if k != "layer.lm_head.weight"]
    if missing or unexpected:
        raise FeatureHeadError(f"{path}: weights do not match (missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]})")  # fmt: skip
    return head.eval()


def target_embedding(target: nn.Module) -> torch.Tensor:
    """The target's token embedding as fp32 rows [vocab, hidden] (packed GGUF rows decoded)."""
    from llmopt.models.spec import spec_for

    embed = spec_for(target).top_module(target, "embedding")
    weight = getattr(embed, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.detach().float()
    if hasattr(embed, "dequantize"):
        return embed.dequantize().float()
    rows = torch.arange(target.config.vocab_size)
    with torch.no_grad():
        return embed(rows).float()
