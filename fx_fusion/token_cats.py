"""Push a concatenation along tokens down through the per-token ops that follow it.

DFlash drafts join each layer's context rows (from the target's hidden states, the same input for every
layer) and its noise-block rows along tokens, in three places that public drafts use:

    z-lab:      k = cat([k_proj(target_hidden), k_proj(noise)], dim=1).view(B, ctx + q, H, D) -> k_norm -> RoPE
    normed:     k = cat([k_norm(k_proj(target_hidden).view(..)), k_norm(k_proj(noise).view(..))], dim=1) -> RoPE
    inputs:     k = k_proj(cat([target_hidden, noise], dim=1)).view(..) -> k_norm -> RoPE

Every op after that cat treats each token on its own, so it equals `cat([f(ctx), f(noise)], dim)`: the
same ops applied to each piece, with the cos/sin rows of that piece. This module rewrites the graph that
way; each piece's chain is then an ordinary K branch, and the context pieces of all layers fuse into one
group while the noise rows keep their own path. A cat is pushed when one of its pieces is a projection's
output (or columns cut from it: K and V of a fused kv/qkv linear), when every piece is computed token by
token from projections, or when it feeds a projection (a linear is per token too) and another such cat
shares a piece with it (the context rows that every layer reads). A linear over the cat's rows that
Inductor zero-padded to aligned sizes (padded_linears; on CUDA it pads by timing) is first read as the
plain linear it computes, so that it runs per piece too.

The same push serves a draft that merges every layer's rows into one dim for one RoPE call (vLLM's DFlash
context precompute: each layer's normed K stacked, a `torch.stack` being a cat along dim 0 and a view,
then viewed `[L * T, kv]`, the cos/sin cache gathered at `positions.repeat(L)`): a reshape that hides the
tokens (`[L * T, ..] -> [L, T, ..]`) but is only reshaped again is looked through, and an operand's rows
for one piece that are one whole block of a repeat, a cat or an expand are that block (the positions
themselves, gathered from the table), so every layer reads one cos/sin value.

The pushed region is every node reachable from the cat through ops that keep each token's values apart:
elementwise ops (other operands used as they broadcast, cut to the piece's rows where they run along the
axis), casts, copies, reductions over other dims, linears over the rows, permutes, unsqueezes, cuts and
cats along other dims, and reshapes. A reshape may fold the tokens into a wider dim with the dims beside
them (`k.reshape(-1, D)` of a [B, T, H, D] K: rows ordered batch, token, head) and a later one unfold them;
each piece is reshaped the same way with its own row count. Each new node's shape is checked against the
original's with the tokens resized; anything else stops the region, and its users get the pieces joined
back (a folded dim joined through a view that exposes the tokens). All of it is exact (the same elements
through the same ops); a region that cannot be pushed, or a rewrite that fails, leaves the graph as it
was. Piece lengths may be symbolic (a dynamic token count): the rows of a piece are then cut and sized by
the graph's own size nodes, and shapes are compared as expressions.
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Optional

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from . import kv_patterns, padded_linears, strided_outputs
from .kv_patterns import PROJECTION_OPS, is_call, same_size, val
from .values import RESHAPES

aten = torch.ops.aten
prims = torch.ops.prims
logger = logging.getLogger(__name__)

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


_MOVES = (aten.permute.default, aten.transpose.int, aten.unsqueeze.default)
_PER_TOKEN = (*_UNARY, *_BINARY, *_REDUCTIONS, *RESHAPES, *_MOVES, *_CUTS, operator.getitem, aten.cat.default)
_FROM_PROJECTION_NODES = 48  # how far back a piece is walked to its projections (an RMSNorm is ~12 nodes)


def _projection_of(piece: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The projection whose output (or columns of it: K cut from a fused kv/qkv linear) `piece` is,
    reshaped (its rows split into leading dims), else None."""
    node = piece
    while is_call(node, *RESHAPES) or kv_patterns.column_range(node) is not None:
        node = node.args[0] if is_call(node, *RESHAPES) else kv_patterns.column_range(node)[0]
    return node if is_call(node, *PROJECTION_OPS) else None


def _computed_from_projections(piece: torch.fx.Node) -> bool:
    """Whether walking back from `piece` through per-token ops (a K norm, say) reaches a projection."""
    seen, stack = set(), [piece]
    while stack and len(seen) < _FROM_PROJECTION_NODES:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _projection_of(node) is not None:
            return True
        # one layer, or K among K and V (taken by select, unbind, or a cut squeezed; contiguous or not)
        if is_call(node, *_PER_TOKEN, aten.select.int, aten.unbind.int, aten.squeeze.dim, aten.clone.default):
            stack.extend(node.all_input_nodes)
    return False


