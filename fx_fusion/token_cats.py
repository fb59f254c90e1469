"""Push a concatenation of projections along tokens down through the per-token ops that follow it.

The z-lab DFlash reference draft concatenates each layer's context K (projected from the target's hidden
states, the same input for every layer) with its noise-block K along tokens *before* the K norm and RoPE:

    k = cat([k_proj(target_hidden), k_proj(noise)], dim=1).view(B, ctx + q, H, D) -> k_norm -> RoPE

Every op after that cat treats each token on its own, so it equals `cat([f(ctx), f(noise)], dim)`: the
same ops applied to each piece, with the cos/sin rows of that piece. This module rewrites the graph that
way; each piece's chain is then an ordinary K branch, and the context pieces of all layers fuse into one
group while the noise rows keep their own path. A piece may be a projection's output or columns cut from
it (K and V of a fused kv/qkv linear).

The pushed region is every node reachable from the cat through ops that keep the cat's axis an axis of
its own: elementwise ops (other operands used as they broadcast, cut to the piece's rows where they run
along the axis), casts, copies, reductions over other dims, permutes, unsqueezes, reshapes that keep every
dim up to the axis, and cuts and cats along other dims. Each new node's shape is checked against the
original's with the axis resized; anything else stops the region, and its users get the pieces
concatenated back. All of it is exact (the same elements through the same ops); a region that cannot be
pushed is left as it was. Piece lengths may be symbolic (a dynamic token count): the rows of a piece are
then cut and sized by the graph's own size nodes, and shapes are compared as expressions.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from . import kv_patterns
from .kv_patterns import PROJECTION_OPS, is_call, same_size, val
from .values import RESHAPES

aten = torch.ops.aten
prims = torch.ops.prims

_UNARY = (
    prims.convert_element_type.default,
    aten._to_copy.default,
    aten.clone.default,
    aten.alias.default,
    aten.neg.default,
    aten.rsqrt.default,
    aten.sqrt.default,
    aten.reciprocal.default,
    aten.pow.Tensor_Scalar,
)
_BINARY = (
    aten.mul.Tensor,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.div.Tensor,
    aten.mul.Scalar,
    aten.add.Scalar,
    aten.sub.Scalar,
    aten.div.Scalar,
)
_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList)
_CUTS = (aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default)


class _Stop(Exception):
    """This node cannot be computed piece by piece."""


def _projection_of(piece: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The projection whose output (or columns of it: K cut from a fused kv/qkv linear) `piece` is,
    reshaped (its rows split into leading dims), else None."""
    node = piece
    while is_call(node, *RESHAPES) or kv_patterns.column_range(node) is not None:
        node = node.args[0] if is_call(node, *RESHAPES) else kv_patterns.column_range(node)[0]
    return node if is_call(node, *PROJECTION_OPS) else None


def _token_axis_cat(node: torch.fx.Node) -> Optional[int]:
    """The dim of a cat of two or more pieces along a dim other than the last (a token axis), else None."""
    if not is_call(node, aten.cat.default) or len(node.args[0]) < 2:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    rank = val(node).dim()
    return None if dim % rank == rank - 1 else dim % rank


def _shape(node: torch.fx.Node) -> Optional[list]:
    """The node's sizes, ints or symbolic (None for a non-tensor)."""
    value = val(node)
    return list(value.shape) if isinstance(value, torch.Tensor) else None


def _as_int(size):
    """A size as an int when it is one, symbolic or not (`(s0 + 4) - s0` is 4)."""
    return int(size) if is_concrete_int(size) else size


