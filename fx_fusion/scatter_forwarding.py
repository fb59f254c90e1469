"""Undo what functionalisation makes of in-place updates to column views, so K branches read as chains again.

Code that updates a view in place (nano-vllm's RMSNorm: `x.mul_(rsqrt(...))` on `k`, a column view of
the qkv output, when `x.float()` is a no-op in float32) reaches the post-grad graph functionalised: each
update is a `slice_scatter` of the new columns into the whole output, and later reads of any columns are
cuts of that scatter. Exact identities turn these back into plain chains:

- a cut of `slice_scatter(base, src, dim, start, end)` along `dim` over exactly [start, end) is `src`;
  over columns outside it, the same cut of `base`;
- a chain of `select_scatter`s that writes every index of one dim exactly once (`out = torch.empty_like(k)`,
  then `out[i] = norm_i(k[i])` for every layer i) is those values stacked along that dim, whatever the
  base held: `cat(values).view(out.shape)` along the first dim, else a cat of them unsqueezed there;
- `reshape(reshape(x, a), b)` whose result has x's own shape is x (a reshape round trip), and the same
  reshape of the same tensor spelled twice is one node (the views functionalisation regenerates); so is
  the same dtype cast of the same tensor (`x.float() * rsqrt(x.float().pow(2).mean(...))`: one upcast).

Only equal values are substituted, so the graph computes the same as before whether or not a group is
fused afterwards; what is left without readers is erased (a dead-code pass over the graph once a scatter
was bypassed: functionalisation leaves more of them than the bypassed nodes lead back to).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx

from .kv_patterns import add_call, erase_unused, is_call, same_size, static_shape, val
from .values import RESHAPES

aten = torch.ops.aten
prims = torch.ops.prims


def _same_shape(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Shapes equal at every size the graph may run with."""
    shapes = [list(val(n).shape) for n in (a, b)]
    return len(shapes[0]) == len(shapes[1]) and all(same_size(x, y) for x, y in zip(*shapes))


def _static_length(source, dim) -> bool:
    """Whether `source`'s dim `dim` has a fixed length: cuts and scatters are compared by their bounds, which
    along a symbolic dim would hold for the example size only."""
    return isinstance(val(source), torch.Tensor) and isinstance(dim, int) and isinstance(val(source).shape[dim], int)


