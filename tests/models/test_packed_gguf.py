"""GGUF quantized weights kept as the file holds them: block decoding equals the `gguf`
package's dequantization bit for bit for Q4_0/Q4_1/Q8_0/Q4_K/Q6_K; the eager modules compute
with exactly those weights; the fused kernels read them directly; `load_model(dtype="auto")`
builds a mixed-format model whose logits equal the dequantized model's."""

from __future__ import annotations

import os
from pathlib import Path

from tests.paths import KERNEL_CACHE

os.environ.setdefault("LLMOPT_KERNEL_CACHE", str(KERNEL_CACHE))

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmopt.infer.fast import FastDecoder, build  # noqa: E402
from llmopt.infer.fast.layout import projection  # noqa: E402
from llmopt.models import ModelConfig  # noqa: E402
from llmopt.models.loading import load_model  # noqa: E402
from llmopt.models.packed import BlockQuantEmbedding, BlockQuantLinear  # noqa: E402
from llmopt.models.packed.block import BUFFERS  # noqa: E402
from llmopt.models.packed.gguf_blocks import packed_tensors  # noqa: E402
from tests.tiny_models import add_gguf_llama_header

Q = gguf.GGMLQuantizationType
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (conftest's `one_thread`)."""


def raw_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid GGML bytes [rows, bytes per row]: quantized random weights for the simple types
    (gguf can quantize them), random codes with finite fp16 scales for the K-quants."""
    rng = np.random.default_rng(seed)
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return gguf.quants.quantize(w, Q[kind])
    block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)

    def f16(values):
        return values.astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)

    scale = rng.uniform(1e-4, 2e-3, (rows, cols // block))
    if kind == "Q4_K":
        raw[..., 0:2] = f16(scale)
        raw[..., 2:4] = f16(scale * 0.5)  # dmin
    else:  # Q6_K: int8 sub-scales in [-40, 40], fp16 d last
        raw[..., 192:208] = (
            rng.integers(-40, 41, (rows, cols // block, 16)).astype(np.int8).view(np.uint8)
        )
        raw[..., 208:210] = f16(scale)
    return raw.reshape(rows, -1)


def packed_linear(kind: str, rows: int, cols: int, seed: int = 0) -> BlockQuantLinear:
    fmt, buffers = packed_tensors(raw_blocks(kind, rows, cols, seed), kind, rows, cols)
    layer = BlockQuantLinear(cols, rows, fmt.name)
    for name, value in buffers.items():
        getattr(layer, name).copy_(value)
    return layer


@pytest.mark.parametrize("kind", TYPES)
def test_block_decoding_equals_gguf_dequantize_bit_for_bit(kind):
    rows, cols = 24, 512
    raw = raw_blocks(kind, rows, cols)
    want = gguf.quants.dequantize(raw, Q[kind]).reshape(rows, cols)
    layer = packed_linear(kind, rows, cols)
    assert torch.equal(layer.dequantize(), torch.from_numpy(want))
    # bytes kept: the file's, but Q4_K's 8 sub-scale/min pairs as 16 bytes (12 in the file)
    # and Q6_K's 6-bit codes one per byte
    file_bytes = raw.nbytes
    ratio = {"Q4_0": 1.0, "Q4_1": 1.0, "Q8_0": 1.0, "Q4_K": 148 / 144, "Q6_K": 274 / 210}[kind]
    assert layer.packed_nbytes() == pytest.approx(file_bytes * ratio)
    x = torch.randn(3, 5, cols)
    layer.tile_rows = 7  # the eager forward dequantizes 7 rows at a time
    torch.testing.assert_close(layer(x), F.linear(x, layer.dequantize()), rtol=1e-5, atol=1e-5)
    embed = BlockQuantEmbedding(rows, cols, layer.fmt.name)
    for name in BUFFERS:
        setattr(embed, name, getattr(layer, name))
    ids = torch.tensor([[3, 0, 23], [5, 5, 1]])
    assert torch.equal(embed(ids), layer.dequantize()[ids])


def _act_quantized(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(blocks / torch.where(scale > 0, scale, 1)).clamp(-127, 127)
    return (codes * scale).reshape(x.shape)


@pytest.mark.parametrize("kind", TYPES)
def test_kernels_read_the_blocks_directly(kind):
    kmod = build.load_kernels()
    assert kmod is not None, build.build_error()
    layer = packed_linear(kind, 72, 512, seed=1)  # 72 rows: a partial last tile
    (kw,) = projection([layer], "test")
    assert kw.kind == 2 and kw.name == kind.lower()
    lin = kw.to_cpp(kmod)
    x = torch.randn(11, 512) * 2
    got = lin(x)
    want = _act_quantized(x) @ layer.dequantize().t()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    for row in (0, 10):  # batch invariance
        assert torch.equal(got[row], lin(x[row]))
    for r in (0, 17, 71):  # embedding lookups read the same tiles
        torch.testing.assert_close(lin.row(r), layer.dequantize()[r], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kind", TYPES)
def test_kernel_layout_reads_the_files_bytes(kind):
    raw = raw_blocks(kind, 64, 512)
    (kw,) = projection([packed_linear(kind, 64, 512)], "test")
    # Q4_K: 6-bit sub-scales/mins one byte each (148 vs 144 bytes per 256 weights)
    ratio = {"Q4_0": 1.0, "Q4_1": 1.0, "Q8_0": 1.0, "Q4_K": 148 / 144, "Q6_K": 1.0}[kind]
    assert kw.nbytes() == pytest.approx(raw.nbytes * ratio)


# ---------------------------------------------------------------- a mixed-format GGUF file
CFG = ModelConfig(
    name="tiny-kquant",
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=64,
    rope_theta=10000.0,
)
# like llama.cpp's Q4_K_M: K-quants with Q6_K for v/down/output, plus the simple types
KINDS = {
    "token_embd": "Q8_0",
    "output": "Q6_K",
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q4_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
}


def write_gguf(path: Path) -> None:
    cfg = CFG
    writer = gguf.GGUFWriter(str(path), arch="llama")
    add_gguf_llama_header(writer, cfg)
    h, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.kv_size
    shapes = {"token_embd": (cfg.vocab_size, h), "output": (cfg.vocab_size, h)}
    block = {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h)}
    block |= {"ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
    rng = np.random.default_rng(5)
    tensors = {f"{n}.weight": (KINDS[n], s) for n, s in shapes.items()}
    for i in range(cfg.num_layers):
        tensors |= {f"blk.{i}.{n}.weight": (KINDS[n], s) for n, s in block.items()}
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(
                f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
            )
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for seed, (name, (kind, (rows, cols))) in enumerate(tensors.items()):
        raw = raw_blocks(kind, rows, cols, seed)
        writer.add_tensor(name, raw, raw_dtype=Q[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf"
    write_gguf(path)
    return path


def test_auto_dtype_keeps_every_format_and_equals_the_dequantized_model(kquant_gguf):
    packed = load_model(kquant_gguf, dtype="auto")
    dense = load_model(kquant_gguf)  # the default stays float32 (training, quantization)
    attn = packed.layers[1].self_attn
    assert isinstance(packed.embed_tokens, BlockQuantEmbedding)
    formats = {
        "embed": packed.embed_tokens.fmt.name,
        "head": packed.lm_head.fmt.name,
        "q": attn.q_proj.fmt.name,
        "v": attn.v_proj.fmt.name,
        "o": attn.o_proj.fmt.name,
        "gate": packed.layers[0].mlp.gate_proj.fmt.name,
    }
    assert formats == {
        "embed": "q8_0",
        "head": "q6_k",
        "q": "q4_k",
        "v": "q6_k",
        "o": "q4_0",
        "gate": "q4_1",
    }
    for name, module in packed.named_modules():  # Q/K rows un-permuted like the dense load
        if isinstance(module, BlockQuantLinear):
            assert torch.equal(module.dequantize(), dense.get_submodule(name).weight), name
    ids = torch.tensor([[1, 5, 9, 200, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(packed(ids), dense(ids), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="dtype='int4'; pass a torch dtype or 'auto'"):
        load_model(kquant_gguf, dtype="int4")


def test_exports_write_the_packed_models_dequantized_weights(kquant_gguf, tmp_path):
    from llmopt.export.tensors import dense_state_dict

    packed = load_model(kquant_gguf, dtype="auto")
    dense = load_model(kquant_gguf)
    got, want = dense_state_dict(packed), dense_state_dict(dense)
    assert sorted(got) == sorted(want)  # weights by name, no codes or block scales
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_mixed_format_gguf_through_the_fused_kernels(kquant_gguf):
    packed = load_model(kquant_gguf, dtype="auto")
    dense = load_model(kquant_gguf)
    dec = FastDecoder(packed, 40)
    assert dec.kinds == ["q4_0", "q4_1", "q4_k", "q6_k"]
    # q|k (Q4_K) and v (Q6_K) are two segments of one projection, gate (Q4_1) and up (Q4_K) too
    from llmopt.infer.fast.model import compiled

    layout, _ = compiled(packed)
    assert [w.name for w in layout.blocks[0].qkv] == ["q4_k", "q6_k"]
    assert [w.name for w in layout.blocks[0].up] == ["q4_1", "q4_k"]
    ids = [1, 5, 9, 200, 3, 7, 11, 19]
    got = [dec.prefill(ids), dec.step(4), dec.step(8)]
    # the reference: the eager packed model with every linear's input rounded as the kernels
    # round it (int8 per 32 columns); random K-quant codes make a chaotic net, where that
    # rounding alone moves the logits by ~8% of their scale
    for module in packed.modules():
        if isinstance(module, BlockQuantLinear):
            module.register_forward_pre_hook(lambda m, args: (_act_quantized(args[0]),))
    with torch.no_grad():
        want = packed(torch.tensor([ids + [4, 8]]))[0, -3:]
    torch.testing.assert_close(torch.stack(got), want, rtol=0, atol=1e-4)
    # bytes per token: the packed formats, not fp32 (the fp32 model reads ~4.4x more)
    fp32 = FastDecoder(dense, 40).bytes_per_token
    assert dec.bytes_per_token < fp32 / 4


def test_packaged_smollm_auto_is_the_files_bytes():
    packed = load_model("smollm2-135m", dtype="auto")
    assert packed.lm_head.codes is packed.embed_tokens.codes  # tied: one tensor in memory
    per_token = sum(
        m.packed_nbytes() for name, m in packed.named_modules() if isinstance(m, BlockQuantLinear)
    )
    assert 96e6 < per_token < 97e6  # Q4_1 blocks + the Q8_0 head: llama.cpp's ~97 MB