class _Pusher:
    """Builds each region node once per piece; `axis[node]` is where the cat's axis sits in `node`."""

    def __init__(self, graph: torch.fx.Graph, cat: torch.fx.Node, dim: int):
        self.graph, self.cat = graph, cat
        lengths = [val(p).shape[dim] for p in cat.args[0]]  # ints or symbolic sizes
        self.bounds = [(_as_int(sum(lengths[:i])), _as_int(sum(lengths[: i + 1]))) for i in range(len(lengths))]
        self.total = self.bounds[-1][1]
        self.pieces: dict[torch.fx.Node, list] = {cat: list(cat.args[0])}
        self.axis: dict[torch.fx.Node, int] = {cat: dim}
        self.dim = dim
        self.created: list[torch.fx.Node] = []
        self._sizes: dict = {}  # graph values of symbolic bounds, built once
        self._symbols = kv_patterns.symbol_inputs(graph)

    def length(self, piece: int):
        """Piece's row count as the graph spells it: an int, the graph input holding its symbol, or else
        a size node of the piece (which then reads the projection: its K cannot join a group)."""
        start, end = self.bounds[piece]
        if isinstance(_as_int(end - start), int):
            return _as_int(end - start)
        if ("length", piece) not in self._sizes:
            symbol = self._symbols.get((end - start).node.expr)
            self._sizes[("length", piece)] = symbol or self.call(aten.sym_size.int, [self.cat.args[0][piece], self.dim])
        return self._sizes[("length", piece)]

    def start(self, piece: int):
        """Piece's first row along the cat: an int, or the sum of the earlier pieces' size nodes."""
        if isinstance(self.bounds[piece][0], int):
            return self.bounds[piece][0]
        if ("start", piece) not in self._sizes:
            before = self.start(piece - 1)
            self._sizes[("start", piece)] = self.call(operator.add, [before, self.length(piece - 1)])
        return self._sizes[("start", piece)]

    def call(self, target, args, kwargs=None) -> torch.fx.Node:
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        self.created.append(node)
        fake_args, fake_kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    def operand(self, arg, piece: int, out_rank: int, out_axis: int):
        """A non-region operand of an elementwise op, cut to the piece's rows where it runs along the axis."""
        if not isinstance(arg, torch.fx.Node):
            return arg
        if arg in self.pieces:
            if self.axis[arg] + out_rank - val(arg).dim() != out_axis:
                raise _Stop("pieces on different axes")
            return self.pieces[arg][piece]
        shape = _shape(arg)
        if shape is None:
            raise _Stop("operand is not a tensor")
        aligned = out_axis - (out_rank - len(shape))
        if aligned < 0 or same_size(shape[aligned], 1):
            return arg
        if not same_size(shape[aligned], self.total):
            raise _Stop("operand does not run along the tokens")
        start, length = self.start(piece), self.length(piece)
        if isinstance(start, int) and isinstance(length, int):
            end = start + length
        else:
            end = length if start == 0 else self.call(operator.add, [start, length])
        return self.call(aten.slice.Tensor, [arg, aligned, start, end])

    def push(self, node: torch.fx.Node) -> None:
        """Pieces of `node` (one of its tensor inputs in the region); raises _Stop when it must stay whole."""
        target, args = node.target, list(node.args)
        source = args[0] if args and isinstance(args[0], torch.fx.Node) else None
        full = _shape(node)
        if target in _BINARY:
            axes = {self.axis[a] + val(node).dim() - val(a).dim() for a in args[:2] if a in self.pieces}
            if len(axes) != 1 or full is None:
                raise _Stop("operands on different axes")
            (axis,) = axes
            made = [self.call(target, [self.operand(a, i, len(full), axis) for a in args], node.kwargs) for i in range(len(self.bounds))]
        elif target is not aten.cat.default and (
            source not in self.pieces or any(isinstance(a, torch.fx.Node) and a in self.pieces for a in args[1:])
        ):
            raise _Stop("not a per-piece op of one region input")
        elif target in _UNARY:
            axis = self.axis[source]
            made = [self.call(target, [p] + args[1:], node.kwargs) for p in self.pieces[source]]
        elif target in _REDUCTIONS:
            dims, rank = args[1], val(source).dim()
            axis = self.axis[source]
            keep = args[2] if len(args) > 2 else node.kwargs.get("keepdim", False)
            if not isinstance(dims, (list, tuple)) or axis in [d % rank for d in dims]:
                raise _Stop("reduces over the tokens")
            axis -= 0 if keep else sum(1 for d in dims if d % rank < axis)
            made = [self.call(target, [p] + args[1:], node.kwargs) for p in self.pieces[source]]
        elif target in RESHAPES:  # the axis must stay one dim, with the same elements before it
            before, after = _shape(source), full
            outer = math.prod(before[: self.axis[source]])
            found = [
                j for j in range(len(after))
                if same_size(math.prod(after[:j]), outer) and same_size(after[j], before[self.axis[source]])
            ]  # fmt: skip
            if not found:
                raise _Stop("reshape moves the tokens")
            axis = found[0]
            # the shape as the graph spells it (its size nodes), the axis resized to the piece's rows
            spelled = list(args[1]) if len(args[1]) == len(after) else list(after)
            made = []
            for i, piece in enumerate(self.pieces[source]):
                shape = list(spelled)
                shape[axis] = self.length(i)
                made.append(self.call(target, [piece, shape]))
        elif target is aten.permute.default:
            axis = list(args[1]).index(self.axis[source])
            made = [self.call(target, [p, args[1]]) for p in self.pieces[source]]
        elif target is aten.transpose.int:
            rank = val(source).dim()
            a, b = args[1] % rank, args[2] % rank
            axis = {a: b, b: a}.get(self.axis[source], self.axis[source])
            made = [self.call(target, [p, a, b]) for p in self.pieces[source]]
        elif target is aten.unsqueeze.default:
            inserted = args[1] % (val(source).dim() + 1)
            axis = self.axis[source] + (1 if inserted <= self.axis[source] else 0)
            made = [self.call(target, [p, args[1]]) for p in self.pieces[source]]
        elif target in _CUTS:
            dim = args[2] if target is not aten.slice.Tensor and len(args) > 2 else (args[1] if target is aten.slice.Tensor and len(args) > 1 else 0)
            if dim % val(source).dim() == self.axis[source]:
                raise _Stop("cut along the tokens")
            axis = self.axis[source]
            made = [self.call(target, [p] + args[1:], node.kwargs) for p in self.pieces[source]]
        elif target is operator.getitem and is_call(source, aten.split.Tensor, aten.split_with_sizes.default):
            axis = self.axis[source]
            made = [self.call(target, [p, args[1]]) for p in self.pieces[source]]
        elif target is aten.cat.default:  # rotate_half's cat(-x2, x1) along another dim
            parts, rank = list(args[0]), val(node).dim()
            dim = (args[1] if len(args) > 1 else 0) % rank
            if not all(p in self.pieces and self.axis[p] == self.axis[parts[0]] for p in parts):
                raise _Stop("joins region and non-region values")
            axis = self.axis[parts[0]]
            if dim == axis:
                raise _Stop("joins along the tokens")
            made = [self.call(target, [[self.pieces[p][i] for p in parts], dim]) for i in range(len(self.bounds))]
        else:
            raise _Stop(f"{target} is not pushed")
        self._check(node, made, axis)
        self.pieces[node], self.axis[node] = made, axis

    def _check(self, node: torch.fx.Node, made: list, axis: int) -> None:
        """Each piece has the node's shape with the axis resized (lists: element by element)."""
        full = val(node)
        for piece, (start, end) in zip(made, self.bounds):
            got = piece.meta["val"]
            pairs = zip(got, full) if isinstance(full, (list, tuple)) else [(got, full)]
            for g, f in pairs:
                expected = list(f.shape)
                expected[axis] = end - start
                if len(g.shape) != len(expected) or not all(map(same_size, g.shape, expected)) or g.dtype != f.dtype:
                    raise _Stop("piece shape")


