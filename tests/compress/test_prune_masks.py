"""Masks have exact counts (N:M groups, rows, layers) for all three methods; calibration is
sequential (each block sees the pruned blocks before it) and follows the spec's stages."""

import copy

import pytest
import torch

from llmopt.compress.prune import prune_model
from llmopt.compress.prune.masks import layer_mask, nm_mask, row_mask, wanda_score
from llmopt.compress.prune.sparsegpt import sparsegpt_solve
from llmopt.compress.quant.gptq import collect_hessians
from llmopt.models.packed.metadata import compression_metadata
from llmopt.models.packed.sparse.config import PruneConfigError, Sparsity
from llmopt.models.spec import spec_for

METHODS = ("magnitude", "wanda", "sparsegpt")


def _calib(vocab=128, n=4, t=32, seed=0):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def test_selectors_prune_exact_counts_even_with_ties():
    score = torch.ones(6, 16)  # all tied
    score[0, :3] = 0.0
    assert int(layer_mask(score, 0.5).sum()) == 48
    assert (row_mask(score, 0.25).sum(1) == 12).all()
    assert (nm_mask(score, 2, 4).reshape(6, 4, 4).sum(-1) == 2).all()
    assert not nm_mask(score, 2, 4)[0, :2].any()  # the lowest scores go first


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("target", ["2:4", "4:8", "1:4", "3:8"])
def test_every_nm_group_keeps_exactly_n(tiny_model, method, target):
    sparsity = Sparsity.parse(target)
    pruned = prune_model(tiny_model, method, target, calib_tokens=_calib())
    spec = spec_for(pruned)
    assert len(compression_metadata(pruned).prune_masks) == 2 * len(spec.block_linears)
    for name, keep in compression_metadata(pruned).prune_masks.items():
        weight = pruned.get_submodule(name).weight.data
        rows, cols = weight.shape
        nonzero = (weight != 0).reshape(rows, cols // sparsity.m, sparsity.m).sum(-1)
        assert (nonzero == sparsity.n).all(), name
        assert torch.equal(keep, weight != 0)
    assert compression_metadata(pruned).prune_report["pruned_fraction"] == pytest.approx(
        sparsity.fraction
    )


@pytest.mark.parametrize("method", METHODS)
def test_unstructured_fraction_is_exact(tiny_model, method):
    pruned = prune_model(tiny_model, method, 0.6, calib_tokens=_calib())
    for name, keep in compression_metadata(pruned).prune_masks.items():
        rows, cols = keep.shape
        if method == "wanda":  # compared per output row
            assert (keep.sum(1) == cols - int(cols * 0.6)).all(), name
        elif method == "magnitude":  # one threshold per layer
            assert int(keep.sum()) == keep.numel() - int(keep.numel() * 0.6), name
        else:  # per 128-column block, over the block
            assert int((~keep).sum()) == sum(
                int(rows * min(128, cols - b) * 0.6) for b in range(0, cols, 128)
            )


def test_input_model_is_untouched(tiny_model):
    before = copy.deepcopy(tiny_model.state_dict())
    prune_model(tiny_model, "sparsegpt", "2:4", calib_tokens=_calib())
    after = tiny_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_wanda_score_uses_input_norms():
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    x[:, 3] *= 40.0  # an outlier channel
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)) * 0.1
    score = wanda_score(w, (x * x).sum(0))
    assert torch.allclose(score, w.abs() * x.norm(dim=0)[None, :])
    keep = nm_mask(score, 2, 4)
    assert keep[:, 3].all()  # the outlier channel's weights survive in every row


def test_calibration_is_sequential_and_staged(tiny_model):
    """SparseGPT by hand: stage by stage, each block fed the pruned block's outputs."""
    calib = _calib()
    got = prune_model(tiny_model, "sparsegpt", "2:4", calib_tokens=calib, block_size=16)
    ref = copy.deepcopy(tiny_model)
    spec = spec_for(ref)
    sparsity = Sparsity.parse("2:4")
    with torch.no_grad():
        x = spec.top_module(ref, "embedding")(calib)
        cos, sin = ref.rotary(0, calib.shape[1], x.dtype)
        for block in spec.blocks_of(ref):
            for stage in spec.gptq_order:
                hessians = collect_hessians(block, list(stage), x, cos, sin)
                for name in stage:
                    lin = spec.block_module(block, name)
                    lin.weight.data = sparsegpt_solve(
                        lin.weight, hessians[name], sparsity, block_size=16
                    )[0]
            x = block(x, cos, sin)
    for key, tensor in ref.state_dict().items():
        assert torch.equal(got.state_dict()[key], tensor), key
    # one-shot calibration from the dense model would differ in the second block
    one_shot = copy.deepcopy(tiny_model)
    name = spec.gptq_order[0][0]
    dense_blocks = spec.blocks_of(tiny_model)
    with torch.no_grad():
        dense_in = dense_blocks[0](spec.top_module(tiny_model, "embedding")(calib), cos, sin)
    h = collect_hessians(dense_blocks[1], [name], dense_in, cos, sin)[name]
    lin = spec.block_module(spec.blocks_of(one_shot)[1], name)
    w_dense_stats = sparsegpt_solve(lin.weight, h, sparsity, block_size=16)[0]
    got_second = spec.block_module(spec.blocks_of(got)[1], name).weight
    assert not torch.equal(w_dense_stats, got_second)


def test_bad_inputs_are_refused(tiny_model):
    with pytest.raises(PruneConfigError, match="needs calibration tokens"):
        prune_model(tiny_model, "wanda", 0.5)
    with pytest.raises(PruneConfigError, match=r"\[n, T\] int64"):
        prune_model(tiny_model, "sparsegpt", 0.5, calib_tokens=torch.zeros(4, 8))
    with pytest.raises(PruneConfigError, match="multiple of 48; a layer has 64 inputs"):
        prune_model(tiny_model, "magnitude", "2:48")
    with pytest.raises(PruneConfigError, match="unknown pruning method 'obs'"):
        prune_model(tiny_model, "obs", 0.5)
    magnitude = prune_model(tiny_model, "magnitude", 0.5)  # no calibration needed
    assert compression_metadata(magnitude).prune_report["pruned_fraction"] == pytest.approx(0.5)
    with pytest.raises(PruneConfigError, match="already pruned"):
        prune_model(magnitude, "magnitude", 0.5)
