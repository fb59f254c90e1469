"""layer_unstack: one norm over a layer-major stack of every layer's K, read as one norm per layer and
stacked; the graph computes what it computed before, and chains that do not keep the layers apart stay."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fx_fusion.layer_unstack import unstack_layer_chains

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rewrite_checks import count_calls, traced_and_rewritten  # noqa: E402

aten = torch.ops.aten
LAYERS, TOKENS, HEADS, DIM = 3, 5, 2, 8


def _layer_major_k(x, w):
    """vLLM DFlash's precompute layout: [T, L, 2, H, D] made layer-major, K taken with [0]."""
    kv = (x @ w.t()).view(TOKENS, LAYERS, 2, HEADS, DIM).permute(2, 1, 0, 3, 4).contiguous()
    return kv[0], kv[1]


def _one_norm(x, w, norm_weights):
    k, v = _layer_major_k(x, w)
    h = k.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (h.to(k.dtype) * norm_weights).view(LAYERS * TOKENS, -1) + 1, v


def _inputs(dtype=torch.float32, weights_shape=(LAYERS, 1, 1, DIM)):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, 16, generator=gen).to(dtype)
    w = torch.randn(LAYERS * 2 * HEADS * DIM, 16, generator=gen).to(dtype)
    return x, w, (torch.rand(*weights_shape, generator=gen) + 0.5).to(dtype)


