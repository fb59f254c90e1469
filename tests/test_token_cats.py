"""token_cats: a concatenation of projections along tokens pushed down through per-token ops, exactly."""

from __future__ import annotations

import torch
from torch._inductor.decomposition import select_decomp_table
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


def _rms(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _rotate(k, cos, sin):
    return k * cos + torch.cat([-k[..., 4:], k[..., :4]], dim=-1) * sin


def _normed_pieces_joined(ctx, noise, w, norm_w, cos, sin):
    """SpecForge's order: each piece's K normalised on its own, joined along tokens, then the RoPE."""
    k_ctx = _rms((ctx @ w.t()).view(1, -1, 2, 8), norm_w)
    k_noise = _rms((noise @ w.t()).view(1, -1, 2, 8), norm_w)
    k = torch.cat([k_ctx, k_noise], dim=1).transpose(1, 2)
    return (_rotate(k, cos[None, None], sin[None, None]),)


def _rows_joined_before_the_projection(ctx, noise, w, norm_w, cos, sin):
    """Two layers, each one projection of [ctx; its noise] joined along tokens (batch 2), the norm over
    heads flattened to rows and viewed back; the flattened normalised K is read whole too."""
    batch, tokens = ctx.shape[0], ctx.shape[1] + noise.shape[1]
    outs = []
    for layer_noise in (noise, 2 * noise):
        rows = torch.cat([ctx, layer_noise], dim=1)
        k = (rows.view(-1, rows.shape[-1]) @ w.t()).view(batch, tokens, 2, 8)
        flat = _rms(k.reshape(-1, 8), norm_w)
        k = flat.view(batch, tokens, 2, 8).transpose(1, 2)
        outs += [_rotate(k, cos[None, None], sin[None, None]), flat]
    return tuple(outs)


def _batched_inputs():
    generator = torch.Generator().manual_seed(1)
    shapes = [(2, 5, 12), (2, 3, 12), (16, 12), (8,), (8, 8), (8, 8)]
    return [torch.randn(s, generator=generator) for s in shapes]


def _pushed(fn, inputs):
    traced = make_fx(fn, tracing_mode="fake")(*inputs)
    expected = traced(*inputs)
    pushed = push_token_cats(traced.graph)
    traced.graph.eliminate_dead_code()
    traced.graph.lint()
    traced.recompile()
    for got, want in zip(traced(*inputs), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    return traced, pushed


def test_pieces_normalised_on_their_own_are_pushed_through_the_rope():
    traced, pushed = _pushed(_normed_pieces_joined, _inputs())
    assert pushed == 1
    for node in traced.graph.nodes:  # the RoPE's products run per piece: no cat along tokens feeds them
        if node.target is aten.mul.Tensor:
            assert not any(a.target is aten.cat.default and a.args[1] in (1, 2) for a in node.all_input_nodes if a.op == "call_function")


def test_a_projection_of_joined_rows_runs_per_piece_through_a_flattened_norm():
    inputs = _batched_inputs()
    before = make_fx(_rows_joined_before_the_projection, tracing_mode="fake")(*inputs)
    traced, pushed = _pushed(_rows_joined_before_the_projection, inputs)
    assert pushed == 2
    # one product per piece, each over that piece's rows only; the norm runs per piece too
    assert _count(traced.graph, aten.mm.default) == 2 * _count(before.graph, aten.mm.default) == 4
    assert _count(traced.graph, aten.rsqrt.default) == 4
    for node in traced.graph.nodes:
        if node.target is aten.mm.default:
            assert node.args[0].meta["val"].shape[0] in (2 * 5, 2 * 3)


def test_a_cat_of_rows_for_one_projection_that_shares_no_piece_is_left_alone():
    """A batch joined for one linear (nothing to group across layers): splitting it would only add GEMMs."""

    def one(a, b, w):
        return (torch.cat([a, b], dim=0) @ w.t()).relu()

    traced = make_fx(one, tracing_mode="fake")(torch.randn(3, 4), torch.randn(2, 4), torch.randn(5, 4))
    nodes = len(traced.graph.nodes)
    assert push_token_cats(traced.graph) == 0
    assert len(traced.graph.nodes) == nodes


def test_a_push_that_fails_leaves_the_graph_as_it_was(monkeypatch):
    from fx_fusion import token_cats

    def broken(self, node):
        raise RuntimeError("a graph shape not foreseen")

    monkeypatch.setattr(token_cats._Pusher, "push", broken)
    traced = make_fx(_per_token_after_cat, tracing_mode="fake")(*_inputs())
    code = traced.code
    assert push_token_cats(traced.graph) == 0
    traced.recompile()
    assert traced.code == code


def _layers_merged_into_rows(x, w, norm_w, table, positions):
    """vLLM's DFlash precompute: one linear over weights stacked for every layer, layer-major K, each
    layer's K normed on its own and stacked, then one rotation over all layers' rows ([L * T, H, D]) with
    the table gathered at `positions.repeat(L)`."""
    tokens, n_layers = x.shape[0], norm_w.shape[0]
    kv = (x @ w.t()).view(tokens, n_layers, 2, 2, 8).permute(2, 1, 0, 3, 4).contiguous()
    k = torch.stack([kv[0][i] * torch.rsqrt(kv[0][i].pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w[i] for i in range(n_layers)])
    rows = k.view(n_layers * tokens, 16).view(n_layers * tokens, 2, 8)
    cos, sin = table[positions.repeat(n_layers)].chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotated = torch.cat([rows[..., :4] * cos - rows[..., 4:] * sin, rows[..., 4:] * cos + rows[..., :4] * sin], dim=-1)
    return rotated.view(n_layers, tokens, 2, 8), kv[1]


def _merged_rows_inputs(tokens=5):
    generator = torch.Generator().manual_seed(1)
    x, w, norm_w, table = (torch.randn(s, generator=generator) for s in [(tokens, 12), (96, 12), (3, 8), (20, 8)])
    return x, w, norm_w, table, torch.randperm(20, generator=generator)[:tokens]


def test_layers_merged_into_rows_rotate_each_layer_with_the_rows_of_the_repeated_table():
    inputs = _merged_rows_inputs()  # traced with Inductor's decompositions: torch.stack as a cat and a view
    traced = make_fx(_layers_merged_into_rows, tracing_mode="fake", decomposition_table=select_decomp_table())(*inputs)
    expected = traced(*inputs)

    assert push_token_cats(traced.graph) == 1
    traced.graph.eliminate_dead_code()
    traced.graph.lint()
    traced.recompile()

    # each layer's rows gather the table at the positions themselves: the repeat and every cut of the
    # gathered rows are gone, so all layers read one value (what lets them share one fused op's cos/sin)
    row_cuts = [n for n in traced.graph.nodes if n.target is aten.slice.Tensor and n.args[1] == 0]
    assert _count(traced.graph, aten.repeat.default) == 0 and not row_cuts
    gathers = [n for n in traced.graph.nodes if n.target is aten.index.Tensor]
    assert len(gathers) == 3 and all(n.args[1][0].op == "placeholder" for n in gathers)
    for got, want in zip(traced(*inputs), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rows_that_are_no_block_of_the_repeat_are_cut_from_it():
    """Pieces of 5 and 3 rows over `positions.repeat(2)` of 4 positions: no piece is one repeat, so each
    piece's rows are cut from the gathered table, exactly."""

    def uneven(ctx, noise, w, table, positions):
        k = torch.cat([ctx @ w.t(), noise @ w.t()]).view(8, 2, 8)
        cos = table[positions.repeat(2)].unsqueeze(-2)
        return k * cos + k

    generator = torch.Generator().manual_seed(2)
    inputs = [torch.randn(s, generator=generator) for s in [(5, 12), (3, 12), (16, 12), (20, 8)]] + [torch.arange(4) * 3]
    traced = make_fx(uneven, tracing_mode="fake")(*inputs)
    expected = traced(*inputs)
    assert push_token_cats(traced.graph) == 1
    traced.graph.eliminate_dead_code()
    traced.recompile()
    row_cuts = [n for n in traced.graph.nodes if n.target is aten.slice.Tensor and n.args[1] == 0]
    assert _count(traced.graph, aten.repeat.default) == 1 and len(row_cuts) == 2
    torch.testing.assert_close(traced(*inputs), expected, rtol=0, atol=0)
