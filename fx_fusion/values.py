"""Value identity of graph nodes: two nodes with equal keys compute equal tensors.

A key is the node's op applied to the keys of its arguments, down to graph inputs, which are compared by
identity (two different parameters may hold different values). A post-grad graph is not always CSE'd, so
the same slice or gather spelled twice gets one key; a permuted, sliced or shuffled view of a tensor gets
a different key from the tensor itself, however similar the two look.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

# Ops that only re-lay out (or copy) a tensor: the same elements, in another shape or order.
LAYOUT_OPS = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.permute.default,
        aten.transpose.int,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.clone.default,
        aten.alias.default,
    }
)


class ValueKeys:
    """Callable: node -> hashable key of the value it computes (memoised for one graph)."""

    def __init__(self) -> None:
        self._memo: dict = {}

    def __call__(self, node) -> object:
        if isinstance(node, (list, tuple)):
            return tuple(self(a) for a in node)
        if isinstance(node, dict):
            return tuple(sorted((k, self(v)) for k, v in node.items()))
        if not isinstance(node, torch.fx.Node):
            return ("const", type(node).__name__, repr(node))
        key = self._memo.get(node)
        if key is None:
            if node.op == "call_function":
                key = (node.target, self(node.args), self(node.kwargs))
            else:
                key = ("input", node)
            self._memo[node] = key
        return key
