"""Shared checks of the per-architecture tests: a tiny random transformers model, saved with
`save_pretrained`, loaded by llmopt; logits and greedy decoding compared with transformers'."""

from __future__ import annotations

from pathlib import Path

import torch

from llmopt.models.llama import KVCache
from llmopt.models.loading import load_model, save_pretrained

TOKENS = 16  # greedy tokens compared


def save_tiny_hf(
    config, directory: Path, seed: int = 0, boost: dict[str, float] | None = None
) -> torch.nn.Module:
    """A randomly initialised transformers model of `config`, saved; norms perturbed so a
    wrong norm convention (w vs 1 + w) cannot hide behind unit weights, and parameters whose
    name contains a `boost` key multiplied by its value (to make small scores large)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            for key, factor in (boost or {}).items():
                if key in name:
                    p.mul_(factor)
    model.save_pretrained(directory)
    return model


def greedy(model: torch.nn.Module, prompt: torch.Tensor, n: int = TOKENS) -> list[int]:
    """llmopt's cached greedy decoding (prefill, then one token per step)."""
    cache = KVCache.for_model(model, max_len=prompt.shape[1] + n)
    logits = model(prompt, cache, last_only=True)
    out = []
    for _ in range(n):
        token = int(logits[0, -1].argmax())
        out.append(token)
        logits = model(torch.tensor([[token]]), cache, last_only=True)
    return out


def hf_forward_greedy(ref: torch.nn.Module, prompt: torch.Tensor, n: int = TOKENS) -> list[int]:
    """Greedy tokens from transformers' full forward pass, recomputed for every token."""
    x = prompt
    for _ in range(n):
        x = torch.cat([x, ref(x).logits[:, -1:].argmax(-1)], dim=1)
    return x[0, prompt.shape[1] :].tolist()


def check_parity(
    ref: torch.nn.Module, directory: Path, vocab: int, seq: int = 24, generate: bool = True
) -> None:
    """llmopt's model from `directory` matches `ref`: logits to 1e-4, 16 greedy tokens equal
    (to `ref.generate`, or with generate=False to greedy over ref's uncached forward)."""
    ours = load_model(directory)
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids).logits
        torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=1e-4)
        prompt = ids[:1, :8]
        if generate:
            out = ref.generate(
                prompt, max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS
            )
            expected_tokens = out[0, prompt.shape[1] :].tolist()
        else:
            expected_tokens = hf_forward_greedy(ref, prompt)
        assert greedy(ours, prompt) == expected_tokens


def check_save_round_trip(directory: Path, out: Path, vocab: int) -> None:
    """llmopt's model from `directory`, written by our `save_pretrained` to `out` and read
    back by transformers, gives the same logits (to 1e-5)."""
    from transformers import AutoModelForCausalLM

    ours = load_model(directory)
    save_pretrained(ours, out)
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.arange(20).view(1, 20) % vocab
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), again(ids).logits, atol=1e-5, rtol=1e-5)


def tp_gradient_errors(rank: int, world: int, arch: str) -> dict[str, float]:
    """Max |grad| difference, over all parameters, between a tp=`world` model (gloo, with and
    without sequence parallelism) and the unsharded one, for `arch`'s tiny model."""
    from llmopt.parallel.grid import ParallelDims, RankGrid
    from llmopt.parallel.tensor_parallel import apply_tensor_parallel, lm_loss
    from tests.models.test_architectures import tiny, tokens

    grid = RankGrid.create(ParallelDims(world, tp=world))
    errors = {}
    for sp in (False, True):
        ref, model = tiny(arch), tiny(arch)
        ids = tokens(2, 17)  # 16 inputs: sequence parallelism splits them in two
        inputs, targets = ids[:, :-1], ids[:, 1:]
        lm_loss(ref, inputs, targets).backward()
        apply_tensor_parallel(model, grid.tp, sequence_parallel=sp)
        lm_loss(model, inputs, targets).backward()
        expected = dict(ref.named_parameters())
        worst = 0.0
        for name, p in model.named_parameters():
            grad = p.grad
            dim = getattr(p, "tp_dim", None)
            if dim is not None:
                grad = grid.tp.all_gather(grad.contiguous(), dim=dim)
            worst = max(worst, (grad - expected[name].grad).abs().max().item())
        errors[f"sp={sp}"] = worst
    return errors
