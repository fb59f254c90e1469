"""scatter_forwarding: in-place updates of column views, functionalised into slice_scatters, read back as
plain chains; the graph computes exactly what it computed before."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fx_fusion.scatter_forwarding import forward_scattered_views

aten = torch.ops.aten


def _updates_views_in_place(x, w):
    qkv = x @ w.t()
    q, k, v = qkv.split([8, 4, 4], -1)
    heads = k.view(-1, 2, 2)
    heads.mul_(torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6))  # nano-vllm's in-place norm
    k.mul_(3.0)
    return k + 1, v * 2, q[:, :4] - 1, qkv.sum(-1)


def _count(graph: torch.fx.Graph, target) -> int:
    return sum(1 for node in graph.nodes if node.op == "call_function" and node.target is target)


def test_cuts_of_scatters_become_the_scattered_values_or_the_base():
    x, w = torch.randn(5, 6), torch.randn(16, 6)
    traced = make_fx(torch.func.functionalize(_updates_views_in_place), tracing_mode="fake")(x, w)
    expected = traced(x, w)
    before = _count(traced.graph, aten.slice_scatter.default)
    assert before >= 2

    replaced = forward_scattered_views(traced.graph)
    traced.graph.eliminate_dead_code()
    traced.recompile()

    assert replaced >= 2
    outputs = next(n for n in traced.graph.nodes if n.op == "output").args[0]
    for output in outputs[:3]:  # K, V and Q read the mm through plain ops, no scatter on the way
        node = output
        while node.op == "call_function" and node.target is not aten.mm.default:
            assert node.target is not aten.slice_scatter.default, output
            node = node.args[0]
    # the whole qkv is still read (qkv.sum), so its scatters stay for that one use
    assert _count(traced.graph, aten.slice_scatter.default) == before
    for got, want in zip(traced(x, w), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(_updates_views_in_place(x, w)[0], expected[0])


def test_graphs_without_scatters_are_left_alone():
    traced = make_fx(lambda x: (x.view(2, 3).view(6) + 1, x.view(3, 2)), tracing_mode="fake")(torch.randn(6))
    nodes = len(traced.graph.nodes)
    assert forward_scattered_views(traced.graph) == 1  # the view round trip only
    traced.graph.eliminate_dead_code()
    assert len(traced.graph.nodes) == nodes - 2


def _norm_each_layer_into_empty(k, weights, layers_written):
    """vLLM's DFlash precompute: `out = torch.empty_like(all_k)`, then `out[i] = k_norm_i(all_k[i])`."""
    out = torch.empty_like(k)
    for i in layers_written:
        out[i] = k[i] * torch.rsqrt(k[i].pow(2).mean(-1, keepdim=True) + 1e-6) * weights[i]
    return out * 2


def test_select_scatters_that_write_every_index_become_the_values_stacked():
    k, weights = torch.randn(3, 5, 2, 8), torch.randn(3, 8)
    fn = lambda k, w: _norm_each_layer_into_empty(k, w, [2, 0, 1])  # noqa: E731  (any order)
    traced = make_fx(torch.func.functionalize(fn), tracing_mode="fake")(k, weights)
    assert _count(traced.graph, aten.select_scatter.default) == 3

    assert forward_scattered_views(traced.graph) >= 1
    traced.graph.lint()
    traced.recompile()

    assert _count(traced.graph, aten.select_scatter.default) == 0 and _count(traced.graph, aten.empty_like.default) == 0
    torch.testing.assert_close(traced(k, weights), fn(k, weights), rtol=0, atol=0)


def test_select_scatters_that_leave_an_index_unwritten_stay():
    def fn(k, w):  # layer 1 keeps what the base held
        out = k.clone()
        for i in (0, 2):
            out[i] = k[i] * w[i]
        return out * 2

    k, weights = torch.randn(3, 5, 2, 8), torch.randn(3, 8)
    traced = make_fx(torch.func.functionalize(fn), tracing_mode="fake")(k, weights)
    forward_scattered_views(traced.graph)
    traced.recompile()
    assert _count(traced.graph, aten.select_scatter.default) == 2
    torch.testing.assert_close(traced(k, weights), fn(k, weights), rtol=0, atol=0)
