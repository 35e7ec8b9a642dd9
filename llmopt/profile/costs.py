"""FLOPs and bytes moved of one profiled operator call, from its recorded shapes and dtypes.

The profiler records what each ATen call received, not what it cost; a roofline needs both the
work (FLOPs) and the traffic (bytes), so this module derives them for the operators that carry
a decoder's time: matrix products, attention, and elementwise/normalisation kernels. Anything
else is "unknown" (None), never guessed. Bytes count each input read once and the output written
once (the ideal traffic a roofline assumes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# bytes per element of the dtype names torch.profiler records
DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}

# one FLOP per output element, output the shape of the (broadcast) inputs
ELEMENTWISE = {
    "aten::add", "aten::add_", "aten::sub", "aten::mul", "aten::mul_", "aten::div", "aten::div_",
    "aten::neg", "aten::silu", "aten::silu_", "aten::gelu", "aten::exp", "aten::rsqrt",
    "aten::pow", "aten::sigmoid", "aten::tanh", "aten::cos", "aten::sin", "aten::copy_",
    "aten::mean", "aten::sum", "aten::softmax", "aten::_softmax", "aten::log_softmax",
    "aten::_log_softmax", "aten::argmax", "aten::index_select", "aten::cat",
}  # fmt: skip
# views and allocations: no data work at all
METADATA = {
    "aten::as_strided", "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::transpose",
    "aten::t", "aten::expand", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
    "aten::permute", "aten::resolve_conj", "aten::resolve_neg", "aten::empty", "aten::empty_like",
    "aten::empty_strided", "aten::alias", "aten::detach", "aten::detach_", "aten::lift_fresh",
    "aten::result_type", "aten::to", "aten::contiguous", "aten::flatten", "aten::split",
    "aten::chunk", "aten::narrow", "aten::unbind", "aten::broadcast_tensors", "aten::size",
}  # fmt: skip
SDPA_PREFIX = "aten::_scaled_dot_product"


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


def _tensors(shapes, dtypes) -> list[tuple[list[int], int]]:
    """(shape, element bytes) of the tensor arguments (scalars and lists carry no shape)."""
    out = []
    for shape, dtype in zip(shapes, dtypes):
        if isinstance(shape, list) and shape and dtype in DTYPE_BYTES:
            out.append((list(shape), DTYPE_BYTES[dtype]))
    return out


def _broadcast(shapes: list[list[int]]) -> list[int]:
    ndim = max(len(s) for s in shapes)
    padded = [[1] * (ndim - len(s)) + s for s in shapes]
    return [max(dims) for dims in zip(*padded)]


def op_cost(name: str, shapes, dtypes) -> tuple[int | None, int | None]:
    """(FLOPs, bytes) of one call of ATen operator `name`, None where not derivable."""
    if name in METADATA:
        return 0, 0
    args = _tensors(shapes, dtypes)
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm") and len(args) >= 2:
        (a, ea), (b, eb) = args[-2], args[-1]
        batch = a[0] if len(a) == 3 else 1
        m, k, n = a[-2], a[-1], b[-1]
        out_bytes = batch * m * n * ea
        bias = sum(_numel(s) * e for s, e in args[:-2])
        return 2 * batch * m * k * n, _numel(a) * ea + _numel(b) * eb + out_bytes + bias
    if name.startswith(SDPA_PREFIX) and len(args) >= 3:
        (q, eq), (k, ek), (v, ev) = args[:3]
        *batch, tq, d = q
        tk = k[-2]
        heads = _numel(batch)
        flops = 4 * heads * tq * tk * d  # QK^T and PV
        moved = _numel(q) * eq + _numel(k) * ek + _numel(v) * ev + _numel(q[:-1] + [v[-1]]) * eq
        return flops, moved
    if name in ELEMENTWISE and args:
        if name in ("aten::mean", "aten::sum", "aten::argmax"):
            (shape, elem) = args[0]
            return _numel(shape), _numel(shape) * elem  # output is small next to the input
        if name == "aten::copy_":
            (src, elem) = args[-1]
            return 0, 2 * _numel(src) * elem
        if name == "aten::cat":
            return 0, 2 * sum(_numel(s) * e for s, e in args)
        if name == "aten::index_select":
            (table, elem), (index, _) = args[0], args[-1]
            row = _numel(table[1:])
            return 0, 2 * _numel(index) * row * elem
        out = _broadcast([s for s, _ in args])
        elem = max(e for _, e in args)
        return _numel(out), sum(_numel(s) * e for s, e in args) + _numel(out) * elem
    return None, None


def is_metadata(name: str) -> bool:
    """True for views/allocations: calls that launch no compute kernel."""
    return name in METADATA
