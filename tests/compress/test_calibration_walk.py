"""The calibration walk: blocks visited once each, in order, block i+1 fed the outputs of the
already-transformed block i, and block 0 fed what the model's own forward feeds it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmopt.compress.calibration_walk import BlockMethod, BlockStep, walk_blocks
from llmopt.models.config import ModelConfig
from llmopt.models.llama import build_model

CONFIGS = {
    "llama": ModelConfig(
        name="walk-llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
        num_heads=4, num_kv_heads=2, max_seq_len=32,
    ),
    "gemma2": ModelConfig(  # scaled embeddings and sandwich norms
        name="walk-gemma2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
        num_heads=4, num_kv_heads=2, max_seq_len=32, head_dim=8, tie_embeddings=True,
        architecture="gemma2",
    ),
}  # fmt: skip


class Recorder(BlockMethod):
    """Records every block's inputs and observed stages; doubles each down_proj (so a walk
    that fed block i+1 the untransformed outputs would be caught)."""

    def __init__(self, feed_original: bool = False) -> None:
        self.feed_original = feed_original
        self.visits: list[tuple[int, str]] = []
        self.inputs: list[torch.Tensor] = []
        self.observed: list[tuple[int, list[str], set[str]]] = []
        self.finished: list[int] = []

    def stages(self, step: BlockStep) -> list[list[str]]:
        self.visits.append((step.index, step.name))
        self.inputs.append(step.x.clone())
        return [["self_attn.q_proj", "self_attn.o_proj"], ["mlp.down_proj"]]

    def observe(self, name: str, inputs: torch.Tensor) -> Any:
        return inputs.shape

    def apply(self, step: BlockStep, stage: list[str], stats: dict[str, Any]) -> None:
        self.observed.append((step.index, stage, set(stats)))
        if stage == ["mlp.down_proj"]:
            step.block.mlp.down_proj.weight.data *= 2.0

    def finish(self, step: BlockStep) -> None:
        self.finished.append(step.index)


def _model_and_tokens(arch: str):
    model = build_model(CONFIGS[arch], seed=3)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    return model, tokens


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_blocks_visited_once_in_order_fed_the_transformed_outputs(arch):
    model, tokens = _model_and_tokens(arch)
    first_inputs = []
    hook = model.layers[0].register_forward_pre_hook(lambda _m, args: first_inputs.append(args[0]))
    with torch.no_grad():
        model(tokens)
    hook.remove()
    rec = Recorder()
    walk_blocks(model, tokens, rec)

    assert rec.visits == [(0, "layers.0"), (1, "layers.1"), (2, "layers.2")]
    assert rec.finished == [0, 1, 2]
    assert [(i, tuple(s)) for i, s, _ in rec.observed] == [
        (i, s)
        for i in range(3)
        for s in (("self_attn.q_proj", "self_attn.o_proj"), ("mlp.down_proj",))
    ]
    assert all(set(stage) == seen for _, stage, seen in rec.observed)
    # block 0 gets exactly what the model's forward gives it (Gemma's sqrt(hidden) scale too)
    torch.testing.assert_close(rec.inputs[0], first_inputs[0], rtol=0, atol=0)
    cos, sin = model.rotary(0, tokens.shape[1], torch.float32)
    with torch.no_grad():
        for i in (0, 1):  # the blocks are transformed in place: down_proj doubled
            after = model.layers[i](rec.inputs[i], cos, sin)
            torch.testing.assert_close(rec.inputs[i + 1], after, rtol=0, atol=0)
            model.layers[i].mlp.down_proj.weight.data /= 2.0
            before = model.layers[i](rec.inputs[i], cos, sin)
            model.layers[i].mlp.down_proj.weight.data *= 2.0
            assert (rec.inputs[i + 1] - before).abs().max() > 1e-3


def test_feed_original_passes_the_outputs_from_before_the_transform():
    model, tokens = _model_and_tokens("llama")
    rec = Recorder(feed_original=True)
    dense = [b.mlp.down_proj.weight.data.clone() for b in model.layers]
    walk_blocks(model, tokens, rec)
    cos, sin = model.rotary(0, tokens.shape[1], torch.float32)
    with torch.no_grad():
        for i in (0, 1):
            model.layers[i].mlp.down_proj.weight.data = dense[i]
            before = model.layers[i](rec.inputs[i], cos, sin)
            torch.testing.assert_close(rec.inputs[i + 1], before, rtol=0, atol=0)


def test_without_calibration_tokens_nothing_is_observed():
    model, _ = _model_and_tokens("llama")
    calls = []
    model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))

    class Blind(Recorder):
        def stages(self, step: BlockStep) -> list[list[str]]:
            self.visits.append((step.index, step.name))
            assert step.x is None
            return [["mlp.down_proj"]]

    rec = Blind()
    walk_blocks(model, None, rec)
    assert rec.visits == [(0, "layers.0"), (1, "layers.1"), (2, "layers.2")]
    assert [seen for _, _, seen in rec.observed] == [set(), set(), set()]
    assert calls == []  # no block ran forward


def test_a_linear_the_forward_never_reaches_is_an_error():
    model, tokens = _model_and_tokens("llama")

    class Missing(Recorder):
        def stages(self, step: BlockStep) -> list[list[str]]:
            return [["mlp.down_proj", "self_attn.q_proj"]]

    model.layers[0].mlp.forward = lambda x: x  # the MLP's linears never run
    with pytest.raises(RuntimeError, match=r"block forward never reached \['mlp.down_proj'\]"):
        walk_blocks(model, tokens, Missing())


def test_expert_linears_are_sequential_too():
    """`mlp.experts.*.gate_proj` in the spec's order stands for every expert: the experts'
    down projections are observed after their gate/up projections were transformed."""
    from llmopt.compress.calibration_walk import sequential_stages
    from llmopt.models.moe import MoEConfig
    from llmopt.models.spec import spec_for

    config = ModelConfig(
        name="t-mixtral", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
        num_heads=4, num_kv_heads=2, max_seq_len=32, architecture="mixtral",
        moe=MoEConfig(num_experts=3, top_k=2, expert_ffn_hidden=16),
    )  # fmt: skip
    model = build_model(config, seed=0)
    spec = spec_for(model)
    block = spec.blocks_of(model)[0]
    names = [n for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
    stages = sequential_stages(spec, names)
    where = {n: i for i, stage in enumerate(stages) for n in stage}
    for e in range(3):
        gate, down = f"mlp.experts.{e}.gate_proj", f"mlp.experts.{e}.down_proj"
        assert where[gate] < where[down], stages
    assert sorted(n for stage in stages for n in stage) == sorted(names)
