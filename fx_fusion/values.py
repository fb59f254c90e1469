"""Value identity of graph nodes: two nodes with equal keys compute equal tensors.

A key is the node's op applied to the keys of its arguments, down to graph inputs, which are compared by
identity (two different parameters may hold different values), as are the results of random ops and
uninitialised allocations (two `torch.rand` calls, two `torch.empty`: one spelling, different values).
A post-grad graph is not always CSE'd, so
the same slice or gather spelled twice gets one key; a permuted, sliced or shuffled view of a tensor gets
a different key from the tensor itself, however similar the two look.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

# The ops that only reshape (same elements, same order), as a graph spells them.
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
# Ops that only re-lay out (or copy) a tensor: the same elements, in another shape or order.
LAYOUT_OPS = frozenset(
    {
        *RESHAPES,
        aten.permute.default,
        aten.transpose.int,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.clone.default,
        aten.alias.default,
    }
)


class ValueKeys:
    """Callable: node -> hashable key of the value it computes (memoised for one graph).

    Each distinct (op, argument keys) expression is numbered once, and a node's key is that number: keys
    stay small however deep the graph (a nested key would be re-hashed down to the inputs on every lookup,
    which grows exponentially with layers that read a value twice), and equal expressions still get equal
    keys. Keys are comparable within one instance only.
    """

    def __init__(self) -> None:
        self._memo: dict = {}
        self._numbers: dict = {}
        self._input_masks: dict = {}
        self._input_bits: dict = {}

    def __call__(self, node) -> object:
        if isinstance(node, (list, tuple)):
            return tuple(self(a) for a in node)
        if isinstance(node, dict):
            return tuple(sorted((k, self(v)) for k, v in node.items()))
        if not isinstance(node, torch.fx.Node):
            return ("const", type(node).__name__, repr(node))
        if node not in self._memo:
            self._fill(node)
        return self._memo[node]

    def _fill(self, node: torch.fx.Node) -> None:
        """Key `node` and its unkeyed ancestors, inputs first."""
        for current in _inputs_first(node, self._memo):
            if current.op == "call_function" and not _unique_value(current):
                expression = (current.target, self(current.args), self(current.kwargs))
                self._memo[current] = self._numbers.setdefault(expression, ("value", len(self._numbers)))
            else:
                self._memo[current] = ("input", current)

    def input_mask(self, node: torch.fx.Node) -> int:
        """The graph inputs `node`'s value is computed from, as a bit mask (bits numbered per instance):
        `input_mask(a) & input_mask(b)` is non-zero when a and b read a common input."""
        for current in _inputs_first(node, self._input_masks):
            if current.op in ("placeholder", "get_attr"):
                mask = 1 << self._input_bits.setdefault(current, len(self._input_bits))
            else:
                mask = 0
                for a in current.all_input_nodes:
                    mask |= self._input_masks[a]
            self._input_masks[current] = mask
        return self._input_masks[node]


UNINITIALISED = frozenset({aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default})


def _unique_value(node: torch.fx.Node) -> bool:
    """A value no other node computes however it is spelled: a random draw or an uninitialised buffer."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or node.target in UNINITIALISED


def _inputs_first(node: torch.fx.Node, done: dict):
    """`node` and its ancestors not in `done`, each after its inputs; the caller adds each to `done` before
    taking the next (iteratively: graphs can be thousands deep)."""
    stack = [node]
    while stack:
        current = stack[-1]
        if current in done:
            stack.pop()
            continue
        missing = [a for a in current.all_input_nodes if a not in done]
        if missing:
            stack.extend(missing)
            continue
        stack.pop()
        yield current
