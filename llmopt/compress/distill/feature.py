"""Training a feature draft head (`llmopt.models.feature_head`) on the target's own
features: `llmopt distill --feature-head`.

Data (`target_windows`): token windows of a broad text mix plus the target's own greedy
continuations of prompts from that mix (what the head will see at run time), run through the
target — eagerly by default, or by the caller's forward (benchmarks/feature_head.py passes the
fused kernels that serve the packaged Q4_1 GGUF; compress sits below infer, so this module
never imports it) — keeping per position the final-norm feature (fp16) and the target's top-`k` next-token law. The head is trained
with teacher forcing, EAGLE's recipe: input (token p, feature p-1 + noise), loss = smooth-L1
between its feature and the target's feature p + w · cross-entropy of its draft-vocabulary
logits against the target's top-k law (restricted to the draft vocabulary, renormalised).

Runs are resumable: the head and the optimizer state are saved as safetensors every
`save_every` steps (`<out>/head` is a loadable head directory, the
optimizer moments and step counter sit beside it), and `resume=True` continues from there.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from llmopt.artifacts import atomic_write, atomic_write_text
from llmopt.errors import LlmoptError
from llmopt.models.feature_head import (
    FeatureHead,
    FeatureHeadConfig,
    layer_config,
    load_feature_head,
    target_embedding,
)


class FeatureTrainError(LlmoptError, ValueError):
    """A feature-head training setting that cannot work; the message names the value."""


@dataclass(frozen=True)
class FeatureTrainConfig:
    draft_vocab: int = 8192
    seq_len: int = 256
    steps: int = 600
    batch: int = 8  # windows per step
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 30
    feature_weight: float = 1.0  # smooth-L1 on the feature
    token_weight: float = 0.1  # cross-entropy on the draft vocabulary (EAGLE's 0.1)
    noise: float = 0.2  # uniform feature noise, in units of the features' std (EAGLE)
    top_k: int = 16  # target law kept per position
    save_every: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("draft_vocab", "seq_len", "steps", "batch", "warmup", "top_k", "save_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FeatureTrainError(f"{name}={value!r} must be an integer >= 1")
        for name in ("lr", "min_lr", "feature_weight", "token_weight", "noise"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise FeatureTrainError(f"{name}={value!r} must be a finite number >= 0")
        if self.lr <= 0 or self.min_lr > self.lr:
            raise FeatureTrainError(f"need 0 < min_lr={self.min_lr} <= lr={self.lr}")


@dataclass
class FeatureData:
    """Per window: tokens [N, T], the target's features [N, T, h] (fp16), its top-k next-token
    ids [N, T, k] and probabilities [N, T, k] (fp16)."""

    tokens: torch.Tensor
    features: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {k: v.contiguous() for k, v in asdict(self).items()}
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))

    @classmethod
    def load(cls, path: str | Path) -> FeatureData:
        from safetensors.torch import load_file

        return cls(**load_file(str(path)))


Forward = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def eager_forward(target: torch.nn.Module) -> Forward:
    """window [T] -> (logits [T, vocab], final-norm features [T, h]) by the eager model. A
    caller serving the target through other kernels passes its own (the benchmark passes the
    fused step: the features of the target as it is served)."""
    from llmopt.models.spec import spec_for

    head = spec_for(target).top_module(target, "head")

    def run(window: torch.Tensor):
        hidden = target.hidden_states(window[None])[0]
        return head(hidden), hidden

    return run


@torch.inference_mode()
def target_windows(
    target: torch.nn.Module,
    windows: torch.Tensor,
    top_k: int,
    progress=None,
    forward: Forward | None = None,
) -> FeatureData:
    """Run each window [N, T] through the target (`forward`, default eager): features and
    top-k laws per position."""
    forward = forward or eager_forward(target)
    n, t = windows.shape
    h = target.config.hidden_size
    feats = torch.empty(n, t, h, dtype=torch.float16)
    ids = torch.empty(n, t, top_k, dtype=torch.int32)
    probs = torch.empty(n, t, top_k, dtype=torch.float16)
    for i in range(n):
        logits, hidden = forward(windows[i])
        top = torch.topk(logits.float().softmax(-1), top_k, dim=-1)
        feats[i], ids[i], probs[i] = hidden.half(), top.indices.int(), top.values.half()
        if progress:
            progress(i + 1, n)
    return FeatureData(windows, feats, ids, probs)


Decode = Callable[[list[int], int], list[int]]


def eager_greedy(target: torch.nn.Module) -> Decode:
    """(prompt, n) -> prompt + n greedy tokens by the eager model over a static KV cache."""
    from llmopt.models.attention.static import KVCache

    @torch.inference_mode()
    def run(prompt: list[int], n: int) -> list[int]:
        cache = KVCache.for_model(target, 1, len(prompt) + n)
        logits = target(torch.tensor([prompt]), cache, last_only=True)[0, -1]
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(logits.argmax()))
            logits = target(torch.tensor([[seq[-1]]]), cache)[0, -1]
        return seq

    return run


def own_generations(
    target, prompts: list[list[int]], new_tokens: int, decode: Decode | None = None
) -> list[list[int]]:
    """The target's greedy continuations of `prompts` (prompt + continuation each)."""
    decode = decode or eager_greedy(target)
    return [decode(list(p), new_tokens) for p in prompts]


