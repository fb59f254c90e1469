"""bias_adds: a linear's bias added after its product's reshape, moved back onto the product, exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fx_fusion
from fx_fusion.bias_adds import move_bias_adds_to_products

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("fresh_compile")


class BroadcastContext(nn.Module):
    """Two layers' context K/V with bias over a hidden state broadcast to the batch by `expand`: a view
    that cannot be seen as rows, so each linear's bias is added after the product's reshape."""

    def __init__(self, hidden=32, heads=2, head_dim=16):
        super().__init__()
        self.shape = (heads, head_dim)
        self.k = nn.ModuleList(nn.Linear(hidden, heads * head_dim) for _ in range(2))
        self.v = nn.ModuleList(nn.Linear(hidden, heads * head_dim) for _ in range(2))

    def forward(self, hidden, cos, sin):
        x = hidden.expand(2, -1, -1)
        outs = []
        for k_proj, v_proj in zip(self.k, self.v):
            k = k_proj(x).view(*x.shape[:2], *self.shape)
            half = k.shape[-1] // 2
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            outs += [k, v_proj(x)]
        return outs


def test_bias_after_a_reshape_is_moved_and_the_layers_fuse():
    torch.manual_seed(0)
    module = BroadcastContext().eval()
    angles = torch.randn(5, 1, 16)
    inputs = (torch.randn(1, 5, 32), angles.cos(), angles.sin())
    adds_after_reshape = []

    def count_then_fuse(graph: torch.fx.Graph) -> None:
        adds_after_reshape.append(move_bias_adds_to_products(graph))
        fused_kv_pass(graph)

    fused_kv_pass = fx_fusion.FusedKVPass()
    with torch.no_grad():
        expected = module(*inputs)
        got = torch.compile(module, options={"post_grad_custom_post_pass": count_then_fuse})(*inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert adds_after_reshape == [4]  # every K and V linear's bias was added after its reshape
    groups = [g for r in fused_kv_pass.records for g in r.fused_groups]
    assert [g.n_layers for g in groups] == [2], [g.describe() for g in groups]
    assert groups[0].describe().endswith(", bias"), groups[0].describe()


def test_other_adds_after_a_reshape_stay():
    """A bias that is not a parameter of one value per column, or a product read elsewhere too, stays."""

    def graph_of(fn, *args):
        return torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake")(*args).graph

    x, w = torch.randn(6, 8), torch.randn(4, 8)

    def shared_product(x, w, b):
        product = x @ w.t()
        return product.view(2, 3, 4) + b, product

    shared = graph_of(shared_product, x, w, torch.randn(4))
    computed = graph_of(lambda x, w, b: (x @ w.t()).view(2, 3, 4) + b * 2, x, w, torch.randn(4))
    for graph in (shared, computed):
        nodes = len(graph.nodes)
        assert move_bias_adds_to_products(graph) == 0
        assert len(graph.nodes) == nodes
