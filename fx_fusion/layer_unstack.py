"""Read a norm applied to every layer's K at once, over a layer-major stack of a projection, as one norm per layer.

A projection over all layers' weights can be cut so that one tensor holds every layer's K, layers first:
`linear(x, W_all).view(T, L, 2, H, D).permute(2, 1, 0, 3, 4)[0]` is `[L, T, H, D]`. Code that then
normalises all layers in one expression, with the layers' norm weights stacked `[L, 1, 1, D]`,

    k_normed = k * rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * weights

leaves no tensor that is one layer's K, so no K branch starts anywhere. Every op of such a chain works on
each layer's rows alone: pointwise ops whose other operands are the same for every layer or hold one slice
per layer along the first dim, and reductions over later dims that keep them. So the chain computed on
layer i's slice, with each operand's slice i, is exactly slice i of the chain's result, and the result is
those L values stacked (`cat(values).view(result.shape)`, as the graph spells `torch.stack`). That is what
`unstack_layer_chains` writes, the per-layer chains reading `k[i]`; the K branches then start at `k[i]`, as
they do where a model norms each layer's K with its own module and stacks the results.

A chain qualifies when it starts at a select (or a one-wide slice or split piece, squeezed) along a
non-last dim of a (view of a) projection whose first dim is layers (each of its slices holds every token,
`_slice_width`), keeps the layers on its first dim, contains a reduction (so it is norm-like, not a cast
or a scale), and only its last node is read outside it. A per-head norm over one layer's heads laid out
first (`kv.view(T, 2, H, D).permute(1, 2, 0, 3)[0]`) passes those tests too, and is better fused as one
layer of H heads; so the chain must also tell layers from heads: it reads an operand with one slice per
layer (the stacked weights), or each slice holds more than one reduced row per token (a layer's several
heads; one weight shared by every layer, or none), or its result is read only with the slices merged into
rows (`[L * T, ...]`: no heads of one token). Where both readings fit (one row per token and slice, one
weight for all, the slices kept apart) the chain stays whole: read as heads, it fuses as one layer.
Anything else, or anything the fake tensors refuse, is left as it is.
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Optional

import torch
import torch.fx

from torch._subclasses.fake_tensor import unset_fake_temporarily

from .kv_patterns import (
    add_call,
    depends_on,
    erase_unused,
    is_call,
    is_product,
    replay,
    same_size,
    static_shape,
    val,
)
from .probe_sizes import FULL_SIZE, ProbeMismatch, ProbeSizes
from .values import LAYOUT_OPS, RESHAPES

aten = torch.ops.aten
logger = logging.getLogger(__name__)

_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default)
_MAX_LAYERS = 64  # a chain is replayed once per layer
_MAX_FULL_REPLAY = 1 << 22  # elements of a projection replayed at full size when a few tokens do not do


def _pointwise(node: torch.fx.Node) -> bool:
    """An elementwise op: tagged pointwise, or a dtype cast spelled `_to_copy` (before decompositions)."""
    target = node.target
    if is_call(node, aten._to_copy.default):
        return set(node.kwargs) <= {"dtype"}
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _cut(node: torch.fx.Node) -> Optional[tuple[int, list[torch.fx.Node]]]:
    """(dim, the cut's nodes in graph order) when `node` takes one index along a non-last dim and drops it:
    a select, or a one-wide piece of a slice or split squeezed (`kv.chunk(2, 0)[0].squeeze(0)`)."""
    if is_call(node, aten.select.int) and len(node.args) == 3 and isinstance(node.args[2], int):
        dim, nodes = node.args[1], [node]
    elif is_call(node, aten.squeeze.dim) and isinstance(node.args[1], int) and static_shape(node.args[0])[node.args[1]] == 1:
        dim, piece, nodes = node.args[1], node.args[0], [node.args[0], node]
        if piece.target is operator.getitem and is_call(piece.args[0], aten.split.Tensor, aten.split_with_sizes.default):
            split = piece.args[0]
            if (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % val(split.args[0]).dim() != dim % val(node.args[0]).dim():
                return None
            nodes = [split, *nodes]
        elif not is_call(piece, aten.slice.Tensor) or piece.args[1] % val(piece).dim() != dim % val(piece).dim():
            return None
    else:
        return None
    source = nodes[0].args[0]
    if not isinstance(dim, int) or dim % val(source).dim() == val(source).dim() - 1:
        return None
    return dim, nodes


def _slice_width(node: torch.fx.Node) -> int:
    """If `node` cuts one index along a non-last dim (`_cut`) of a projection's output seen through views,
    whose first dim runs along the projection's columns, each of its slices holding every token (so the
    first dim is layers, not tokens or a batch): how many elements one slice holds per token. Else 0.
    Proven by replaying the views and the cut on an index of the projection's elements, over a few tokens
    (`probe_sizes`)."""
    cut = _cut(node)
    if cut is None:
        return 0
    chain, source = list(reversed(cut[1])), cut[1][0].args[0]
    while is_call(source, *LAYOUT_OPS):
        chain.append(source)
        source = source.args[0]
    if not is_product(source) or val(source).dim() != 2:
        return 0
    rows, columns = static_shape(source)
    dims = {n for view in chain if isinstance(val(view), torch.Tensor) for n in static_shape(view)[:-1]}
    sizes = ProbeSizes([rows] + [n for n in dims if n > 1 and rows % n == 0])

    def simulate(sizes: ProbeSizes) -> int:
        index = torch.arange(sizes(rows) * columns).view(sizes(rows), columns)
        value = replay(list(reversed(chain)), index, sizes)
        tokens = torch.div(value, columns, rounding_mode="floor")
        if value.dim() < 2 or not bool((tokens == tokens[:1]).all()) or bool((value == value[:1]).all()):
            return 0
        return value[0].numel() // tokens[0].unique().numel()

    with unset_fake_temporarily():
        try:
            return simulate(sizes)
        except ProbeMismatch:
            return simulate(FULL_SIZE) if rows * columns <= _MAX_FULL_REPLAY else 0


def _row_wise(node: torch.fx.Node, start: torch.fx.Node, members: set, layers: int, rank: int) -> bool:
    """Whether `node` keeps each layer's rows apart: a pointwise op whose operands outside the chain do not
    depend on its start and hold one slice per layer (or one for all) along the first dim, or fewer dims;
    or a reduction of a chain value over later dims, keeping them."""
    value = val(node)
    if not isinstance(value, torch.Tensor) or value.dim() != rank or value.shape[0] != layers:
        return False
    if _pointwise(node):
        for arg in node.all_input_nodes:
            if arg in members:
                continue
            operand = val(arg)
            if not isinstance(operand, torch.Tensor) or operand.dim() > rank or depends_on([arg], {start}):
                return False
            if operand.dim() == rank and operand.shape[0] not in (1, layers):
                return False
        return True
    if is_call(node, *_REDUCTIONS):
        dims = node.args[1] if len(node.args) > 1 else None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if node.args[0] not in members or keepdim is not True or not isinstance(dims, (list, tuple)) or not dims:
            return False
        return set(node.kwargs) <= {"keepdim"} and all(isinstance(d, int) and d % rank != 0 for d in dims)
    return False


def _per_layer_operand(node: torch.fx.Node, members: set, layers: int, rank: int) -> bool:
    """Whether a pointwise chain node reads an operand that holds one slice per layer (stacked weights)."""
    return _pointwise(node) and any(
        arg not in members and isinstance(val(arg), torch.Tensor) and val(arg).dim() == rank and val(arg).shape[0] == layers
        for arg in node.all_input_nodes
    )


def _reduced_size(node: torch.fx.Node) -> Optional[int]:
    """How many elements a reduction node reduces into one, when static."""
    shape = val(node.args[0]).shape
    sizes = [shape[d] for d in node.args[1]]
    return math.prod(sizes) if all(isinstance(size, int) for size in sizes) else None


def _slices_merged_into_rows(end: torch.fx.Node) -> bool:
    """Whether every reader of `end` (or of its contiguous copy, a reshape's first half) views it with its
    first two dims merged (`[L * T, ...]`, each slice's rows after the previous slice's, as vLLM's DFlash
    precompute rotates all layers' rows at once): read that way, the slices are no heads of one token."""
    shape = val(end).shape
    readers = [r for user in end.users for r in (user.users if is_call(user, aten.clone.default) else [user])]
    return bool(readers) and all(
        is_call(r, *RESHAPES) and val(r).dim() < len(shape) and same_size(val(r).shape[0], shape[0] * shape[1])
        for r in readers
    )


def _layer_chain(start: torch.fx.Node, slice_width: int) -> Optional[tuple[list[torch.fx.Node], torch.fx.Node]]:
    """(chain nodes in graph order, its last node) of the row-wise chain from `start`, whose slices hold
    `slice_width` elements per token, or None."""
    layers, rank = val(start).shape[0], val(start).dim()
    chain: list[torch.fx.Node] = []
    members = {start}
    for node in start.graph.nodes:  # graph order: a node's chain inputs come before it
        if node is not start and any(i in members for i in node.all_input_nodes):
            if _row_wise(node, start, members, layers, rank):
                chain.append(node)
                members.add(node)
    reductions = [n for n in chain if is_call(n, *_REDUCTIONS)]
    if not reductions:
        return None
    end = chain[-1]
    several_rows = all((_reduced_size(n) or slice_width) < slice_width for n in reductions)
    if not several_rows and not any(_per_layer_operand(n, members, layers, rank) for n in chain):
        if not _slices_merged_into_rows(end):
            return None  # one row per token and slice, the same operands for all: heads as likely as layers
    readers = [user for n in [start, *chain[:-1]] for user in n.users]
    if any(user not in members for user in readers):
        return None  # a value before the end is read outside the chain
    return chain, end


def _slice_operand(graph, arg, rank: int, layer: int, added: list) -> object:
    """Layer `layer`'s operand: its slice along the first dim (the only one when that dim is 1), its
    leading dims of size 1 dropped first (`[L, 1, 1, D]` stacked norm weights give layer i's `[D]` row,
    which broadcasts as before); an operand of fewer dims is the same for every layer (broadcast from the
    right, as before). A pointwise op of one such operand (a cast, `1 + w`) is sliced at its input and
    replayed, so that a norm weight stays a row of its parameter."""
    if not isinstance(arg, torch.fx.Node) or not isinstance(val(arg), torch.Tensor) or val(arg).dim() < rank:
        return arg
    shape = list(val(arg).shape)
    inputs = [a for a in arg.args if isinstance(a, torch.fx.Node)]
    if arg.op == "call_function" and _pointwise(arg) and len(inputs) == 1 and not arg.kwargs.keys() - {"dtype"}:
        inner = inputs[0]
        if isinstance(val(inner), torch.Tensor) and val(inner).dim() == rank and val(inner).shape[0] == shape[0]:
            args = [_slice_operand(graph, a, rank, layer, added) if a is inner else a for a in arg.args]
            added.append(add_call(graph, arg.target, args, dict(arg.kwargs)))
            return added[-1]
    ones = next((j for j, size in enumerate(shape[1:]) if size != 1), len(shape) - 1)
    row = _stacked_row(arg, shape[0], shape[1 + ones :], layer)
    if row is not None:
        return row
    if ones:
        added.append(add_call(graph, aten.reshape.default, [arg, [shape[0], *shape[1 + ones :]]]))
        arg = added[-1]
    added.append(add_call(graph, aten.select.int, [arg, 0, layer if shape[0] > 1 else 0]))
    return added[-1]


def _stacked_row(arg: torch.fx.Node, layers: int, row_shape: list, layer: int) -> Optional[torch.fx.Node]:
    """Layer `layer`'s row of an operand that is, through reshapes, a stack (or its post-grad spelling, a cat)
    along dim 0 of one tensor per layer shaped `row_shape` (`torch.stack(weights).view(L, 1, 1, D)` in the
    graph): that tensor."""
    node = arg
    if len(row_shape) != 1:
        return None
    while is_call(node, *RESHAPES):
        node = node.args[0]
    if not is_call(node, aten.cat.default, aten.stack.default) or (node.args[1] if len(node.args) > 1 else 0) != 0:
        return None
    parts = node.args[0]
    if len(parts) != layers or any(list(val(part).shape) != list(row_shape) for part in parts):
        return None
    return parts[layer]


def _replay(graph, chain, start, end, layer: int, rank: int, added: list) -> torch.fx.Node:
    """The chain on layer `layer`'s slice: each node's own op, chain inputs replaced by their slices,
    other operands sliced, reduction dims shifted down by one."""
    added.append(add_call(graph, aten.select.int, [start, 0, layer]))
    replayed = {start: added[-1]}
    for node in chain:
        if is_call(node, *_REDUCTIONS):
            dims = [d - 1 if d > 0 else d for d in node.args[1]]
            args = [replayed[node.args[0]], dims, *node.args[2:]]
        else:
            args = [
                replayed[a] if a in replayed else _slice_operand(graph, a, rank, layer, added) for a in node.args
            ]
        added.append(add_call(graph, node.target, args, dict(node.kwargs)))
        replayed[node] = added[-1]
    return replayed[end]


def unstack_layer_chains(graph: torch.fx.Graph) -> int:
    """Rewrite every qualifying chain (module docstring) as one chain per layer, stacked; returns how many."""
    rewritten = 0
    for start in list(graph.nodes):
        try:
            rewritten += _unstack(graph, start)
        except Exception:  # a graph shape this reading did not foresee: leave it as it is
            logger.debug("fx_fusion: %s left as it is", start, exc_info=True)
    return rewritten


def _unstack(graph: torch.fx.Graph, start: torch.fx.Node) -> bool:
    """Rewrite the chain starting at `start` if it qualifies; whether it did. The graph changes only once
    every per-layer node has been built."""
    slice_width = _slice_width(start) if start.op == "call_function" else 0
    value = val(start)
    if not slice_width or not isinstance(value, torch.Tensor) or value.dim() < 2 or not isinstance(value.shape[0], int):
        return False
    found = _layer_chain(start, slice_width) if 2 <= value.shape[0] <= _MAX_LAYERS else None
    if found is None or sum(not isinstance(size, int) for size in val(found[1]).shape) > 1:
        return False
    chain, end = found
    added: list[torch.fx.Node] = []
    try:
        with graph.inserting_before(end):
            values = [_replay(graph, chain, start, end, i, value.dim(), added) for i in range(value.shape[0])]
            added.append(add_call(graph, aten.cat.default, [values, 0]))  # torch.stack as the graph spells it
            shape = [size if isinstance(size, int) else -1 for size in val(end).shape]
            added.append(add_call(graph, aten.reshape.default, [added[-1], shape]))
    except Exception:
        erase_unused(list(reversed(added)))
        raise
    end.replace_all_uses_with(added[-1])
    erase_unused([end])
    return True
