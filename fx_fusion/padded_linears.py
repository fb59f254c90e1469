"""Linears that Inductor padded to aligned shapes, read as the linears they compute.

Inductor's shape padding (`torch._inductor.fx_passes.pad_mm`) may rewrite `x @ W.T + b` as

    addmm(cat([b, zeros]), constant_pad_nd(x, [0, pk, 0, pm]), constant_pad_nd(W.T, [0, pn, 0, pk]))[:-pm, :-pn]

padding the tokens (rows of x), the hidden size and the output columns with zeros up to an aligned size
(`mm` alike, and `mm + b` once the bias add is split off). On CUDA it chooses by timing both forms and
keeps the choice in its on-disk cache, so one compile of a model may pad a projection where another does
not. The padding adds only zero terms to each sum and rows and columns that the cuts drop again, so the
cut product holds the values of the unpadded linear: the pass reads it as a linear of `x`, `W` and `b`,
and once the cut's readers are rewritten the padded product is dead code (`kv_patterns.erase_unused`).
Where a linear must run per piece of its rows (token_cats), `read_plain` puts the plain linear in its place.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import kv_patterns  # (a module reference: kv_patterns imports this module while it loads)

aten = torch.ops.aten


@dataclasses.dataclass
class PaddedLinear:
    cut: torch.fx.Node  # the last slice: the linear's output [tokens, out_features]
    product: torch.fx.Node  # the padded mm / addmm / mm + bias add
    x2d: torch.fx.Node  # [tokens, hidden], unpadded
    rhs: torch.fx.Node  # [hidden, out_features], unpadded (W.T)
    bias: Optional[torch.fx.Node]  # [out_features], unpadded, or None
    inner: tuple  # the nodes below the cut, down to the product


def _shape(node: torch.fx.Node) -> Optional[list]:
    """The static shape, or None (Inductor pads static sizes only; a symbolic one is never padded)."""
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or not all(isinstance(s, int) for s in value.shape):
        return None
    return list(value.shape)


def _end_padded(node) -> Optional[torch.fx.Node]:
    """t when node = constant_pad_nd(t, pad) with zeros appended (never prepended) on each dim, else None."""
    if not kv_patterns.is_call(node, aten.constant_pad_nd.default):
        return None
    pad = list(node.args[1])
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if value != 0 or any(not isinstance(p, int) for p in pad) or any(pad[0::2]) or min(pad, default=0) < 0:
        return None
    return node.args[0]


def _zeros(node) -> bool:
    return kv_patterns.is_call(node, aten.full.default) and node.args[1] == 0


def _unpadded_bias(node) -> Optional[torch.fx.Node]:
    """b when node = cat([b, zeros]) along its only dim (or b zero-padded at its end), else None."""
    padded = _end_padded(node)
    if padded is not None:
        return padded
    if not kv_patterns.is_call(node, aten.cat.default) or len(node.args[0]) != 2:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    first, rest = node.args[0]
    return first if dim in (0, -1) and _zeros(rest) and len(_shape(node) or []) == 1 else None


def padded_linear(node: torch.fx.Node) -> Optional[PaddedLinear]:
    """The linear that `node` cuts out of a zero-padded product, or None (module docstring)."""
    cut, inner = node, []
    while kv_patterns.is_call(node, aten.slice.Tensor) and len(inner) < 2:
        _, start, _, step = kv_patterns.slice_args(node)
        if start != 0 or step != 1 or (inner and len(node.users) != 1):
            return None
        inner.append(node)
        node = node.args[0]
    if not inner or len(node.users) != 1:
        return None
    product, bias = node, None
    if kv_patterns.is_call(node, aten.add.Tensor) and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        product = next((a for a in node.args if kv_patterns.is_call(a, aten.mm.default)), None)
        if product is None or len(product.users) != 1:
            return None
        bias = node.args[1] if node.args[0] is product else node.args[0]
        x_padded, rhs_padded = product.args[:2]
        inner.append(node)
    elif kv_patterns.is_call(node, aten.addmm.default) and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1:
        bias, x_padded, rhs_padded = node.args[:3]
    elif kv_patterns.is_call(node, aten.mm.default):
        x_padded, rhs_padded = node.args[:2]
    else:
        return None
    inner.append(product)
    x2d, rhs = _end_padded(x_padded) or x_padded, _end_padded(rhs_padded) or rhs_padded
    if bias is not None:
        bias = _unpadded_bias(bias) or bias
    if x2d is x_padded and rhs is rhs_padded:
        return None  # nothing padded: a plain linear, cut by its user
    x_shape, rhs_shape, padded_shape = _shape(x2d), _shape(rhs), _shape(product)
    if x_shape is None or rhs_shape is None or padded_shape is None or len(x_shape) != 2 or len(rhs_shape) != 2:
        return None
    if x_shape[1] != rhs_shape[0] or _shape(cut) != [x_shape[0], rhs_shape[1]]:
        return None  # the cuts keep other rows or columns than the unpadded product's
    if bias is not None and _shape(bias) != [rhs_shape[1]]:
        return None
    return PaddedLinear(cut, product, x2d, rhs, bias, tuple(inner[1:]))


def read_plain(graph: torch.fx.Graph, linear: PaddedLinear) -> None:
    """Replace the cut's uses with the plain linear it computes (the same values: an mm, an addmm, or an mm
    and the bias added after it, as the product had it); the padded product is left to dead-code removal."""
    x2d, rhs, bias = linear.x2d, linear.rhs, linear.bias
    with graph.inserting_before(linear.cut):
        if bias is None:
            plain = kv_patterns.add_call(graph, aten.mm.default, [x2d, rhs])
        elif kv_patterns.is_call(linear.product, aten.addmm.default):
            plain = kv_patterns.add_call(graph, aten.addmm.default, [bias, x2d, rhs])
        else:  # rounded as the graph rounds it: the product, then the bias
            plain = kv_patterns.add_call(graph, aten.add.Tensor, [kv_patterns.add_call(graph, aten.mm.default, [x2d, rhs]), bias])
    linear.cut.replace_all_uses_with(plain)