def _rewrite(fn, *args):
    return traced_and_rewritten(unstack_layer_chains, fn, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_norm_over_all_layers_becomes_a_norm_per_layer(dtype):
    args = _inputs(dtype)
    traced, rewritten, expected = _rewrite(_one_norm, *args)
    assert rewritten == 1
    assert count_calls(traced.graph, aten.mean.dim) == LAYERS  # one reduction per layer, over [T, H, D] each
    assert all(len(n.meta["val"].shape) == 3 for n in traced.graph.nodes if n.target is aten.mean.dim)
    # each layer's norm weight is its row of the stacked weights, [D]
    rows = [n for n in traced.graph.nodes if n.target is aten.select.int and n.meta["val"].shape == (DIM,)]
    assert len(rows) == LAYERS
    for got, want in zip(traced(*args), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("weights_shape", [(DIM,), None], ids=["one_weight_for_all", "no_weight"])
def test_several_heads_per_layer_tell_layers_from_heads(weights_shape):
    """No operand differs between the slices (one norm weight for all layers, or none), but each slice holds
    HEADS rows per token: a layer's heads, not one head of a layer laid out first. Unstacked, exactly."""
    if weights_shape is None:
        x, w, _ = _inputs()
        traced, rewritten, expected = _rewrite(lambda x, w: _one_norm(x, w, 1.0), x, w)
        args = (x, w)
    else:
        args = _inputs(weights_shape=weights_shape)
        traced, rewritten, expected = _rewrite(_one_norm, *args)
    assert rewritten == 1 and count_calls(traced.graph, aten.mean.dim) == LAYERS
    for got, want in zip(traced(*args), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _heads_first_one_layer(x, w, norm_weight):
    """One layer's K/V, heads laid out first: `kv.view(T, 2, H, D).permute(1, 2, 0, 3)[0]` is [H, T, D]."""
    k = (x @ w[: 2 * HEADS * DIM].t()).view(TOKENS, 2, HEADS, DIM).permute(1, 2, 0, 3).contiguous()[0]
    return k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight


def _one_head_per_layer(x, w, norm_weight):
    """Layer-major K of one KV head per layer: [L, T, D] slices, one row per token, like heads first."""
    k = (x @ w[: LAYERS * 2 * DIM].t()).view(TOKENS, LAYERS, 2, DIM).permute(2, 1, 0, 3).contiguous()[0]
    return k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight


@pytest.mark.parametrize("fn", [_heads_first_one_layer, _one_head_per_layer])
def test_one_row_per_token_and_slice_with_one_weight_stays_whole(fn):
    """One norm row per token in each slice and one weight for all: heads laid out first read exactly like
    layers of one head, so the chain stays as it is (one layer of H heads fuses without this rewrite)."""
    args = _inputs(weights_shape=(DIM,))
    traced, rewritten, expected = _rewrite(fn, *args)
    assert rewritten == 0 and count_calls(traced.graph, aten.mean.dim) == 1
    torch.testing.assert_close(traced(*args), expected, rtol=0, atol=0)


def test_one_head_per_layer_read_as_rows_of_all_layers_is_unstacked():
    """The same chain read only as `[L * T, D]` rows (vLLM's DFlash precompute rotates all layers' rows at
    once): the slices are not heads of one token, so each is normed on its own, exactly."""

    def merged(x, w, norm_weight):
        return _one_head_per_layer(x, w, norm_weight).view(LAYERS * TOKENS, DIM) * 2.0

    args = _inputs(weights_shape=(DIM,))
    traced, rewritten, expected = _rewrite(merged, *args)
    assert rewritten == 1 and count_calls(traced.graph, aten.mean.dim) == LAYERS
    torch.testing.assert_close(traced(*args), expected, rtol=0, atol=0)


def test_weights_stacked_in_the_graph_give_each_layer_its_own():
    """`torch.stack(weights).view(L, 1, 1, D)` in the forward: each layer's operand is its own weight."""

    def one_norm(x, w, *weights):
        return _one_norm(x, w, torch.stack(weights).view(LAYERS, 1, 1, DIM))

    x, w, stacked = _inputs()
    weights = [row.flatten().clone() for row in stacked]
    traced, rewritten, expected = _rewrite(one_norm, x, w, *weights)
    assert rewritten == 1
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"][2:]
    muls = [n for n in traced.graph.nodes if n.target is aten.mul.Tensor]
    assert all(any(p in m.args for m in muls) for p in placeholders)  # each weight multiplies its layer
    for got, want in zip(traced(x, w, *weights), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("cut", ["chunk", "slice"])
def test_k_taken_by_a_one_wide_cut_squeezed(cut):
    """`kv.chunk(2, 0)[0].squeeze(0)` or `kv[0:1].squeeze(0)`: the same [L, T, H, D] K as `kv[0]`."""

    def one_norm(x, w, norm_weights):
        kv = (x @ w.t()).view(TOKENS, LAYERS, 2, HEADS, DIM).permute(2, 1, 0, 3, 4).contiguous()
        k = (kv.chunk(2, 0)[0] if cut == "chunk" else kv[0:1]).squeeze(0)
        return k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weights

    args = _inputs()
    traced, rewritten, expected = _rewrite(one_norm, *args)
    assert rewritten == 1 and count_calls(traced.graph, aten.mean.dim) == LAYERS
    torch.testing.assert_close(traced(*args), expected, rtol=0, atol=0)


def _norm_read_midway(x, w, norm_weights):
    k, _ = _layer_major_k(x, w)
    inv = torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)
    return k * inv * norm_weights, inv.sum()  # the inverse rms is read outside the chain


def _reduction_over_layers(x, w, norm_weights):
    k, _ = _layer_major_k(x, w)
    return k * torch.rsqrt(k.pow(2).mean(0, keepdim=True) + 1e-6) * norm_weights  # mixes layers


def _no_reduction(x, w, norm_weights):
    k, _ = _layer_major_k(x, w)
    return (k * 2.0 + 1.0) * norm_weights  # a scale: nothing norm-like to read per layer


def _operand_from_the_chain_start(x, w, norm_weights):
    k, _ = _layer_major_k(x, w)
    flipped = k.flip(0)  # layer L-1-i's values: slicing it at i would not give layer i's operand
    return k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * flipped


def _not_from_a_projection(x, w, norm_weights):
    k = (x.view(TOKENS, 2, 8).permute(1, 0, 2) * 1.0)[0:1].expand(LAYERS, TOKENS, 8)  # a select of no linear
    return k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)


def _batch_first(x, w, norm_weights):
    """[B, T', 2, H, D] with K taken by select: its first dim is a batch of tokens, not layers."""
    kv = (x @ w.t())[:, : 2 * HEADS * DIM].reshape(TOKENS, 1, 2, HEADS, DIM).permute(2, 0, 1, 3, 4).contiguous()
    k = kv[0]
    return k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weights[0]


@pytest.mark.parametrize(
    "fn",
    [_norm_read_midway, _reduction_over_layers, _no_reduction, _operand_from_the_chain_start, _not_from_a_projection, _batch_first],
)
def test_chains_that_do_not_keep_layers_apart_stay(fn):
    args = _inputs()
    traced, rewritten, expected = _rewrite(fn, *args)
    assert rewritten == 0
    for got, want in zip(traced(*args), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_many_tokens_are_proven_on_a_few():
    """1100 tokens: the layer axis is proven by replaying the views over a few tokens (probe_sizes)."""
    tokens = 1100

    def one_norm(x, w, norm_weights):
        k = (x @ w.t()).view(tokens, LAYERS, 2, HEADS, DIM).permute(2, 1, 0, 3, 4).contiguous()[0]
        return k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weights

    _, w, norm_weights = _inputs()
    x = torch.randn(tokens, 16)
    traced, rewritten, expected = _rewrite(one_norm, x, w, norm_weights)
    assert rewritten == 1
    torch.testing.assert_close(traced(x, w, norm_weights), expected, rtol=0, atol=0)


def test_a_failing_replay_leaves_the_graph_as_it_was(refuse_add_call):
    """An op the per-layer replay cannot build: nothing is rewritten, no node is left behind, no error."""
    from fx_fusion import layer_unstack

    refuse_add_call(layer_unstack, aten.cat.default)
    args = _inputs()
    traced = make_fx(_one_norm, tracing_mode="fake")(*args)
    before = [node.format_node() for node in traced.graph.nodes]
    assert unstack_layer_chains(traced.graph) == 0
    assert [node.format_node() for node in traced.graph.nodes] == before
