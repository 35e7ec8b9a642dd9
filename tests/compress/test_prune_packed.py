"""Packed N:M storage: exact round trip, 9/16 of fp16 for 2:4, exact dequantised matmul; pruned
directories load back with identical logits, are built aside, refuse bad destinations."""

import json

import pytest
import torch
import torch.nn.functional as F

from llmopt.compress.prune import load_pruned, prune_model, save_pruned
from llmopt.compress.prune.masks import nm_mask
from llmopt.models.packed.metadata import compression_metadata
from llmopt.models.packed.sparse.directory import MARKER, WEIGHTS, PruneFileError
from llmopt.models.packed.sparse.format import (
    SparseLinear,
    index_bits,
    pack_bits,
    pack_nm,
    unpack_bits,
)


def _nm_weight(rows, cols, n, m, seed=0):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    keep = nm_mask(w.abs(), n, m)
    return w * keep, keep


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 8])
def test_bit_packing_round_trips(bits):
    codes = torch.randint(0, 2**bits, (7, 13), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (7, (13 * bits + 7) // 8)
    assert torch.equal(unpack_bits(packed, bits, 13), codes)
    with pytest.raises(ValueError, match=f"exceeds {bits} bits"):
        pack_bits(codes + 2**bits, bits)


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4), (3, 8)])
def test_pack_round_trip_is_exact(n, m):
    w, keep = _nm_weight(24, 64, n, m)
    w16 = w.half()
    packed = pack_nm(w16, keep, n, m)
    assert packed.values.dtype == torch.float16 and packed.values.shape == (24, 64 * n // m)
    assert torch.equal(packed.dense(), w16)  # bit-exact
    assert index_bits(m) == {4: 2, 8: 3}[m]
    assert packed.nbytes() == 24 * (64 * n // m * 2 + (64 * n // m * index_bits(m) + 7) // 8)


def test_two_four_is_nine_sixteenths_of_fp16():
    w, keep = _nm_weight(1536, 576, 2, 4)  # SmolLM2's gate/up shape
    packed = pack_nm(w, keep, 2, 4)
    ratio = packed.nbytes() / (2 * w.numel())
    assert ratio == 9 / 16 and ratio <= 0.6


def test_sparse_linear_is_the_dense_matmul_of_the_packed_weight():
    w, keep = _nm_weight(32, 64, 2, 4)
    bias = torch.randn(32)
    layer = SparseLinear(pack_nm(w, keep, 2, 4), bias)
    x = torch.randn(5, 7, 64)
    assert torch.equal(layer(x), F.linear(x, w.half().float(), bias))
    assert torch.equal(layer(x.double()), F.linear(x.double(), w.half().double(), bias.double()))


def test_pack_refuses_what_is_not_n_m_sparse():
    w, keep = _nm_weight(8, 16, 2, 4)
    keep[0, 0] = ~keep[0, 0]
    with pytest.raises(ValueError, match="1 groups of 4 do not keep exactly 2 weights"):
        pack_nm(w, keep, 2, 4)
    _, keep = _nm_weight(8, 16, 2, 4)
    with pytest.raises(ValueError, match="exceeds the fp16 range"):
        pack_nm(w * 1e6, keep, 2, 4)
    with pytest.raises(ValueError, match="NaN or inf"):
        pack_nm(w.masked_fill(keep, float("nan")), keep, 2, 4)


def _fp16_linears(model):
    """The model as saved: pruned linears rounded to fp16 (the format's value dtype)."""
    for name in compression_metadata(model).prune_masks:
        lin = model.get_submodule(name)
        lin.weight.data = lin.weight.data.half().float()
    return model


@pytest.mark.parametrize("target", ["2:4", "4:8", "0.5"])
def test_directory_round_trip_gives_identical_logits(tmp_path, tiny_model, target):
    calib = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    pruned = prune_model(tiny_model, "wanda", target, calib_tokens=calib)
    out = save_pruned(pruned, tmp_path / "p")
    loaded = load_pruned(out)
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    expected = _fp16_linears(pruned)(tokens)
    assert torch.equal(loaded(tokens), expected)
    assert torch.equal(load_pruned(out, packed=False)(tokens), expected)
    kinds = {type(m).__name__ for m in loaded.modules()}
    assert ("SparseLinear" in kinds) == (":" in target)
    assert compression_metadata(loaded).prune_config == compression_metadata(pruned).prune_config
    assert all(
        torch.equal(compression_metadata(loaded).prune_masks[k], v)
        for k, v in compression_metadata(pruned).prune_masks.items()
    )
    meta = json.loads((out / MARKER).read_text())
    ratio = meta["pruned_linear_bytes"] / meta["pruned_linear_fp16_bytes"]
    # 2:4 and 4:8 pack to 9/16 and 19/32 of fp16; unstructured is dense fp16 + a 1-bit mask
    assert ratio == {"2:4": 9 / 16, "4:8": 19 / 32, "0.5": 17 / 16}[target]
    assert [p.name for p in tmp_path.iterdir()] == ["p"]  # nothing left beside it
    resaved = save_pruned(loaded, tmp_path / "again")  # a loaded model saves again
    assert torch.equal(load_pruned(resaved)(tokens), expected)


def test_packed_file_is_smaller_by_the_format_ratio(tmp_path, tiny_model):
    dense_sizes = {}
    for target in ("2:4", "0.5"):
        pruned = prune_model(tiny_model, "magnitude", target)
        out = save_pruned(pruned, tmp_path / target.replace(":", "of"))
        dense_sizes[target] = (out / WEIGHTS).stat().st_size
    linears = sum(m.numel() for m in compression_metadata(pruned).prune_masks.values())
    # the files differ by the pruned linears' bytes: (17/16 - 9/16) x fp16 size, +- header
    saved = dense_sizes["0.5"] - dense_sizes["2:4"]
    assert abs(saved - linears * 2 * 0.5) < 4096


def test_bad_destinations_and_files_are_refused(tmp_path, tiny_model):
    pruned = prune_model(tiny_model, "magnitude", "2:4")
    src = tmp_path / "src"
    src.mkdir()
    for out in (src, src / "inside"):
        with pytest.raises(PruneFileError, match="is the source model .* or inside it"):
            save_pruned(pruned, out, source=src)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(PruneFileError, match="holds files llmopt did not write \\(notes.txt\\)"):
        save_pruned(pruned, tmp_path / "other")
    out = save_pruned(pruned, tmp_path / "p")
    save_pruned(prune_model(tiny_model, "magnitude", "4:8"), out)  # replaces an old output
    assert compression_metadata(load_pruned(out)).prune_config.sparsity.m == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "p", "src"]
    data = bytearray((out / WEIGHTS).read_bytes())
    data[-10] ^= 0xFF
    (out / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(PruneFileError, match="corrupted or was replaced"):
        load_pruned(out)
    with pytest.raises(FileNotFoundError, match="not a pruned model directory"):
        load_pruned(tmp_path / "other")
    with pytest.raises(PruneFileError, match="no prune_config"):
        save_pruned(tiny_model, tmp_path / "q")


def test_load_model_opens_a_pruned_directory(tmp_path, tiny_model):
    """`llmopt.compress` registers the pruned format, so every command that takes --model
    (generate, eval) opens a pruned directory like any other model."""
    from llmopt.models.loading import load_model

    calib = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    pruned = prune_model(tiny_model, "sparsegpt", "2:4", calib_tokens=calib)
    out = save_pruned(pruned, tmp_path / "p")
    tokens = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(2))
    assert torch.equal(load_model(str(out))(tokens), load_pruned(out)(tokens))
