"""Which linears a quantization touches, and swapping them for packed layers.

Names come from the model's `ModelSpec`: block linears are the spec's `block_linears`
(dotted, relative to a block), narrowed by `QuantConfig.modules`, whose entries may be a full
block-relative name or its last component.
"""

from __future__ import annotations

from torch import nn

from llmopt.errors import UsageError
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.quant.format import PackedWeight
from llmopt.models.packed.quant.linear import QuantLinear
from llmopt.models.spec import ModelSpec


def selected_names(spec: ModelSpec, config: QuantConfig) -> tuple[str, ...]:
    """The spec's block linears that `config.modules` selects (all of them when empty)."""
    if not config.modules:
        return spec.block_linears
    chosen = tuple(
        name
        for name in spec.block_linears
        if name in config.modules or name.rsplit(".", 1)[-1] in config.modules
    )
    known = set(spec.block_linears) | {n.rsplit(".", 1)[-1] for n in spec.block_linears}
    unknown = sorted(set(config.modules) - known)
    if unknown:
        raise UsageError(
            f"modules={unknown} are not linears of a {spec.architecture} block; valid: "
            f"{', '.join(spec.block_linears)}"
        )
    return chosen


def block_linears(block: nn.Module, spec: ModelSpec, config: QuantConfig) -> dict[str, nn.Linear]:
    """The block's selected linear layers by block-relative dotted name, in spec order."""
    return {
        name: module
        for name, module in spec.named_block_modules(block, selected_names(spec, config))
        if isinstance(module, nn.Linear)
    }


def set_submodule(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent_name, _, attr = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, module)


def replace_with_packed(
    root: nn.Module, name: str, packed: PackedWeight, config: QuantConfig
) -> QuantLinear:
    linear = root.get_submodule(name)
    qlinear = QuantLinear.from_packed(packed, bias=linear.bias, backend=config.backend)
    set_submodule(root, name, qlinear)
    return qlinear