def _cut(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, int, int, int]]:
    """(source, dim, start, end) when `node` is a step-1 slice or a split piece of `source`."""
    if is_call(node, aten.slice.Tensor):
        source = node.args[0]
        args = list(node.args[1:]) + [None] * (4 - len(node.args[1:]))
        dim, start, end, step = (args[0] or 0), (args[1] or 0), args[2], (args[3] or 1)
    elif node.target is operator.getitem and is_call(node.args[0], aten.split.Tensor, aten.split_with_sizes.default):
        split, index = node.args
        source = split.args[0]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        sizes = split.args[1]
        if not isinstance(index, int) or not isinstance(dim, int):
            return None
        length = static_shape(source)[dim]
        if isinstance(sizes, int):
            sizes = [sizes] * (-(-length // sizes))
        if not isinstance(sizes, (list, tuple)) or not all(isinstance(size, int) for size in sizes):
            return None  # symbolic split sizes (a node, or nodes in the list)
        start, step = sum(sizes[:index]), 1
        end = start + sizes[index]
    else:
        return None
    if not all(isinstance(v, int) for v in (dim, start, step)) or step != 1 or not _static_length(source, dim):
        return None
    rank, length = val(source).dim(), static_shape(source)[dim]
    end = length if end is None or not isinstance(end, int) or end > length else end
    return source, dim % rank, start, min(end, length)


def _scattered(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node, int, int, int]]:
    """(base, src, dim, start, end) of a step-1 `slice_scatter`."""
    if not is_call(node, aten.slice_scatter.default):
        return None
    args = list(node.args) + [None] * (6 - len(node.args))
    base, src, dim, start, end, step = args[:6]
    dim, start, step = dim or 0, start or 0, step or 1
    if not all(isinstance(v, int) for v in (dim, start, step)) or step != 1 or not _static_length(base, dim):
        return None
    length = static_shape(base)[dim]
    end = length if not isinstance(end, int) or end > length else end
    return base, src, dim % val(base).dim(), start, end


def _stacked(graph: torch.fx.Graph, node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The values a chain of `select_scatter`s ending at `node` writes, stacked, when they fill every index
    of the dim once (the base's own values are then all overwritten); else None."""
    written: dict[int, torch.fx.Node] = {}
    current, dim = node, None
    while is_call(current, aten.select_scatter.default) and len(current.args) == 4:
        base, src, at, index = current.args
        if not all(isinstance(n, torch.fx.Node) and isinstance(val(n), torch.Tensor) for n in (base, src)):
            return None
        rank = val(base).dim()
        if not isinstance(at, int) or not isinstance(index, int) or (dim is not None and at % rank != dim):
            return None
        dim = at % rank
        length = val(base).shape[dim]
        value = src.args[1] if is_call(src, aten.copy.default) else None
        if isinstance(value, torch.fx.Node) and isinstance(val(value), torch.Tensor) and _same_shape(src, value) and val(src).dtype == val(value).dtype:
            src = value  # `copy(out[i], value)` before decompositions: the value itself
        if not isinstance(length, int) or index % length in written or val(src).dtype != val(base).dtype:
            return None
        written[index % length] = src
        current = base
    if dim is None or sorted(written) != list(range(val(node).shape[dim])):
        return None
    values = [written[i] for i in range(len(written))]
    shape = [size if isinstance(size, int) else -1 for size in val(node).shape]  # one symbolic size: -1
    if shape.count(-1) > 1:
        return None
    added: list[torch.fx.Node] = []

    def add(target, args) -> torch.fx.Node:
        added.append(add_call(graph, target, args))
        return added[-1]

    try:
        with graph.inserting_before(node):
            if dim == 0:
                return add(aten.reshape.default, [add(aten.cat.default, [values, 0]), shape])
            return add(aten.cat.default, [[add(aten.unsqueeze.default, [v, dim]) for v in values], dim])
    except Exception:  # a value the fake ops cannot join: leave the scatters as they are
        erase_unused(added)
        return None


def forward_scattered_views(graph: torch.fx.Graph, rounds: int = 8) -> int:
    """Apply the module docstring's identities until none applies (one may uncover another: a reshape
    round trip can reveal that a cut reads a scatter); returns how many nodes were replaced."""
    bypassed: list[torch.fx.Node] = []
    for _ in range(rounds):
        replaced = _forward_once(graph)
        bypassed += replaced
        if not replaced:
            break
    if any(_cut(node) is not None or is_call(node, aten.select_scatter.default) for node in bypassed):
        graph.eliminate_dead_code()
    else:  # only repeated reshapes and reshape round trips
        erase_unused(bypassed)
    return len(bypassed)


def _respelling_key(node: torch.fx.Node) -> Optional[tuple]:
    """What makes two reshapes or dtype casts the same value: the op, its input and its arguments."""
    if is_call(node, *RESHAPES) and isinstance(node.args[1], (list, tuple)):
        return (node.target, node.args[0], tuple(node.args[1]))
    if is_call(node, prims.convert_element_type.default) and not node.kwargs:
        return (node.target, *node.args)
    return None


def _forward_once(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    replaced, respelled = [], {}
    for node in list(graph.nodes):
        if not node.users:  # already bypassed (dead code until the caller removes it)
            continue
        key = _respelling_key(node)
        if key is not None:
            first = respelled.setdefault(key, node)
            if first is not node:  # the same reshape or cast of the same tensor, spelled again: one node
                node.replace_all_uses_with(first)
                replaced.append(node)
                continue
        cut = _cut(node)
        replacement = None
        while cut is not None and _scattered(cut[0]) is not None:
            source, dim, start, end = cut
            base, src, scatter_dim, scatter_start, scatter_end = _scattered(source)
            if dim != scatter_dim:
                break
            if (start, end) == (scatter_start, scatter_end) and _same_shape(src, node):
                replacement = src
                break
            if end <= scatter_start or start >= scatter_end:  # untouched columns: the same cut of base
                with graph.inserting_before(node):
                    replacement = graph.call_function(aten.slice.Tensor, (base, dim, start, end))
                replacement.meta["val"] = node.meta["val"]
                cut = (base, dim, start, end)
                continue
            break
        if replacement is None and is_call(node, aten.select_scatter.default):
            replacement = _stacked(graph, node)
        if replacement is None and is_call(node, *RESHAPES) and is_call(node.args[0], *RESHAPES):
            inner = node.args[0].args[0]
            if isinstance(val(inner), torch.Tensor) and _same_shape(inner, node):
                replacement = inner
        if replacement is not None:
            node.replace_all_uses_with(replacement)
            replaced.append(node)
    return replaced