def _row_input_index(node: torch.fx.Node) -> Optional[int]:
    """Which argument of a projection holds its input rows (mm: 0, addmm: 1)."""
    return {aten.mm.default: 0, aten.addmm.default: 1}.get(node.target) if node.op == "call_function" else None


def _reshapes_of(node: torch.fx.Node) -> set:
    """`node` and every reshape of it, of a reshape of it, ..."""
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        found.add(current)
        stack.extend(u for u in current.users if is_call(u, *RESHAPES) and u not in found)
    return found


def _feeds_projection(cat: torch.fx.Node, padded: dict) -> bool:
    """Whether `cat`, or a reshape of it, is the input rows of a projection (or of one that Inductor
    zero-padded: `padded`, by input rows)."""
    for node in _reshapes_of(cat):
        if node in padded:
            return True
        for user in node.users:
            index = _row_input_index(user)
            if index is not None and user.args[index] is node:
                return True
    return False


def _padded_linears_by_rows(graph: torch.fx.Graph) -> dict:
    """{unpadded input rows: [their linears that Inductor zero-padded (padded_linears)]}."""
    padded: dict = {}
    for node in graph.nodes:
        linear = padded_linears.padded_linear(node) if is_call(node, aten.slice.Tensor) else None
        if linear is not None:
            padded.setdefault(linear.x2d, []).append(linear)
    return padded


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