def _join_cat(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, int]]:
    """(cat, dim) for a cat of projection outputs along a token axis."""
    dim = _token_axis_cat(node)
    if dim is None:
        return None
    return (node, dim) if any(_projection_of(p) is not None for p in node.args[0]) else None


def push_token_cats(graph: torch.fx.Graph) -> int:
    """Rewrite every pushable region (module docstring); returns how many cats were pushed down."""
    pushed = 0
    for cat in [n for n in graph.nodes if _join_cat(n)]:
        order = {n: i for i, n in enumerate(graph.nodes)}
        pusher = _Pusher(graph, cat, _join_cat(cat)[1])
        region = _grow(graph, pusher, order)
        if len(region) == 1:  # nothing after the cat could be pushed: leave it as it was
            for node in reversed(pusher.created):
                graph.erase_node(node)
            continue
        for node in sorted(region - {cat}, key=order.get):
            outside = [u for u in node.users if u not in region]
            if not outside:
                continue
            with graph.inserting_before(min(outside, key=order.get)):
                joined = pusher.call(aten.cat.default, [pusher.pieces[node], pusher.axis[node]])
            node.replace_all_uses_with(joined, delete_user_cb=lambda user: user not in region and user is not joined)
        pushed += 1
    return pushed


def _grow(graph: torch.fx.Graph, pusher: _Pusher, order: dict) -> set:
    """The region: the cat and every node reachable from it that could be built piece by piece (each
    piece built just before its node). Nodes left out keep reading the whole value."""
    region = {pusher.cat}
    for node in list(graph.nodes)[order[pusher.cat] + 1 :]:
        if node.op != "call_function" or not any(a in region for a in node.all_input_nodes):
            continue
        try:
            with graph.inserting_before(node):
                pusher.push(node)
        except _Stop:
            continue  # stays whole: its region inputs are joined back for it
        region.add(node)
    return region
