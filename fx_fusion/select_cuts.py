"""Selects of a projection's view along a middle axis, read as column slices of a coarser view.

`kv.view(T, L, 2, H, D)[:, :, 0]` (or `.unbind(2)`) takes every layer's K from a projection over weights
stacked for all layers: each index along the selected axis is one contiguous block of columns within each
layer's 2 * H * D. The pass reads that layout as the seed's `[total_ctx, n_layers, kv_size*2]`,
`kv.view(T, L, 2 * H * D)` cut into K and V columns, so this rewrites

    select(view(p, S), s, j)  ->  view(slice(view(p, S[:s] + [W]), -1, j * inner, (j + 1) * inner), S[:s] + S[s+1:])

with inner = prod(S[s+1:]) and W = S[s] * inner, when every reader of the view is a select along one axis s
(or an `unbind` along it, read through `getitem`) that leaves at least two dims after it (heads and head
dim); `p` may be reached through reshapes (`linear` of a batch views its product `[B, T, N]` first), or be a
block of the product's columns (`y.chunk(L, -1)[i].view(T, 2, H, D).unbind(1)`: each layer's K and V), whose
slices then nest in the cut that made it. The
same reading serves a packed qkv (`qkv.view(B, T, 3, H, D).unbind(2)`: Q, K and V column slices). A select
next to the last dim (Falcon's per-head `qkv.view(B, T, H, 3, D)[..., 1, :]`) stays as it is: its heads
are read where they are. The product is a row-major `[rows, N]` tensor, so both spellings address the
same elements with the same strides (checked on the fake values before the graph changes): every reader
sees the same values.
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Optional

import torch
import torch.fx

from .kv_patterns import add_call, column_range, erase_unused, is_call, is_product, same_size, val
from .values import RESHAPES

aten = torch.ops.aten
logger = logging.getLogger(__name__)


def _selects(view: torch.fx.Node) -> Optional[tuple[int, list[tuple[torch.fx.Node, int]]]]:
    """(axis, [(node, index)]) when every reader of `view` takes one index along one axis, by `select` or
    by an `unbind` read only through `getitem`, leaving at least two dims after the axis; else None."""
    rank = val(view).dim()
    axes, picks = set(), []
    for user in view.users:
        if is_call(user, aten.select.int) and len(user.args) == 3 and isinstance(user.args[2], int):
            axes.add(user.args[1])
            picks.append((user, user.args[2]))
        elif is_call(user, aten.unbind.int) and all(
            reader.target is operator.getitem and isinstance(reader.args[1], int) for reader in user.users
        ):
            axes.add(user.args[1] if len(user.args) > 1 else 0)
            picks += [(reader, reader.args[1]) for reader in user.users]
        else:
            return None
    axes = {axis % rank if isinstance(axis, int) else None for axis in axes}
    if len(axes) != 1 or None in axes or not 1 <= min(axes) <= rank - 3 or not picks:
        return None
    return axes.pop(), picks


def _rewrite(view: torch.fx.Node, base: torch.fx.Node, axis: int, picks: list) -> bool:
    """Rewrite each pick of `view` as a column slice of `base` (the product or a block of its columns,
    `_columns_of_a_projection`), viewed coarsely (module docstring); whether it did.
    Every new piece is built, and checked to have its pick's shape and strides, before the graph changes."""
    shape = list(val(view).shape)
    tail = shape[axis:]
    if not all(isinstance(size, int) for size in tail) or sum(not isinstance(s, int) for s in shape) > 1:
        return False
    inner = math.prod(tail[1:])
    lead = [size if isinstance(size, int) else -1 for size in shape[:axis]]
    graph, added, pieces = view.graph, [], {}
    try:
        coarse_shape = [*shape[:axis], math.prod(tail)]
        if len(coarse_shape) == val(base).dim() and all(map(same_size, coarse_shape, val(base).shape)):
            coarse = base  # already that shape: its column cuts are read directly
        else:
            with graph.inserting_after(view):
                added.append(add_call(graph, aten.view.default, [base, lead + [math.prod(tail)]]))
            coarse = added[-1]
        for pick, index in picks:
            index %= shape[axis]
            with graph.inserting_before(pick):
                added.append(add_call(graph, aten.slice.Tensor, [coarse, -1, index * inner, (index + 1) * inner]))
                added.append(add_call(graph, aten.view.default, [added[-1], lead + tail[1:]]))
            pieces[pick] = added[-1]
        if any(_layout(val(piece)) != _layout(val(pick)) for pick, piece in pieces.items()):
            raise ValueError("a piece is laid out unlike what it replaces")
    except Exception:
        erase_unused(list(reversed(added)))
        return False
    for pick, piece in pieces.items():
        pick.replace_all_uses_with(piece)
        graph.erase_node(pick)
    for user in list(view.users):  # the unbinds, now unread
        graph.erase_node(user)
    erase_unused([view])
    return True


def _layout(value: torch.Tensor) -> tuple:
    return tuple(value.shape), value.stride(), value.storage_offset()


def _columns_of_a_projection(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """What the coarse view is taken of: the product, when `node` is it seen through reshapes (`linear` of a
    batch views it `[B, T, N]` first); a block of its columns (`y.chunk(L, -1)[i]`, each layer's K and V)
    seen through reshapes, that block. Else None."""
    base = node
    while is_call(base, *RESHAPES):
        base = base.args[0]
    if is_product(base):
        return base
    source = base
    while True:
        while is_call(source, *RESHAPES):
            source = source.args[0]
        cut = column_range(source) if not is_product(source) else None
        if cut is None:
            return base if is_product(source) and base is not source else None
        source = cut[0]


def selects_as_column_slices(graph: torch.fx.Graph) -> int:
    """Rewrite the picks of every projection view that qualifies (module docstring); returns how many views."""
    rewritten = 0
    for view in list(graph.nodes):
        if not is_call(view, *RESHAPES):
            continue
        try:
            base = _columns_of_a_projection(view.args[0])
            found = _selects(view) if base is not None else None
            rewritten += found is not None and _rewrite(view, base, *found)
        except Exception:  # a graph shape this reading did not foresee: leave it as it is
            logger.debug("fx_fusion: %s left as it is", view, exc_info=True)
    return rewritten