def make_head(target: torch.nn.Module, ids: torch.Tensor) -> FeatureHead:
    cfg = FeatureHeadConfig(
        target=target.config.name,
        target_vocab=target.config.vocab_size,
        layer=layer_config(target.config, int(ids.numel())),
    )
    head = FeatureHead(cfg, ids, target_embedding(target))
    head.set_draft_head(target_head_rows(target, ids))  # starts as the target's head rows
    return head


def target_head_rows(target: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from llmopt.models.spec import spec_for

    head = spec_for(target).top_module(target, "head")
    weight = head.weight if getattr(head, "weight", None) is not None else None
    if weight is None or not weight.is_floating_point():
        weight = head.dequantize()
    return weight.detach().float()[ids]


def _lr(cfg: FeatureTrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(frac, 1.0)))


def feature_losses(head: FeatureHead, batch: FeatureData, cfg: FeatureTrainConfig, noise: float):
    """(feature smooth-L1, token CE, draft top-1 agreement) on a batch of windows."""
    tokens = batch.tokens.long()
    feats = batch.features.float()
    inputs_f = feats[:, :-1]  # feature p-1 beside token p
    if noise > 0:
        inputs_f = inputs_f + (torch.rand_like(inputs_f) - 0.5) * noise
    g, logits = head(tokens[:, 1:], inputs_f)
    target_f = feats[:, 1:]
    loss_f = F.smooth_l1_loss(g, target_f)
    idx = head.index[batch.top_ids[:, 1:].long()]  # draft index of each top-k id, -1 if absent
    p = batch.top_probs[:, 1:].float() * (idx >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-8)
    logq = torch.log_softmax(logits, -1).gather(-1, idx.clamp_min(0))
    loss_t = -(p * logq).sum(-1).mean()
    agree = (logits.argmax(-1) == idx[..., 0]).float().mean()
    return loss_f, loss_t, float(agree)


