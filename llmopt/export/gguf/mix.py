"""Which ggml type each tensor gets: llama.cpp's per-tensor recipes for its file types.

`llama-quantize` does not store one type everywhere: for a dense model it follows
`llama_tensor_get_type` (src/llama-quant.cpp), which for the file types written here is
- the output head (or the embedding, when the head is tied to it): Q6_K, or Q8_0 where the
  row length is not a multiple of the file type's block; Q8_0 files keep Q8_0;
- Q4_K_M / Q5_K_M: `attn_v` (and a fused `attn_qkv`) and `ffn_down` of the layers
  `more_bits` picks (the first and last eighth, and every third in between) take Q6_K;
- every other matrix the file type's base type, 1-D tensors (norms, biases) F32;
- a matrix whose rows the chosen type's blocks do not tile falls back: Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 where even 32-value blocks do not tile.
"""

from __future__ import annotations

from dataclasses import dataclass

QK_K = 256
BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32}
BLOCK.update({"Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K})
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


@dataclass(frozen=True)
class FileType:
    """One `--gguf-type`: its llama.cpp file type and its base ggml type (None: float)."""

    name: str
    llama_file_type: str
    base: str | None
    mixed: bool = False  # the _M recipes: more bits for attn_v / ffn_down of some layers


FILE_TYPES = {
    t.name: t
    for t in (
        FileType("f32", "ALL_F32", None),
        FileType("f16", "MOSTLY_F16", None),
        FileType("q8_0", "MOSTLY_Q8_0", "Q8_0"),
        FileType("q4_0", "MOSTLY_Q4_0", "Q4_0"),
        FileType("q4_1", "MOSTLY_Q4_1", "Q4_1"),
        FileType("q4_k", "MOSTLY_Q4_K_M", "Q4_K", mixed=True),
        FileType("q5_k", "MOSTLY_Q5_K_M", "Q5_K", mixed=True),
        FileType("q6_k", "MOSTLY_Q6_K", "Q6_K"),
    )
}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth, and every third in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _fallback(kind: str, row: int) -> str:
    if row % BLOCK[kind] == 0:
        return kind
    kind = _FALLBACK.get(kind, kind)
    return kind if row % BLOCK[kind] == 0 else "F16"


def tensor_types(shapes: dict[str, tuple[int, ...]], file_type: str, layers: int) -> dict[str, str]:
    """GGUF name -> ggml type name for every tensor ([out, in] shapes, in file order)."""
    ftype = FILE_TYPES[file_type]
    tied = "output.weight" not in shapes
    counters = {"attn_v": 0, "ffn_down": 0}
    out: dict[str, str] = {}
    for name, shape in shapes.items():
        if len(shape) < 2 or not name.endswith(".weight") or name.endswith("_norm.weight"):
            out[name] = "F32"
            continue
        if ftype.base is None:
            out[name] = "F32" if file_type == "f32" else "F16"
            continue
        kind, row = ftype.base, shape[-1]
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            if ftype.base == "Q8_0" or row % BLOCK[ftype.base]:
                kind = "Q8_0"
            else:
                kind = "Q6_K"
        elif ftype.mixed and (".attn_v." in name or ".attn_qkv." in name):
            if more_bits(counters["attn_v"], layers):
                kind = "Q6_K"
            counters["attn_v"] += 1
        elif ftype.mixed and ".ffn_down." in name:
            if more_bits(counters["ffn_down"], layers):
                kind = "Q6_K"
            counters["ffn_down"] += 1
        out[name] = _fallback(kind, row)
    return out
