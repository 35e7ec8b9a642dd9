"""`FusedModel`: one engine step of a model as one C++ call over the paged KV cache.

A step is vLLM's flattened batch: N tokens of S sequences (decode tokens, chunked-prefill
chunks, speculative verify runs) with per-token positions and cache slots, per-sequence token
offsets (`query_start`), lengths (`seq_lens`) and block tables, and the rows that need logits.
The cache is two tensors k, v [layers, num_blocks * block_size, kv_heads, head_dim] (fp32,
or bf16/fp16: half the bytes, rounded when stored; the math stays fp32), the same the eager
paged-attention backend reads and writes, so both paths serve one cache.

The kernel layout is derived once per model (`layout.fused_layout`) and rebuilt if any
parameter or buffer is replaced or edited in place; a FusedModel is cheap to create.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from llmopt.errors import LlmoptError, UsageError
from llmopt.infer.fast.build import build_error, load_kernels
from llmopt.infer.fast.layout import FusedLayout, fused_layout


class KernelsUnavailableError(LlmoptError, RuntimeError):
    """The C++ kernels could not be built on this machine."""


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernels read/write
_STEP_FIELDS = (
    "tokens",
    "positions",
    "slots",
    "query_start",
    "seq_lens",
    "block_tables",
    "logits_rows",
)


def _fingerprint(model: nn.Module) -> tuple:
    tensors = list(model.parameters()) + list(model.buffers())
    return tuple((t.data_ptr(), t.dtype, t._version) for t in tensors)


def compiled(model: nn.Module, int8_head: bool = False) -> tuple[FusedLayout, Any]:
    """(layout, C++ model) for `model`, cached while its tensors are unchanged."""
    kmod = load_kernels()
    if kmod is None:
        raise KernelsUnavailableError(f"fused CPU kernels unavailable: {build_error()}")
    key = (_fingerprint(model), int8_head)
    cached = _COMPILED.get(model, {}).get(int8_head)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    layout = fused_layout(model, int8_head=int8_head)
    shape = kmod.ModelShape()
    for name, value in layout.shape.items():
        setattr(shape, name, value)
    layers = []
    for src in layout.blocks:
        layer = kmod.Layer()
        layer.norms = src.norms
        if src.q_norm is not None:
            layer.q_norm, layer.k_norm = src.q_norm, src.k_norm
        layer.qkv = [w.to_cpp(kmod) for w in src.qkv]
        layer.o = [w.to_cpp(kmod) for w in src.o]
        layer.up = [w.to_cpp(kmod) for w in src.up]
        layer.down = [w.to_cpp(kmod) for w in src.down]
        layer.window = src.window
        layers.append(layer)
    head = [w.to_cpp(kmod) for w in layout.head]
    embed = head[0] if layout.embed is layout.head[0] else layout.embed.to_cpp(kmod)
    cpp = kmod.Model(shape, embed, layers, layout.final_norm, head, layout.cos, layout.sin)
    _COMPILED.setdefault(model, {})[int8_head] = (key, layout, cpp)
    return layout, cpp


def _as(t: Any, dtype: torch.dtype) -> torch.Tensor:
    t = torch.as_tensor(t)
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


class FusedModel:
    """All layers of `model` for one engine step in one C++ call (see the module docstring).

    `threads`: intra-op threads for each call (None: torch's current setting). `int8_head`
    reads the head as per-row INT8 codes (4x fewer bytes than fp32, not exact); a head that
    is already coded (a GGUF's Q8_0/Q4 head) is read as it is either way.
    """

    def __init__(self, model: nn.Module, threads: int | None = None, int8_head: bool = False):
        param = next(model.parameters(), None)
        if param is None or param.device.type != "cpu":
            raise UsageError("the fused kernels run on CPU; move the model to CPU first")
        if threads is not None and threads < 1:
            raise UsageError(f"threads={threads} must be >= 1 (or None for torch's setting)")
        self.model = model
        self.threads = threads
        self.int8_head = int8_head
        self.layout, self._cpp = compiled(model, int8_head)
        self.bytes_per_token = self.layout.nbytes_per_token()
        self.kinds = self.layout.kinds

    def refresh(self) -> None:
        """Re-derive the layout if the model's tensors changed since the last call."""
        self.layout, self._cpp = compiled(self.model, self.int8_head)

    def kv_shape(self, rows: int) -> tuple[int, int, int, int]:
        """Shape of a k (or v) cache with `rows` = num_blocks * block_size rows."""
        s = self.layout.shape
        return (len(self.layout.blocks), rows, s["kv_heads"], s["head_dim"])

    def forward(
        self,
        step: Any,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_size: int | None = None,
    ) -> torch.Tensor:
        """Logits [len(step.logits_rows), vocab] (fp32) of one step; `step` carries the
        metadata tensors (`StepBatch` or any object with the same attributes; `block_size`
        defaults to `step.block_size`)."""
        if block_size is None:
            block_size = step.block_size
        return self.forward_tensors(
            *(getattr(step, name) for name in _STEP_FIELDS), k_cache, v_cache, block_size
        )

    def forward_tensors(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        logits_rows: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_size: int,
        *,
        parents: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        inputs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` with the metadata as plain tensors: tokens, positions, slots [N];
        query_start [S + 1]; seq_lens [S]; block_tables [S, max_blocks]; logits_rows [R].

        `parents` [N] makes the step a tree (speculative draft trees): each token's parent
        is an earlier token of its sequence (or -1: the last cached token), its position its
        parent's + 1, and it attends to the cached keys plus its own ancestors'; the i-th
        token of a sequence is stored at row seq_len - n + i of its block table (n: its
        tokens in the step). `hidden` [R, hidden] (fp32) receives the final-norm hidden state
        of each logits row (what a feature draft head reads). `inputs` [N, hidden] replaces
        the embedding lookup (a draft head's fused inputs)."""
        long = torch.long
        return self._cpp.forward(
            _as(tokens, long),
            _as(positions, long),
            _as(slots, long),
            _as(query_start, long),
            _as(seq_lens, long),
            _as(block_tables, torch.int32),
            _as(logits_rows, long),
            k_cache,
            v_cache,
            int(block_size),
            self.threads or 0,
            None if parents is None else _as(parents, long),
            hidden,
            None if inputs is None else _as(inputs, torch.float32),
        )


class FusedRunner:
    """The serving engine's runner over a `PagedKVCache`: `forward(batch: StepBatch)` returns
    fp32 logits [len(batch.logits_rows), vocab] and writes every token's keys/values at
    `batch.slots` into `cache.k` / `cache.v` (the tensors the eager backend uses too)."""

    name = "fused"

    def __init__(
        self, model: nn.Module, cache: Any, threads: int | None = None, int8_head: bool = False
    ) -> None:
        self.fused = FusedModel(model, threads=threads, int8_head=int8_head)
        for what in ("k", "v"):
            t = getattr(cache, what)
            if t.dtype not in CACHE_DTYPES or t.device.type != "cpu" or not t.is_contiguous():
                raise UsageError(
                    f"the fused runner needs a contiguous float32/bfloat16/float16 CPU cache; "
                    f"cache.{what} is {t.dtype} on {t.device}"
                )
        expect = self.fused.kv_shape(cache.k.shape[1])
        if tuple(cache.k.shape) != expect or cache.v.shape != cache.k.shape:
            raise UsageError(f"cache shape {tuple(cache.k.shape)} does not fit the model {expect}")
        self.cache = cache

    def forward(self, batch: Any) -> torch.Tensor:
        return self.fused.forward(batch, self.cache.k, self.cache.v)