def train_feature_head(
    target: torch.nn.Module,
    data: FeatureData,
    out: str | Path,
    cfg: FeatureTrainConfig,
    ids: torch.Tensor,
    resume: bool = False,
    eval_data: FeatureData | None = None,
    log=print,
) -> FeatureHead:
    """Train (or resume) a head on `data`; saves `<out>/head` and returns the trained head."""
    from safetensors.torch import load_file, save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state_file, log_file = out / "optimizer.safetensors", out / "train_log.jsonl"
    start = 0
    if resume and (out / "head").is_dir() and state_file.is_file():
        head = load_feature_head(out / "head", target)
        head.train()
        start = int(json.loads((out / "head" / "feature_head.json").read_text())["step"])
    else:
        head = make_head(target, ids)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    if start:
        saved = load_file(str(state_file))
        opt.load_state_dict(_optimizer_state(opt, saved))
    std = float(data.features[:64].float().std())
    gen = torch.Generator().manual_seed(cfg.seed + start)
    n = data.tokens.shape[0]
    t0 = time.time()
    for step in range(start, cfg.steps):
        pick = torch.randint(0, n, (cfg.batch,), generator=gen)
        batch = FeatureData(
            *(getattr(data, f)[pick] for f in ("tokens", "features", "top_ids", "top_probs"))
        )
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        loss_f, loss_t, agree = feature_losses(head, batch, cfg, cfg.noise * std)
        loss = cfg.feature_weight * loss_f + cfg.token_weight * loss_t
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        done = step + 1
        if done % 20 == 0 or done == cfg.steps:
            rec = {"step": done, "loss_feature": float(loss_f.detach()), "loss_token": float(loss_t.detach()),
                   "top1_agreement": agree, "lr": _lr(cfg, step), "elapsed_s": time.time() - t0}  # fmt: skip
            if eval_data is not None and (done % cfg.save_every == 0 or done == cfg.steps):
                with torch.no_grad():
                    head.eval()
                    ef, et, ea = feature_losses(head, eval_data, cfg, 0.0)
                    head.train()
                rec.update(eval_feature=float(ef), eval_token=float(et), eval_top1=ea)
            log(json.dumps(rec))
            with open(log_file, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
        if done % cfg.save_every == 0 or done == cfg.steps:
            head.save(out / "head", step=done, train=asdict(cfg))
            flat = _flat_optimizer(opt)
            atomic_write(state_file, lambda tmp, flat=flat: save_file(flat, str(tmp)))
            atomic_write_text(out / "progress.json", json.dumps({"step": done, "steps": cfg.steps}))
    return head.eval()


def _flat_optimizer(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {}
    for i, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            flat[f"{i}.{name}"] = torch.as_tensor(value).clone().contiguous()
    return flat


def _optimizer_state(opt: torch.optim.Optimizer, flat: dict[str, torch.Tensor]) -> dict:
    state = opt.state_dict()
    rebuilt: dict[int, dict] = {}
    for key, value in flat.items():
        i, name = key.split(".", 1)
        rebuilt.setdefault(int(i), {})[name] = value
    state["state"] = rebuilt
    return state


def train_on_text(
    teacher: str,
    text: str,
    out: str | Path,
    cfg: FeatureTrainConfig,
    *,
    windows: int = 400,
    generations: int = 40,
    resume: bool = False,
    quiet: bool = False,
) -> dict:
    """`llmopt distill --feature-head`: data from `text` (a corpus, file or mix) and the
    teacher's own continuations, then training; the data is built once per --out."""
    from llmopt.compress.distill.draft import frequent_tokens
    from llmopt.models.loading import load_model, load_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # float32 (a GGUF dequantized once): the eager passes below are matrix products, not
    # per-call dequantization; the head's embedding and starting head rows are the same values
    target = load_model(teacher)
    data_file = out / "train_data.safetensors"
    if data_file.is_file():
        data = FeatureData.load(data_file)
    else:
        from llmopt.compress.quant.calibration import calibration_set

        tok = load_tokenizer(teacher)
        # windows of the mix (or one source) drawn the way calibration draws them
        prompt_len = max(1, cfg.seq_len // 4)
        try:
            rows = calibration_set(tok, text, windows, cfg.seq_len, cfg.seed).tokens.tolist()
            starts = calibration_set(tok, text, generations, prompt_len, cfg.seed + 7).tokens
        except LlmoptError as exc:
            raise FeatureTrainError(
                f"--windows {windows} / --generations {generations} over --text {text!r}: {exc}"
            ) from exc
        rows += own_generations(target, starts.tolist(), cfg.seq_len - prompt_len)
        progress = None if quiet else (lambda i, n: i % 50 == 0 and print(f"features {i}/{n}"))
        data = target_windows(target, torch.tensor(rows), cfg.top_k, progress)
        data.save(data_file)
    config = target.config
    always = [t for t in (*config.stop_token_ids, config.bos_token_id) if t is not None]
    pool = torch.cat([data.tokens.reshape(-1).long(), data.top_ids[..., 0].reshape(-1).long()])
    ids = frequent_tokens(pool, min(cfg.draft_vocab, config.vocab_size), config.vocab_size, always)
    n = data.tokens.shape[0]
    hold = max(1, n // 50)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + 1))
    fields = ("tokens", "features", "top_ids", "top_probs")
    train = FeatureData(*(getattr(data, f)[perm[hold:]] for f in fields))
    held = FeatureData(*(getattr(data, f)[perm[:hold]] for f in fields))
    last: dict = {}

    def log(line: str) -> None:
        last.update(json.loads(line))
        if not quiet:
            print(line, flush=True)

    train_feature_head(target, train, out, cfg, ids, resume=resume, eval_data=held, log=log)
    return {"head": str(out / "head"), **last}
