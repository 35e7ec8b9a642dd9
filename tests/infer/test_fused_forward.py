"""The fused C++ forward over a paged KV cache, for every registered architecture: logits of
mixed steps (prefill chunks + decodes + multi-token runs, non-contiguous block tables) equal
the eager model run per sequence with its static cache; greedy tokens equal; batched rows
equal batch-1 rows bit for bit; bad metadata is refused before the cache is touched."""

from __future__ import annotations

import os

from tests.paths import KERNEL_CACHE

os.environ.setdefault("LLMOPT_KERNEL_CACHE", str(KERNEL_CACHE))

import pytest  # noqa: E402
import torch  # noqa: E402

from llmopt.infer.fast import FusedModel  # noqa: E402
from llmopt.models import KVCache, ModelConfig, build_model  # noqa: E402
from llmopt.models.spec import registered_architectures  # noqa: E402

BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=64,
    rope_theta=10000.0,
)
CONFIGS = {
    "llama": dict(),
    "llama-gelu": dict(mlp="gelu"),  # the non-gated GELU MLP
    "qwen2": dict(attention_bias=True),
    "mistral": dict(sliding_window=5),
    "qwen3": dict(head_dim=32),
    "phi3": dict(sliding_window=6, tie_embeddings=True),
    "gemma2": dict(
        head_dim=32,
        sliding_window=4,
        full_attention_every=2,
        attn_softcap=2.0,
        final_softcap=3.0,
        query_pre_attn_scalar=24.0,
        tie_embeddings=True,
    ),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (conftest's `one_thread`)."""


def tiny_model(name: str) -> torch.nn.Module:
    arch = name.split("-")[0]
    cfg = ModelConfig(name=name, architecture=arch, **{**BASE, **CONFIGS[name]})
    model = build_model(cfg, seed=3).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # norms and biases away from their init (ones, zeros)
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
            if arch == "gemma2" and pname.endswith("q_proj.weight"):
                p.mul_(20.0)  # scores of a few units: the soft cap bends them
    return model


class PagedCache:
    """A paged cache whose blocks are handed out in a scrambled order (non-contiguous)."""

    def __init__(self, fused: FusedModel, num_blocks: int = 40, block_size: int = 4) -> None:
        self.block_size = block_size
        self.k = torch.zeros(fused.kv_shape(num_blocks * block_size))
        self.v = torch.zeros_like(self.k)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]):
        """Metadata of one step: `chunks` maps sequence id -> its new tokens."""
        tokens, positions, slots, query_start, seq_lens, tables = [], [], [], [0], [], []
        for seq, new in chunks.items():
            start = self.lengths.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < start + len(new):
                table.append(self.free.pop())
            for i, tok in enumerate(new):
                pos = start + i
                tokens.append(tok)
                positions.append(pos)
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            self.lengths[seq] = start + len(new)
            query_start.append(len(tokens))
            seq_lens.append(start + len(new))
            tables.append(table)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        return dict(
            tokens=torch.tensor(tokens),
            positions=torch.tensor(positions),
            slots=torch.tensor(slots),
            query_start=torch.tensor(query_start),
            seq_lens=torch.tensor(seq_lens),
            block_tables=block_tables,
            logits_rows=torch.arange(len(tokens)),
        )

    def run(self, fused: FusedModel, chunks: dict[int, list[int]]) -> torch.Tensor:
        meta = self.step(chunks)
        return fused.forward_tensors(
            **meta, k_cache=self.k, v_cache=self.v, block_size=self.block_size
        )


class EagerSeqs:
    """The reference: the eager model per sequence, each with its own static cache."""

    def __init__(self, model) -> None:
        self.model = model
        self.caches: dict[int, KVCache] = {}

    def run(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        out = []
        with torch.no_grad():
            for seq, new in chunks.items():
                cache = self.caches.setdefault(seq, KVCache.for_model(self.model, max_len=64))
                out.append(self.model(torch.tensor([new]), cache)[0])
        return torch.cat(out)


STEPS = [
    {0: [5, 9, 2, 7, 1, 3, 8], 1: [4, 4, 6, 1, 2]},  # a prompt and a first prefill chunk
    {0: [11], 1: [3, 9, 9, 2, 5, 6, 7], 2: [8, 1, 2]},  # decode, next chunk, new prompt
    {0: [12], 1: [13], 2: [14], 3: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]},  # decodes + a prompt
    {2: [20, 21, 22], 0: [15], 3: [16, 17]},  # a 3-token verify run among decodes
]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mixed_steps_match_eager_per_sequence(name):
    model = tiny_model(name)
    fused = FusedModel(model)
    paged, eager = PagedCache(fused), EagerSeqs(model)
    for chunks in STEPS:
        got = paged.run(fused, chunks)
        want = eager.run(chunks)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # greedy: four sequences decode together, each equal to its own eager greedy run
    last = {seq: int(eager.run({seq: [3]})[-1].argmax()) for seq in range(4)}
    paged.run(fused, {seq: [3] for seq in range(4)})
    for _ in range(6):
        got = paged.run(fused, {seq: [tok] for seq, tok in last.items()})
        for row, seq in enumerate(last):
            want = eager.run({seq: [last[seq]]})[-1]
            assert int(got[row].argmax()) == int(want.argmax())
            last[seq] = int(want.argmax())


