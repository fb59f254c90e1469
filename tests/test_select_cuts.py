"""select_cuts: K and V of stacked layers taken by select or unbind of `[T, L, 2, H, D]` are read as column
slices of `[T, L, 2 * H * D]`; the graph computes what it computed before, and other selects stay."""

from __future__ import annotations

import operator
import os
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fx_fusion.select_cuts import selects_as_column_slices

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rewrite_checks import count_calls, traced_and_rewritten  # noqa: E402

aten = torch.ops.aten
TOKENS, LAYERS, HEADS, DIM, HIDDEN = 5, 3, 2, 8, 16


def _rewrite(fn, *args):
    return traced_and_rewritten(selects_as_column_slices, fn, *args)


def _inputs(batch: int = 0):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*([batch] if batch else []), TOKENS, HIDDEN, generator=gen)
    return x, torch.randn(LAYERS * 2 * HEADS * DIM, HIDDEN, generator=gen)


def _by_select(x, w):
    kv = torch.nn.functional.linear(x, w).view(*x.shape[:-1], LAYERS, 2, HEADS, DIM)
    return kv[..., 0, :, :] * 2.0, kv[..., 1, :, :] + 1.0


def _by_unbind(x, w):
    k, v = torch.nn.functional.linear(x, w).view(TOKENS, LAYERS, 2, HEADS, DIM).unbind(2)
    return k * 2.0, v + 1.0


def _by_negative_select(x, w):
    kv = torch.nn.functional.linear(x, w).view(TOKENS, LAYERS, 2, HEADS, DIM)
    return kv.select(-3, -2) * 2.0, kv.select(-3, -1) + 1.0


@pytest.mark.parametrize(
    "fn, batch", [(_by_select, 0), (_by_select, 2), (_by_unbind, 0), (_by_negative_select, 0)],
    ids=["select", "select_batched", "unbind", "negative_select"],
)  # fmt: skip
def test_picks_become_column_slices(fn, batch):
    args = _inputs(batch)
    traced, rewritten, expected = _rewrite(fn, *args)
    assert rewritten == 1
    assert count_calls(traced.graph, aten.select.int) == 0 and count_calls(traced.graph, aten.unbind.int) == 0
    slices = [n for n in traced.graph.nodes if n.target is aten.slice.Tensor]
    width = HEADS * DIM
    assert sorted(n.args[2:] for n in slices) == [(0, width), (width, 2 * width)]
    coarse = slices[0].args[0]
    assert list(coarse.meta["val"].shape[-2:]) == [LAYERS, 2 * width]  # [..., T, L, 2 * kv]: the seed's layout
    for got, want in zip(traced(*args), expected):
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_each_layers_column_block_cut_by_unbind():
    """`y.chunk(L, -1)[i].view(T, 2, H, D).unbind(1)`: each layer's block of columns, its K and V picked by
    unbind, becomes two column slices of that block (no view in between, so the cuts nest)."""

    def per_layer_blocks(x, w):
        outs = []
        for block in torch.nn.functional.linear(x, w).chunk(LAYERS, dim=-1):
            k, v = block.view(TOKENS, 2, HEADS, DIM).unbind(1)
            outs += [k * 2.0, v + 1.0]
        return tuple(outs)

    args = _inputs()
    traced, rewritten, expected = _rewrite(per_layer_blocks, *args)
    assert rewritten == LAYERS and count_calls(traced.graph, aten.unbind.int) == 0
    width = HEADS * DIM
    slices = [n for n in traced.graph.nodes if n.target is aten.slice.Tensor]
    assert sorted(n.args[2:] for n in slices) == sorted([(0, width), (width, 2 * width)] * LAYERS)
    assert all(n.args[0].target is operator.getitem for n in slices)  # cut from the chunk's pieces directly
    for got, want in zip(traced(*args), expected):
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _next_to_last_dim(x, w):
    """Falcon's per-head cut, `qkv.view(T, H, 3, D)[..., 1, :]`: heads are read where they are."""
    qkv = torch.nn.functional.linear(x, w[: 3 * HEADS * DIM]).view(TOKENS, HEADS, 3, DIM)
    return qkv[..., 1, :] * 2.0


def _two_axes(x, w):
    kv = torch.nn.functional.linear(x, w).view(TOKENS, LAYERS, 2, HEADS, DIM)
    return kv[:, :, 0] * 2.0, kv[:, 0] + 1.0


def _view_read_whole(x, w):
    kv = torch.nn.functional.linear(x, w).view(TOKENS, LAYERS, 2, HEADS, DIM)
    return kv[:, :, 0] * 2.0, kv.sum()


def _no_projection(x, w):
    kv = (x.repeat(1, 6) * 2.0).view(TOKENS, LAYERS, 2, HEADS, DIM)
    return kv[:, :, 0] + 1.0


@pytest.mark.parametrize("fn", [_next_to_last_dim, _two_axes, _view_read_whole, _no_projection])
def test_other_selects_stay(fn):
    traced = make_fx(fn, tracing_mode="fake")(*_inputs())
    before = [node.format_node() for node in traced.graph.nodes]
    assert selects_as_column_slices(traced.graph) == 0
    assert [node.format_node() for node in traced.graph.nodes] == before


def test_a_failing_build_leaves_the_graph_as_it_was(refuse_add_call):
    """A piece the fake tensors refuse: nothing is rewritten, no node is left behind, no error."""
    from fx_fusion import select_cuts

    refuse_add_call(select_cuts, aten.slice.Tensor)
    traced = make_fx(_by_select, tracing_mode="fake")(*_inputs())
    before = [node.format_node() for node in traced.graph.nodes]
    assert selects_as_column_slices(traced.graph) == 0
    assert [node.format_node() for node in traced.graph.nodes] == before
