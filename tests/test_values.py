"""ValueKeys: equal keys exactly for equal expressions, and keys that stay small in deep graphs."""

import torch
import torch.fx

from fx_fusion.values import ValueKeys


def _graph_reading_each_value_twice(depth: int) -> tuple[torch.fx.Graph, list[torch.fx.Node]]:
    """x -> add(x, x) -> add(y, y) ...: a residual-like chain whose fully nested key would double per step."""
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    chain = [node]
    for _ in range(depth):
        node = graph.call_function(torch.ops.aten.add.Tensor, (node, node))
        chain.append(node)
    graph.output(node)
    return graph, chain


def test_keys_stay_small_in_deep_graphs():
    _, chain = _graph_reading_each_value_twice(5000)
    keys = ValueKeys()
    last = keys(chain[-1])  # a nested key would hold 2**5000 leaves; a numbered one is one small tuple
    assert last == ("value", 4999)
    assert len(repr(last)) < 32


def test_equal_expressions_share_a_key_and_others_do_not():
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    first = graph.call_function(torch.ops.aten.mul.Tensor, (x, w))
    again = graph.call_function(torch.ops.aten.mul.Tensor, (x, w))  # not CSE'd: the same value
    swapped = graph.call_function(torch.ops.aten.mul.Tensor, (w, x))  # not assumed commutative
    transposed = graph.call_function(torch.ops.aten.permute.default, (x, [1, 0]))
    transposed_again = graph.call_function(torch.ops.aten.permute.default, (x, [1, 0]))
    other = graph.call_function(torch.ops.aten.permute.default, (w, [1, 0]))
    keys = ValueKeys()
    assert keys(first) == keys(again)
    assert keys(transposed) == keys(transposed_again)
    assert len({keys(first), keys(swapped), keys(transposed), keys(other), keys(x), keys(w)}) == 6


def test_input_masks_name_the_graph_inputs_a_value_reads():
    graph = torch.fx.Graph()
    x, w, positions = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("positions")
    k = graph.call_function(torch.ops.aten.mm.default, (x, w))
    cos = graph.call_function(torch.ops.aten.cos.default, (positions,))
    gate = graph.call_function(torch.ops.aten.sigmoid.default, (x,))
    keys = ValueKeys()
    assert keys.input_mask(k) & keys.input_mask(gate)  # both read x
    assert not keys.input_mask(k) & keys.input_mask(cos)
    assert keys.input_mask(cos) == keys.input_mask(positions) != 0


def test_input_masks_in_deep_graphs():
    _, chain = _graph_reading_each_value_twice(5000)  # iterative: no recursion limit
    keys = ValueKeys()
    assert keys.input_mask(chain[-1]) == keys.input_mask(chain[0]) == 1


def test_random_draws_and_uninitialised_buffers_are_never_equal():
    """Two `torch.rand` calls (or two `torch.empty`) are spelled alike but hold different values."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    draws = [graph.call_function(torch.ops.aten.rand.default, ([4, 8],)) for _ in range(2)]
    like = [graph.call_function(torch.ops.aten.randn_like.default, (x,)) for _ in range(2)]
    empty = [graph.call_function(torch.ops.aten.empty.memory_format, ([4, 8],)) for _ in range(2)]
    cos = [graph.call_function(torch.ops.aten.cos.default, (d,)) for d in draws]
    keys = ValueKeys()
    for a, b in (draws, like, empty, cos):
        assert keys(a) != keys(b)
        assert keys(a) == keys(a)