def _exact_ratio(size, divisor):
    """size / divisor, an int or a symbolic size, when it divides at every size the graph may run with;
    else None."""
    hint, hinted_divisor = kv_patterns.size_hint(size), kv_patterns.size_hint(divisor)
    if hinted_divisor <= 0 or hint % hinted_divisor or hint < hinted_divisor:
        return None
    ratio = _as_int(size // divisor)
    return ratio if same_size(ratio * divisor, size) else None


def _block_index(start, length, rows) -> Optional[int]:
    """k when start:start + length are the rows of block k of `rows` rows each, else None."""
    if not same_size(length, rows):
        return None
    if same_size(start, 0):
        return 0
    k = _exact_ratio(start, rows)
    return k if isinstance(k, int) else None


UNFOLDED = (1, 1)


def _same_fold(a: tuple, b: tuple) -> bool:
    """Folds equal at every size (compared without guarding a symbolic size)."""
    return all(map(same_size, a, b))


class _Pusher:
    """Builds each region node once per piece. `axis[node]` is the dim of `node` that holds the cat's
    tokens; `fold[node]` = (x, y) when that dim holds dims beside them too: it enumerates (x, tokens, y)
    in row-major order (UNFOLDED: a dim of their own). x and y are ints or symbolic sizes."""

    def __init__(self, graph: torch.fx.Graph, cat: torch.fx.Node, dim: int):
        self.graph, self.cat = graph, cat
        lengths = [val(p).shape[dim] for p in cat.args[0]]  # ints or symbolic sizes
        self.bounds = [(_as_int(sum(lengths[:i])), _as_int(sum(lengths[: i + 1]))) for i in range(len(lengths))]
        self.total = self.bounds[-1][1]
        self.pieces: dict[torch.fx.Node, list] = {cat: list(cat.args[0])}
        self.axis: dict[torch.fx.Node, int] = {cat: dim}
        self.fold: dict[torch.fx.Node, tuple] = {cat: UNFOLDED}
        self.row_inputs = _reshapes_of(cat)  # what a projection may read piece by piece: the cat's own rows
        # reshapes of region values that hide the tokens (`[L * T, ..] -> [L, T, ..]`) but are only reshaped
        # again: {reshape: the region value it reshapes}, as reshape(reshape(x)) is one reshape of x
        self.through: dict[torch.fx.Node, torch.fx.Node] = {}
        self.created: list[torch.fx.Node] = []
        self._sizes: dict = {}  # graph values of symbolic bounds, built once
        self._rows: dict = {}  # {(operand, axis, piece): the piece's rows of it}
        self._blocks: dict = {}  # block()'s answers, so that cos and sin share one gather
        self._symbols = kv_patterns.symbol_inputs(graph)

    def length(self, piece: int):
        """Piece's row count as the graph spells it: an int, the graph input holding its symbol, or else
        a size node of the piece (which then reads the projection: its K cannot join a group)."""
        start, end = self.bounds[piece]
        if isinstance(_as_int(end - start), int):
            return _as_int(end - start)
        if ("length", piece) not in self._sizes:
            symbol = self._symbols.get((end - start).node.expr)
            dim = self.axis[self.cat]
            self._sizes[("length", piece)] = symbol or self.call(aten.sym_size.int, [self.cat.args[0][piece], dim])
        return self._sizes[("length", piece)]

    def rows(self, piece: int, fold: tuple) -> object:
        """Piece's size of a dim that holds its tokens folded as `fold`."""
        return self.product([fold[0], self.length(piece), fold[1]])

    def product(self, factors: list) -> object:
        """The product of sizes as the graph spells it: an int, or a node of the graph."""
        spelled = [self.spell(f) if not isinstance(f, torch.fx.Node) else f for f in factors]
        number = math.prod(f for f in spelled if isinstance(f, int))
        nodes = [f for f in spelled if not isinstance(f, int)]
        if not nodes:
            return number
        result = nodes[0]
        for node in nodes[1:]:
            result = self.call(operator.mul, [result, node])
        return result if number == 1 else self.call(operator.mul, [result, number])

    def spell(self, size) -> object:
        """An int, or a graph node holding a symbolic size (a product of graph inputs times a number)."""
        term = strided_outputs.spelled(size, self._symbols)
        if term is None:
            raise _Stop(f"size {size} has no spelling in the graph")
        if isinstance(term, int):
            return term
        inputs, factor = term
        return self.product([*inputs, factor])

    def start(self, piece: int):
        """Piece's first row along the cat: an int, or the sum of the earlier pieces' size nodes."""
        if isinstance(self.bounds[piece][0], int):
            return self.bounds[piece][0]
        if ("start", piece) not in self._sizes:
            before = self.start(piece - 1)
            self._sizes[("start", piece)] = self.call(operator.add, [before, self.length(piece - 1)])
        return self._sizes[("start", piece)]

    def call(self, target, args, kwargs=None) -> torch.fx.Node:
        node = kv_patterns.add_call(self.graph, target, args, kwargs)
        self.created.append(node)
        return node

    def erase(self) -> None:
        for node in reversed(self.created):
            self.graph.erase_node(node)
        self.created.clear()

    def operand(self, arg, piece: int, out_rank: int, out_axis: int, fold: tuple):
        """A non-region operand of an elementwise op, cut to the piece's rows where it runs along the axis."""
        if not isinstance(arg, torch.fx.Node):
            return arg
        if arg in self.through:
            raise _Stop("operand hides the tokens")
        if arg in self.pieces:
            if self.axis[arg] + out_rank - val(arg).dim() != out_axis or not _same_fold(self.fold[arg], fold):
                raise _Stop("pieces on different axes")
            return self.pieces[arg][piece]
        shape = _shape(arg)
        if shape is None:
            raise _Stop("operand is not a tensor")
        aligned = out_axis - (out_rank - len(shape))
        if aligned < 0 or same_size(shape[aligned], 1):
            return arg
        if not _same_fold(fold, UNFOLDED) or not same_size(shape[aligned], self.total):
            raise _Stop("operand does not run along the tokens")
        if (arg, aligned, piece) not in self._rows:  # built once however many ops read it
            rows = self.block(arg, aligned, *self.bounds[piece])
            if rows is None:
                start, length = self.start(piece), self.length(piece)
                if isinstance(start, int) and isinstance(length, int):
                    end = start + length
                else:
                    end = length if start == 0 else self.call(operator.add, [start, length])
                rows = self.call(aten.slice.Tensor, [arg, aligned, start, end])
            self._rows[(arg, aligned, piece)] = rows
        return self._rows[(arg, aligned, piece)]

    def block(self, node: torch.fx.Node, axis: int, start, end) -> Optional[torch.fx.Node]:
        """Rows start:end of `node` along `axis` without a cut, where they are one block of a repeat, a cat
        or a stack (`positions.repeat(L)`, `cat([positions] * L)`, `positions.expand(L, T).reshape(-1)`:
        layers' rows merged into one dim), reached through ops that treat rows alike (casts, cos and sin,
        elementwise ops with broadcast operands, unsqueezes, cuts and cats along other dims, a gather from
        a table by those rows); None when there is no such block."""
        key = (node, axis, str(start), str(end))
        if key not in self._blocks:
            self._blocks[key] = self._block(node, axis, start, end)
        return self._blocks[key]

    def _block(self, node: torch.fx.Node, axis: int, start, end) -> Optional[torch.fx.Node]:
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            return None
        args, shape = node.args, _shape(node)
        if shape is None:
            return None
        length = end - start
        if node.target is aten.repeat.default:
            source, reps = args[0], list(args[1])
            if len(reps) != val(source).dim() or any(r != 1 for j, r in enumerate(reps) if j != axis):
                return None
            return source if _block_index(start, length, val(source).shape[axis]) is not None else None
        if node.target is aten.cat.default:
            dim = (args[1] if len(args) > 1 else 0) % len(shape)
            if dim != axis:  # halves joined along another dim (a half-width table widened): each part's rows
                parts = [self.block(part, axis, start, end) for part in args[0]]
                return None if None in parts else self.call(aten.cat.default, [parts, dim])
            first = 0
            for part in args[0]:
                rows = val(part).shape[axis]
                if same_size(first, start) and same_size(rows, length):
                    return part
                first = first + rows
            return None
        if node.target in RESHAPES and axis == 0:  # [A * B, ..] from [A, B, ..]: rows of one A are a select
            stacked = args[0]
            outer = _shape(stacked)
            if outer is None or len(outer) != len(shape) + 1 or not all(map(same_size, outer[2:], shape[1:])):
                return None
            return None if _block_index(start, length, outer[1]) is None else self.selected(stacked)
        if node.target in _BINARY:  # operands along the rows give their rows, broadcast ones stay
            operands = []
            for arg in args[:2]:
                arg_shape = _shape(arg) if isinstance(arg, torch.fx.Node) else None
                aligned = None if arg_shape is None else axis - (len(shape) - len(arg_shape))
                if arg_shape is None or aligned < 0 or same_size(arg_shape[aligned], 1):
                    operands.append(arg)
                    continue
                operands.append(self.block(arg, aligned, start, end))
                if operands[-1] is None:
                    return None
            if operands == list(args[:2]):
                return None
            return self.call(node.target, operands + list(args[2:]), node.kwargs)
        if node.target in (*_UNARY, aten.cos.default, aten.sin.default):
            inner = self.block(args[0], axis, start, end)
            return None if inner is None else self.call(node.target, [inner, *args[1:]], node.kwargs)
        if node.target is aten.unsqueeze.default:
            dim = args[1] % len(shape)
            if dim == axis:
                return None
            inner = self.block(args[0], axis - (dim < axis), start, end)
            return None if inner is None else self.call(node.target, [inner, args[1]])
        if node.target is operator.getitem and is_call(args[0], aten.split.Tensor, aten.split_with_sizes.default):
            split = args[0]
            dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % len(shape)
            inner = None if dim == axis else self.block(split.args[0], axis, start, end)
            if inner is None:
                return None
            return self.call(operator.getitem, [self.call(split.target, [inner, *split.args[1:]], split.kwargs), args[1]])
        if node.target is aten.slice.Tensor:
            dim = (args[1] if len(args) > 1 else node.kwargs.get("dim", 0)) % len(shape)
            inner = None if dim == axis else self.block(args[0], axis, start, end)
            return None if inner is None else self.call(aten.slice.Tensor, [inner, *args[1:]], node.kwargs)
        if node.target is aten.index.Tensor and len(args[1]) == 1 and args[1][0] is not None:
            rows = args[1][0]  # table[rows]: the result's leading dims are the rows'
            if axis >= val(rows).dim():
                return None
            inner = self.block(rows, axis, start, end)
            return None if inner is None else self.call(aten.index.Tensor, [args[0], [inner]])
        return None

    def selected(self, node: torch.fx.Node) -> Optional[torch.fx.Node]:
        """Any node[i] along dim 0 without a select, where node is `x.unsqueeze(0).expand(L, ..)` (or a copy
        of it): x."""
        if is_call(node, aten.clone.default):
            return self.selected(node.args[0])
        if is_call(node, aten.expand.default) and is_call(node.args[0], aten.unsqueeze.default):
            inner = node.args[0]
            if inner.args[1] % val(inner).dim() == 0 and all(map(same_size, _shape(inner)[1:], _shape(node)[1:])):
                return inner.args[0]
        return None

    def token_dim(self, after: list, outer, inner) -> tuple[int, tuple]:
        """(dim, fold) of the tokens in a reshape's result whose elements run (outer, tokens, inner) in
        row-major order."""
        prefix = 1
        for j, size in enumerate(after):
            if same_size(prefix, outer) and same_size(size, self.total):
                return j, UNFOLDED
            x = _exact_ratio(outer, prefix)
            y = None if x is None else _exact_ratio(size, x * self.total)
            if y is not None and same_size(y * math.prod(after[j + 1 :]), inner):
                return j, (x, y)
            prefix = prefix * size
        raise _Stop("reshape moves the tokens")

    def push(self, node: torch.fx.Node) -> None:
        """Pieces of `node` (one of its tensor inputs in the region); raises _Stop when it must stay whole."""
        target, args = node.target, list(node.args)
        source = args[0] if args and isinstance(args[0], torch.fx.Node) else None
        full = _shape(node)
        fold = self.fold.get(source, UNFOLDED)
        if target in _BINARY:
            keys = [(self.axis[a] + val(node).dim() - val(a).dim(), self.fold[a]) for a in args[:2] if a in self.pieces]
            if full is None or any(k[0] != keys[0][0] or not _same_fold(k[1], keys[0][1]) for k in keys):
                raise _Stop("operands on different axes")
            axis, fold = keys[0]
            made = [
                self.call(target, [self.operand(a, i, len(full), axis, fold) for a in args], node.kwargs)
                for i in range(len(self.bounds))
            ]
        elif target in PROJECTION_OPS:  # a linear over the cat's rows: one per piece
            index = _row_input_index(node)
            rows = args[index]
            others = [a for i, a in enumerate(args) if i != index]
            if rows not in self.row_inputs or self.axis.get(rows) != 0 or any(a in self.pieces for a in others):
                raise _Stop("not a linear over the cat's rows")
            axis, fold = 0, self.fold[rows]
            made = [self.call(target, args[:index] + [p] + args[index + 1 :], node.kwargs) for p in self.pieces[rows]]
        elif target in RESHAPES and (source in self.pieces or source in self.through):
            origin = self.through.get(source, source)
            try:
                made, axis, fold = self._reshape(node, origin)
            except _Stop:
                if node.users and all(is_call(u, *RESHAPES) for u in node.users):
                    self.through[node] = origin
                raise
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
            if not all(p in self.pieces and self.axis[p] == self.axis[parts[0]] and _same_fold(self.fold[p], self.fold[parts[0]]) for p in parts):
                raise _Stop("joins region and non-region values")
            axis, fold = self.axis[parts[0]], self.fold[parts[0]]
            if dim == axis:
                raise _Stop("joins along the tokens")
            made = [self.call(target, [[self.pieces[p][i] for p in parts], dim]) for i in range(len(self.bounds))]
        else:
            raise _Stop(f"{target} is not pushed")
        self._check(node, made, axis, fold)
        self.pieces[node], self.axis[node], self.fold[node] = made, axis, fold

    def _reshape(self, node: torch.fx.Node, source: torch.fx.Node) -> tuple[list, int, tuple]:
        """Pieces of `node`, a reshape of region value `source` (the elements keep their order: find where
        the tokens sit in the result), with their axis and fold."""
        full, fold = _shape(node), self.fold[source]
        before, at = _shape(source), self.axis[source]
        outer = math.prod(before[:at]) * fold[0]
        inner = fold[1] * math.prod(before[at + 1 :])
        axis, fold = self.token_dim(full, outer, inner)
        # the shape as the graph spells it (its size nodes), the tokens' dim resized to the piece's rows
        spelled = list(node.args[1]) if len(node.args[1]) == len(full) else list(full)
        made = []
        for i, piece in enumerate(self.pieces[source]):
            shape = list(spelled)
            shape[axis] = self.rows(i, fold)
            made.append(self.call(node.target, [piece, shape]))
        return made, axis, fold

    def _check(self, node: torch.fx.Node, made: list, axis: int, fold: tuple) -> None:
        """Each piece has the node's shape with the tokens resized (lists: element by element)."""
        full = val(node)
        for piece, (start, end) in zip(made, self.bounds):
            got = piece.meta["val"]
            pairs = zip(got, full) if isinstance(full, (list, tuple)) else [(got, full)]
            for g, f in pairs:
                expected = list(f.shape)
                expected[axis] = (end - start) * fold[0] * fold[1]
                if len(g.shape) != len(expected) or not all(map(same_size, g.shape, expected)) or g.dtype != f.dtype:
                    raise _Stop("piece shape")

    def join(self, node: torch.fx.Node) -> torch.fx.Node:
        """`node`'s whole value from its pieces: a cat along the tokens, through a view that exposes them
        where they are folded with other dims."""
        axis, (x, y), pieces = self.axis[node], self.fold[node], self.pieces[node]
        if _same_fold((x, y), UNFOLDED):
            return self.call(aten.cat.default, [pieces, axis])
        # the other dims as the pieces have them (a symbolic one read off the first piece)
        dims = [
            _as_int(size) if is_concrete_int(size) else self.call(aten.sym_size.int, [pieces[0], j])
            for j, size in enumerate(val(node).shape)
        ]
        exposed = [
            self.call(aten.view.default, [p, dims[:axis] + [self.spell(x), self.length(i), self.spell(y)] + dims[axis + 1 :]])
            for i, p in enumerate(pieces)
        ]
        joined = self.call(aten.cat.default, [exposed, axis + 1])
        return self.call(aten.view.default, [joined, dims[:axis] + [-1] + dims[axis + 1 :]])


def _pushable_cats(graph: torch.fx.Graph, padded: dict) -> list[tuple[torch.fx.Node, int]]:
    """(cat, dim) for each cat along a token axis of projection outputs, of values computed token by
    token from projections, or of a projection's input rows that another such cat shares a piece with
    (the context rows every layer reads: pushed, each layer's linear of them can join one group; a cat
    of inputs that nothing shares, a batch joined for one projection say, stays whole)."""
    cats = [(node, _token_axis_cat(node)) for node in graph.nodes if _token_axis_cat(node) is not None]
    feeding = [cat for cat, _ in cats if _feeds_projection(cat, padded)]

    def shares_a_piece(cat: torch.fx.Node) -> bool:
        return any(other is not cat and set(other.args[0]) & set(cat.args[0]) for other in feeding)

    return [
        (cat, dim)
        for cat, dim in cats
        if any(_projection_of(p) is not None for p in cat.args[0])
        or all(map(_computed_from_projections, cat.args[0]))
        or (cat in feeding and shares_a_piece(cat))
    ]


def push_token_cats(graph: torch.fx.Graph) -> int:
    """Rewrite every pushable region (module docstring); returns how many cats were pushed down."""
    pushed = 0
    padded = _padded_linears_by_rows(graph)
    for cat, dim in _pushable_cats(graph, padded):
        pusher = _Pusher(graph, cat, dim)
        try:
            for rows in _reshapes_of(cat):  # a padded linear over the cat's rows: its plain form, pushable
                for linear in padded.pop(rows, []):
                    padded_linears.read_plain(graph, linear)
            order = {n: i for i, n in enumerate(graph.nodes)}
            region = _grow(graph, pusher, order)
            joins = _joins(pusher, region, order) if len(region) > 1 else {}
        except Exception:  # a graph shape not foreseen: never fail a compile, leave this cat as it was
            logger.debug("fx_fusion: token cat %s left as it was", cat, exc_info=True)
            region, joins = {cat}, {}
        if len(region) == 1:  # nothing after the cat could be pushed: leave it as it was
            pusher.erase()
            continue
        for node, joined in joins.items():
            node.replace_all_uses_with(joined, delete_user_cb=lambda user: user not in region and user is not joined)
        pushed += 1
    return pushed


def _joins(pusher: _Pusher, region: set, order: dict) -> dict:
    """{region node: its pieces joined}, for each region node read outside the region (before its first
    such reader)."""
    def absorbed(user: torch.fx.Node) -> bool:  # a reshape looked through whose readers are all pushed
        return user in pusher.through and all(u in region or absorbed(u) for u in user.users)

    joins = {}
    for node in sorted(region - {pusher.cat}, key=order.get):
        outside = [u for u in node.users if u not in region and not absorbed(u)]
        if outside:
            with pusher.graph.inserting_before(min(outside, key=order.get)):
                joins[node] = pusher.join(node)
    return joins


def _grow(graph: torch.fx.Graph, pusher: _Pusher, order: dict) -> set:
    """The region: the cat and every node reachable from it that could be built piece by piece (each
    piece built just before its node). Nodes left out keep reading the whole value."""
    region = {pusher.cat}
    for node in list(graph.nodes)[order[pusher.cat] + 1 :]:
        if node.op != "call_function" or not any(a in region or a in pusher.through for a in node.all_input_nodes):
            continue
        try:
            with graph.inserting_before(node):
                pusher.push(node)
        except _Stop:
            continue  # stays whole: its region inputs are joined back for it
        region.add(node)
    return region