def test_every_registered_architecture_is_covered_or_refused_by_name():
    from llmopt.infer.fast import fused_unavailable
    from tests.models.test_architectures import CONFIGS as ARCH_CONFIGS

    covered = {name.split("-")[0] for name in CONFIGS}
    refused = set(registered_architectures()) - covered
    assert refused == {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"}
    for arch in sorted(refused):  # mixture-of-experts and latent attention: the eager runner
        reason = fused_unavailable(build_model(ARCH_CONFIGS[arch], seed=0))
        assert f"architecture {arch!r} has " in reason
        assert ("mixture-of-experts" in reason) and (
            ("latent" in reason) == (arch == "deepseek_v3")
        )


def test_batched_rows_equal_batch1_rows_bit_for_bit():
    from llmopt.compress.quant.apply import quantize_model

    model = quantize_model(tiny_model("qwen2"), bits=4, group_size=32)  # coded GEMMs
    fused = FusedModel(model)
    alone, batched = PagedCache(fused), PagedCache(fused)
    prompt = [5, 9, 2, 7, 1, 3, 8, 4, 4, 6, 1, 2, 30]
    ref = alone.run(fused, {0: prompt})
    got = batched.run(fused, {1: [3, 4, 5], 0: prompt, 2: list(range(20, 31))})
    assert torch.equal(got[3 : 3 + len(prompt)], ref)
    ref = alone.run(fused, {0: [17]})
    got = batched.run(fused, {2: [1], 0: [17], 1: [2, 3]})
    assert torch.equal(got[1], ref[0])


def test_logits_rows_select_rows_and_cache_is_shared_with_eager_layout():
    model = tiny_model("llama")
    fused = FusedModel(model)
    paged = PagedCache(fused)
    meta = paged.step({0: [1, 2, 3, 4, 5]})
    meta["logits_rows"] = torch.tensor([4, 1])
    got = fused.forward_tensors(**meta, k_cache=paged.k, v_cache=paged.v, block_size=4)
    with torch.no_grad():
        cache = KVCache.for_model(model, max_len=8)
        want = model(torch.tensor([[1, 2, 3, 4, 5]]), cache)[0]
    torch.testing.assert_close(got, want[[4, 1]], rtol=0, atol=1e-4)
    # a prefill chunk not at its prompt's end wants no logits: the step still fills the cache
    meta = paged.step({0: [6, 7]})
    meta["logits_rows"] = torch.zeros(0, dtype=torch.long)
    out = fused.forward_tensors(**meta, k_cache=paged.k, v_cache=paged.v, block_size=4)
    assert out.shape == (0, model.config.vocab_size)
    got = paged.run(fused, {0: [8]})
    with torch.no_grad():
        want = model(torch.tensor([[6, 7, 8]]), cache)[0, -1]
    torch.testing.assert_close(got[0], want, rtol=0, atol=1e-4)
    # the paged rows hold what the eager static cache holds, position by position
    table = paged.tables[0]
    for pos in range(5):
        row = table[pos // 4] * 4 + pos % 4
        torch.testing.assert_close(paged.k[:, row], cache.k[:, 0, :, pos], rtol=0, atol=1e-6)
        torch.testing.assert_close(paged.v[:, row], cache.v[:, 0, :, pos], rtol=0, atol=1e-6)


def _bad(meta: dict, **changes) -> dict:
    return {**meta, **changes}


def test_bad_metadata_is_refused_before_the_cache_is_written():
    model = tiny_model("llama")
    fused = FusedModel(model)
    paged = PagedCache(fused)
    meta = paged.step({0: [1, 2, 3], 1: [4]})
    before = paged.k.clone()
    cases = [
        (
            dict(tokens=torch.tensor([1, 2, 3, 96])),
            r"token 96 at row 3 outside the vocabulary \[0, 96\)",
        ),
        (dict(slots=meta["slots"] + 1), "is not where block_tables puts position"),
        (
            dict(positions=torch.tensor([0, 1, 5, 0])),
            r"position 5 at row 2 outside its sequence's \[0, 3\)",
        ),
        (dict(query_start=torch.tensor([0, 0, 4])), "sequence 0 has no tokens"),
        (dict(seq_lens=torch.tensor([3, 65])), "seq_lens"),
        (dict(logits_rows=torch.tensor([4])), r"logits_rows\[0\] = 4 outside \[0, 4\)"),
        (dict(block_tables=meta["block_tables"] + 1000), "outside"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            fused.forward_tensors(
                **_bad(meta, **change), k_cache=paged.k, v_cache=paged.v, block_size=4
            )
    with pytest.raises(ValueError, match="block_size 3 must be positive and divide"):
        fused.forward_tensors(**meta, k_cache=paged.k, v_cache=paged.v, block_size=3)
    with pytest.raises(ValueError, match="k_cache and v_cache must be"):
        fused.forward_tensors(**meta, k_cache=paged.k[:2], v_cache=paged.v[:2], block_size=4)
    assert torch.equal(paged.k, before)


def test_thread_count_is_honoured_per_call_and_never_changes_results():
    from llmopt.compress.quant.apply import quantize_model

    model = quantize_model(tiny_model("mistral"), bits=4, group_size=32)
    one, two = FusedModel(model, threads=1), FusedModel(model, threads=2)
    a, b = PagedCache(one), PagedCache(two)
    for chunks in STEPS:  # every output element is computed by one thread, the same way
        assert torch.equal(a.run(one, chunks), b.run(two, chunks))
    assert torch.get_num_threads() == 1  # the call's setting does not leak
    with pytest.raises(ValueError, match="threads=0 must be >= 1"):
        FusedModel(model, threads=0)


def test_runner_contract_reads_and_writes_the_engines_cache():
    from types import SimpleNamespace

    from llmopt.infer.fast import FusedRunner, fused_unavailable

    model = tiny_model("qwen3")
    assert fused_unavailable(model) is None
    fused = FusedModel(model)
    paged = PagedCache(fused)
    cache = SimpleNamespace(k=paged.k, v=paged.v, block_size=4)
    runner = FusedRunner(model, cache)
    assert runner.name == "fused"
    eager = EagerSeqs(model)
    for chunks in STEPS[:2]:
        batch = SimpleNamespace(**paged.step(chunks), block_size=4)
        torch.testing.assert_close(runner.forward(batch), eager.run(chunks), rtol=0, atol=1e-4)
    f64 = SimpleNamespace(k=paged.k.double(), v=paged.v.double(), block_size=4)
    with pytest.raises(ValueError, match="float16 CPU cache; cache.k is torch.float64"):
        FusedRunner(model, f64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_cache_holds_the_rounded_fp32_rows(dtype):
    model = tiny_model("gemma2")  # head_dim 32: the vectorized attention
    fused = FusedModel(model)
    full, half = PagedCache(fused), PagedCache(fused)
    half.k, half.v = half.k.to(dtype), half.v.to(dtype)
    eager = EagerSeqs(model)
    for chunks in STEPS[:2]:
        want = eager.run(chunks)
        got_full, got_half = full.run(fused, chunks), half.run(fused, chunks)
        torch.testing.assert_close(got_full, want, rtol=0, atol=1e-4)
        # keys/values rounded to 8 (bf16) or 11 (fp16) bits: logits move by ~1e-2 at most
        assert (got_half - want).abs().max() < 0.05 * want.abs().max()
    # layer 0's rows come from the same fp32 values (the embeddings), rounded once when stored;
    # later layers differ, having attended to rounded keys
    rows = torch.cat([torch.arange(b * 4, b * 4 + 4) for b in full.tables[0]])
    assert torch.equal(half.k[0, rows], full.k[0, rows].to(dtype))
    assert torch.equal(half.v[0, rows], full.v[0, rows].to(dtype))


def test_engine_objects_and_one_cache_served_by_both_runners():
    """`StepBatch` / `PagedKVCache` as the engine builds them; eager and fused steps alternate
    over one cache, each reading the keys/values the other wrote."""
    from llmopt.infer.batch.runner import EagerRunner
    from llmopt.infer.fast import FusedRunner
    from llmopt.models.attention.paged import PagedKVCache, SeqChunk, StepBatch

    model = tiny_model("mistral")
    cache = PagedKVCache.for_model(model, num_blocks=24, block_size=4)
    eager_runner, fused_runner = EagerRunner(model, cache), FusedRunner(model, cache)
    tables = {0: [7, 2, 19, 4, 11], 1: [3, 15, 0, 9, 21]}
    reference = EagerSeqs(model)
    lengths = {0: 0, 1: 0}
    for i, chunks in enumerate([{0: [5, 9, 2, 7, 1], 1: [4, 4, 6]}, {0: [11], 1: [3, 9, 9, 2]},
                                {0: [12, 13], 1: [14]}, {0: [15], 1: [16]}]):  # fmt: skip
        batch = StepBatch.build(
            [SeqChunk(new, lengths[s], tables[s], logits_from=0) for s, new in chunks.items()],
            block_size=4,
        )
        runner = fused_runner if i % 2 else eager_runner
        got = runner.forward(batch)
        torch.testing.assert_close(got, reference.run(chunks), rtol=0, atol=1e-4)
        for s, new in chunks.items():
            lengths[s] += len(new)
