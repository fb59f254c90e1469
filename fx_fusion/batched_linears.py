"""Products of views that compute a linear (`torch.einsum` projections), read as the linear.

`torch.einsum("btd,nd->btn", x, W)` (or `"td,nd->tn"`, `"...d,nd->...n"`) computes `x @ W.T`, but reaches the
post-grad graph as a `bmm` of batch 1 over views of `x` and `W`, its result viewed back (on a GPU, Inductor's
joint-graph pass has already made it an `mm` of the same views, squeezed):

    E = view(bmm(A, B), ...)      A = views of x, [1, M, D];  B = views of W, [1, D, N]
    E = view(mm(A, B), ...)       A = views of x, [M, D];     B = views of W, [D, N]

This rewrites E as `reshape(mm(x2d, permute(W, [1, 0])), E.shape)` (`x2d`: `x` reshaped `[M, D]`, as Inductor
spells a linear's input rows) when

- W is a parameter `[N, D]` (or rows of one) and B's matrix addresses exactly the elements of W.T (a
  parameter stored `[D, N]` that B's matrix addresses as it is becomes `mm(x2d, W)`, as `x @ W` spells it);
- A's matrix addresses exactly the elements of `x` viewed row-major as `[M, D]` (else x2d is A's own);
- E addresses the product's result row-major (else only the product is replaced: `unsqueeze(mm, 0)` for
  the bmm, the new mm for the mm).

Each condition is checked by replaying the views on meta tensors with the inputs' strides: a result that is
a view of the replayed input (no op copied) addresses the elements its strides and offset say. So the mm
reads the same elements laid out the same way, and the pass reads it as any linear.

Rewriting an `mm` so changes nothing but its spelling. A `bmm` and an `mm` are different kernels on CPU,
which may round a sum differently, so that rewrite is provisional: `restore` puts a `bmm` (over operands
laid out as the originals: same shapes, and the same strides wherever a size is not 1) back in place of
every such mm that a reader still reads once the fusion is done.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
import torch.fx

from .kv_patterns import add_call, erase_unused, hinted, is_call, is_parameter_rows, val
from .values import RESHAPES

aten = torch.ops.aten
logger = logging.getLogger(__name__)

# Ops that view their input (when a reshape cannot, it copies: the replay on meta tensors tells).
VIEWS = (*RESHAPES, aten.permute.default, aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.alias.default)


@dataclasses.dataclass
class ReadLinear:
    """One rewritten product: `mm` (x2d @ W.T), viewed where the einsum's result was; `was_bmm`: it replaced a
    bmm (put back by `restore` where nothing fused it)."""

    mm: torch.fx.Node
    was_bmm: bool


def _view_chain(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The node a chain of views starts from, and the chain in forward order."""
    chain = []
    while is_call(node, *VIEWS):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def _meta(value: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(hinted(list(value.shape)), hinted(list(value.stride())), dtype=value.dtype, device="meta")


def _replayed_view(start: torch.Tensor, chain: list[torch.fx.Node]) -> Optional[torch.Tensor]:
    """`chain` applied to the meta tensor `start`; None when an op copied (the result is no view of start)."""
    value = start
    for node in chain:
        value = node.target(value, *hinted(list(node.args[1:])), **hinted(dict(node.kwargs)))
    return value if value is start or value._base is start else None


def _addresses(value: torch.Tensor) -> tuple:
    """Where a view's elements sit: shape, offset, and the strides of its dims of more than one element."""
    return tuple(value.shape), value.storage_offset(), tuple(s for n, s in zip(value.shape, value.stride()) if n != 1)


def _matrix(value: torch.Tensor, batched: bool) -> Optional[torch.Tensor]:
    """The product operand's matrix: the only one of a batch-1 bmm operand, or the mm operand itself."""
    if value.dim() != (3 if batched else 2) or (batched and value.shape[0] != 1):
        return None
    return value[0] if batched else value


def _weight_operand(b: torch.fx.Node, batched: bool) -> Optional[tuple[torch.fx.Node, bool]]:
    """(W, True) when `b` is views of a parameter W [N, D] whose matrix is W.T element for element; (W, False)
    when it is W itself, a parameter stored [D, N] (`x @ W`); else None."""
    weight, chain = _view_chain(b)
    if not chain or not is_parameter_rows(weight) or val(weight).dim() != 2:
        return None
    start = _meta(val(weight))
    replayed = _replayed_view(start, chain)
    matrix = None if replayed is None else _matrix(replayed, batched)
    for weight_matrix, transposed in ((start.t(), True), (start, False)):
        if matrix is not None and _addresses(matrix) == _addresses(weight_matrix):
            return weight, transposed
    return None


def _row_count(a: torch.fx.Node, chain: list[torch.fx.Node]):
    """A's row count M as the graph spells it: an int, a reshape's own size argument for a symbolic one
    (in A or in its chain), or -1."""
    count = val(a).shape[-2]
    if isinstance(count, int):
        return count
    for node in [a, *reversed(chain)]:
        size = val(node).shape[-2] if val(node).dim() >= 2 else None
        if is_call(node, *RESHAPES) and isinstance(size, torch.SymInt) and size.node.expr == count.node.expr:
            return node.args[1][-2]
    return -1


def _rows_of_input(a: torch.fx.Node, batched: bool) -> tuple[torch.fx.Node, list]:
    """(node, shape) such that reshape(node, shape) is a view holding A's matrix ([M, D]): the chain's input as
    rows when A's matrix addresses its elements row-major, else A itself."""
    source, chain = _view_chain(a)
    hidden = val(a).shape[-1]
    rows = [_row_count(a, chain), hidden]
    if chain and val(source).shape[-1] == hidden:
        start = _meta(val(source))
        replayed, flat = _replayed_view(start, chain), start.reshape(-1, hidden)
        matrix = None if replayed is None else _matrix(replayed, batched)
        if matrix is not None and flat._base is start and _addresses(matrix) == _addresses(flat):
            return source, rows
    return a, rows


def _size_source(reader: torch.fx.Node, source: torch.fx.Node) -> Optional[int]:
    """The dim of `source` whose size is the one `reader` (a `sym_size`) reads, or None."""
    size = val(reader)
    for dim, candidate in enumerate(val(source).shape):
        if isinstance(size, torch.SymInt) and isinstance(candidate, torch.SymInt):  # compared as expressions:
            if size.node.expr == candidate.node.expr:  # no guard
                return dim
        elif isinstance(size, int) and isinstance(candidate, int) and size == candidate:
            return dim
    return None


def _row_major_end(product: torch.fx.Node, source: torch.fx.Node) -> tuple[torch.fx.Node, dict]:
    """The last node of the product's view chain (each link read by one view, and by `sym_size`s of a size
    that `source` has too) that holds the product's elements row-major, or the product itself; and
    {sym_size: dim of source} for the readers of the links before it (they must read `source` once the chain
    is gone)."""
    chain, node, sizes = [], product, [{}]
    while True:
        readers = [u for u in node.users if not is_call(u, aten.sym_size.int)]
        of_sizes = {u: _size_source(u, source) for u in node.users if is_call(u, aten.sym_size.int)}
        if len(readers) != 1 or not is_call(readers[0], *VIEWS) or None in of_sizes.values():
            break
        sizes.append({**sizes[-1], **of_sizes})
        node = readers[0]
        chain.append(node)
    start = _meta(val(product))
    while chain:
        replayed = _replayed_view(start, chain)
        if replayed is not None and replayed.is_contiguous() and replayed.storage_offset() == 0:
            return chain[-1], sizes[len(chain)]
        chain.pop()
    return product, {}


def _read_sizes_from(sizes: dict, source: torch.fx.Node) -> None:
    """Each `sym_size` of `sizes` replaced by the `sym_size` of `source` it equals."""
    for reader, dim in sizes.items():
        with reader.graph.inserting_before(reader):
            same = reader.graph.call_function(aten.sym_size.int, (source, dim))
        same.meta["val"] = reader.meta["val"]
        reader.replace_all_uses_with(same)
        reader.graph.erase_node(reader)


def _shape_arg(value: torch.Tensor) -> list:
    """A view's size argument for `value`'s shape: -1 for its one symbolic size (more: ValueError)."""
    shape = [size if isinstance(size, int) else -1 for size in value.shape]
    if shape.count(-1) > 1:
        raise ValueError("more than one symbolic size")
    return shape


def _shape_of(node: torch.fx.Node) -> list:
    """The size argument that gives `node`'s shape: a reshape's own (symbolic sizes as the graph spells them)."""
    return list(node.args[1]) if is_call(node, *RESHAPES) else _shape_arg(val(node))


def _is_linear_weight(rhs: torch.fx.Node) -> bool:
    """Already a linear's weight as the pass reads it: W.T by `permute(W, [1, 0])`, or W itself."""
    if is_call(rhs, aten.permute.default) and list(rhs.args[1]) == [1, 0]:
        rhs = rhs.args[0]
    return is_parameter_rows(rhs)


def _read_linear(product: torch.fx.Node) -> Optional[ReadLinear]:
    a, b = product.args[:2]
    batched = product.target is aten.bmm.default
    if not batched and _is_linear_weight(b):
        return None  # a linear as Inductor spells one
    if not isinstance(val(product).shape[-1], int) or not isinstance(val(a).shape[-1], int):
        return None
    found = _weight_operand(b, batched)
    if found is None:
        return None
    weight, transposed = found
    graph, added = product.graph, []
    source, rows = _rows_of_input(a, batched)
    original, sizes = _row_major_end(product, source)
    _read_sizes_from(sizes, source)  # the same sizes (a dynamic shape's), read where they stay
    try:
        with graph.inserting_before(original):
            added.append(x2d := add_call(graph, aten.reshape.default, [source, rows]))
            if transposed:
                added.append(weight := add_call(graph, aten.permute.default, [weight, [1, 0]]))
            added.append(mm := add_call(graph, aten.mm.default, [x2d, weight]))
            if original is not product:
                added.append(add_call(graph, aten.reshape.default, [mm, _shape_of(original)]))
            elif batched:
                added.append(add_call(graph, aten.unsqueeze.default, [mm, 0]))
        if _addresses(val(added[-1])) != _addresses(val(original)):
            raise ValueError("the linear is laid out unlike the product it replaces")
    except Exception:
        logger.debug("fx_fusion: %s left as it is", product, exc_info=True)
        erase_unused(list(reversed(added)))
        return None
    for node in added:  # the user's line, for the report
        node.meta.update({k: v for k, v in product.meta.items() if k != "val"})
    original.replace_all_uses_with(added[-1])
    erase_unused([original])
    return ReadLinear(mm, batched)


def read_as_linears(graph: torch.fx.Graph) -> list[ReadLinear]:
    """Rewrite every qualifying product as the linear it computes (module docstring)."""
    read = []
    products = [n for n in graph.nodes if is_call(n, aten.bmm.default, aten.mm.default)]
    for product in products:
        try:
            found = _read_linear(product)
        except Exception:  # a graph shape this reading did not foresee: leave it as it is
            logger.debug("fx_fusion: %s left as it is", product, exc_info=True)
            found = None
        if found is not None:
            read.append(found)
    return read


def restore(graph: torch.fx.Graph, read: list[ReadLinear]) -> int:
    """Put a batch-1 `bmm` back in place of every mm made of one that a reader still reads; returns how many."""
    restored = 0
    for linear in read:
        mm = linear.mm
        if not linear.was_bmm or not mm.users:  # an mm as it was, or fused: its readers read the fused op
            continue
        x2d, rhs = mm.args  # as the pass left them (it may have merged equal nodes)
        with graph.inserting_before(mm):
            a = add_call(graph, aten.view.default, [x2d, [1, -1, val(x2d).shape[-1]]])
            b = add_call(graph, aten.unsqueeze.default, [rhs, 0])
            product = add_call(graph, aten.bmm.default, [a, b])
            rows = add_call(graph, aten.view.default, [product, _shape_arg(val(mm))])
        for node in (a, b, product, rows):
            node.meta.update({k: v for k, v in mm.meta.items() if k != "val"})
        mm.replace_all_uses_with(rows)
        erase_unused([mm])
        restored += 1
    return restored
