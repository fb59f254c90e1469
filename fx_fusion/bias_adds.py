"""A linear's bias added after its product is reshaped, moved back onto the product.

`F.linear` of an input that cannot be viewed as rows (a batch broadcast by `expand`, a transposed hidden
state) reaches the post-grad graph as `mm(clone(x).view(-1, H), W.T).view(B, T, N) + b`: the bias is added
after the reshape instead of by `addmm`. The pass reads a projection as `mm`/`addmm`/`mm + b`, so such a K
branch would start at a bias-less product and its bias add would look like the start of something else.
This rewrites

    add(reshape(mm, [..., N]), b)   ->   reshape(add(mm, b), [..., N])

where `b` is a one-dimensional parameter of N values, the reshape keeps the last dim N (so `b` meets the
same column either way) and nothing else reads the product or its reshape. Each element gets the same
single addition of the same two values, so the result is identical.
"""

from __future__ import annotations

import torch
import torch.fx

from .kv_patterns import is_call, is_parameter_rows, static_shape
from .values import RESHAPES

aten = torch.ops.aten


def _bias_after_reshape(add: torch.fx.Node):
    """(reshape, mm, bias) when `add` adds a per-column bias parameter to a reshape of a product, else None."""
    if not is_call(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    for reshaped, bias in (add.args, add.args[::-1]):
        if not is_call(reshaped, *RESHAPES) or not is_call(reshaped.args[0], aten.mm.default):
            continue
        mm = reshaped.args[0]
        if len(mm.users) != 1 or len(reshaped.users) != 1 or not is_parameter_rows(bias):
            continue
        width = static_shape(mm)[-1]
        if static_shape(bias) == [width] and static_shape(reshaped)[-1] == width and bias.meta["val"].dtype == mm.meta["val"].dtype:
            return reshaped, mm, bias
    return None


def move_bias_adds_to_products(graph: torch.fx.Graph) -> int:
    """Rewrite every such add (module docstring); returns how many."""
    moved = 0
    for add in list(graph.find_nodes(op="call_function", target=aten.add.Tensor)):
        found = _bias_after_reshape(add)
        if found is None:
            continue
        reshaped, mm, bias = found
        with graph.inserting_after(mm):
            biased = graph.call_function(aten.add.Tensor, (mm, bias))
        biased.meta.update({key: value for key, value in mm.meta.items() if key != "val"})  # the linear's place
        biased.meta["val"] = torch.ops.aten.add.Tensor(mm.meta["val"], bias.meta["val"])
        reshaped.replace_input_with(mm, biased)  # same shape, dtype and strides: its value meta stands
        add.replace_all_uses_with(reshaped)
        graph.erase_node(add)
        moved += 1
    return moved
