"""token_cats: a concatenation of projections along tokens pushed down through per-token ops, exactly."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fx_fusion.token_cats import push_token_cats

aten = torch.ops.aten


def _count(graph: torch.fx.Graph, target) -> int:
    return sum(1 for node in graph.nodes if node.op == "call_function" and node.target is target)


def _per_token_after_cat(ctx, noise, w, norm_w, cos, sin):
    """z-lab's order: cat along tokens, then per-head RMSNorm, transpose and rotate-half RoPE; plus two
    consumers that must see the whole: a mean over the tokens and a cut along them."""
    k = torch.cat([ctx @ w.t(), noise @ w.t()], dim=0).view(1, -1, 2, 8)  # [1, T, H, D]
    k = norm_w * (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6))
    k = k.transpose(1, 2)
    rotated = torch.cat([-k[..., 4:], k[..., :4]], dim=-1)
    k = k * cos[None, None] + rotated * sin[None, None]
    return k, k.mean(2), k[:, :, 1:3]


def _inputs():
    generator = torch.Generator().manual_seed(0)
    shapes = [(5, 12), (3, 12), (16, 12), (8,), (8, 8), (8, 8)]
    return [torch.randn(s, generator=generator) for s in shapes]


def test_per_token_ops_run_on_each_piece_and_whole_consumers_get_the_pieces_joined():
    inputs = _inputs()
    traced = make_fx(_per_token_after_cat, tracing_mode="fake")(*inputs)
    expected = traced(*inputs)
    rsqrt_before = _count(traced.graph, aten.rsqrt.default)

    assert push_token_cats(traced.graph) == 1
    traced.graph.eliminate_dead_code()
    traced.graph.lint()
    traced.recompile()

    # the norm now runs once per piece, each piece's rows with their own cos/sin rows
    assert _count(traced.graph, aten.rsqrt.default) == 2 * rsqrt_before
    for node in traced.graph.nodes:  # no projection reaches the norm through a cat any more
        if node.target is aten.rsqrt.default:
            assert not any(a.target is aten.cat.default for a in node.all_input_nodes)
    for got, want in zip(traced(*inputs), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(traced(*inputs)[0], _per_token_after_cat(*inputs)[0], rtol=1e-6, atol=1e-6)


def test_a_cat_of_non_projections_or_along_features_is_left_alone():
    def columns(x, w1, w2):  # a fused kv spelled as a column cat: not a token cat
        return torch.cat([x @ w1.t(), x @ w2.t()], dim=-1) * 2

    def values(a, b):
        return torch.cat([a, b], dim=0).sin()

    for fn, args in ((columns, (torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 4))), (values, (torch.randn(2, 3), torch.randn(4, 3)))):
        traced = make_fx(fn, tracing_mode="fake")(*args)
        nodes = len(traced.graph.nodes)
        assert push_token_cats(traced.graph) == 0
        assert len(traced.graph.nodes) == nodes
