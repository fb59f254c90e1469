"""batched_linears: einsum projections (a bmm of batch 1 over views, or the mm Inductor makes of it on a
GPU) are read as the linears they compute, and a bmm is put back as it was where nothing fused it."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from fx_fusion import batched_linears

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rewrite_checks import count_calls, traced_and_rewritten  # noqa: E402

aten = torch.ops.aten
HIDDEN, OUT = 16, 24


def _read(graph):
    return len(batched_linears.read_as_linears(graph))


def _inputs(*x_shape, transposed_weight=False):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*x_shape, generator=gen)
    return x, torch.randn(*((HIDDEN, OUT) if transposed_weight else (OUT, HIDDEN)), generator=gen)


def _linear_spellings():
    return {
        "ellipsis": (lambda x, w: torch.einsum("...i,oi->...o", x, w) * 2.0, (2, 5, HIDDEN)),
        "batched": (lambda x, w: torch.einsum("btd,nd->btn", x, w) + 1.0, (2, 5, HIDDEN)),
        "rows": (lambda x, w: torch.einsum("td,nd->tn", x, w).relu(), (5, HIDDEN)),
        "weight_first": (lambda x, w: torch.einsum("oi,...i->...o", w, x) * 3.0, (3, HIDDEN)),
        "selected_batch": (lambda x, w: torch.einsum("td,nd->tn", x[1], w) - 1.0, (2, 5, HIDDEN)),
        "transposed_input": (lambda x, w: torch.einsum("dt,nd->tn", x, w) * 2.0, (HIDDEN, 5)),
        "heads_in_the_equation": (lambda x, w: torch.einsum("btd,hkd->bthk", x, w.view(2, OUT // 2, HIDDEN)) + 1.0, (2, 5, HIDDEN)),
    }


def _bmm_as_inductor_leaves_it_on_a_gpu(graph):
    """Every batch-1 bmm replaced as Inductor's joint-graph pass replaces it on a GPU (`bmm_to_mm`): the mm
    of the operands squeezed, unsqueezed back."""
    for bmm in list(graph.find_nodes(op="call_function", target=aten.bmm.default)):
        with graph.inserting_before(bmm):
            a, b = (graph.call_function(aten.squeeze.dim, (arg, 0)) for arg in bmm.args)
            mm = graph.call_function(aten.mm.default, (a, b))
            back = graph.call_function(aten.unsqueeze.default, (mm, 0))
        for node in (a, b, mm, back):
            node.meta["val"] = node.target(*torch.fx.map_arg(node.args, lambda n: n.meta["val"]))
        bmm.replace_all_uses_with(back)
        graph.erase_node(bmm)


@pytest.mark.parametrize("name", list(_linear_spellings()))
def test_einsum_projection_becomes_an_mm_of_the_same_values(name):
    fn, x_shape = _linear_spellings()[name]
    traced, read, expected = traced_and_rewritten(_read, fn, *_inputs(*x_shape))
    assert read == 1
    assert count_calls(traced.graph, aten.bmm.default) == 0
    (mm,) = [n for n in traced.graph.nodes if n.target is aten.mm.default]
    weight = mm.args[1]
    assert weight.target is aten.permute.default and list(weight.args[1]) == [1, 0] and weight.args[0].op == "placeholder"
    got = traced(*_inputs(*x_shape))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.stride() == expected.stride()


def test_a_weight_stored_hidden_first_is_read_as_x_at_w():
    """`einsum("...i,io->...o", x, W)` with W [hidden, out]: read as `x @ W`, W as it is."""
    fn = lambda x, w: torch.einsum("...i,io->...o", x, w) * 2.0  # noqa: E731
    args = _inputs(2, 5, HIDDEN, transposed_weight=True)
    traced, read, expected = traced_and_rewritten(_read, fn, *args)
    assert read == 1
    (mm,) = [n for n in traced.graph.nodes if n.target is aten.mm.default]
    assert mm.args[1].op == "placeholder"
    torch.testing.assert_close(traced(*args), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(_linear_spellings()))
def test_the_mm_inductor_makes_of_it_on_a_gpu_becomes_a_linear_too(name):
    fn, x_shape = _linear_spellings()[name]

    def as_on_a_gpu_then_read(graph):
        _bmm_as_inductor_leaves_it_on_a_gpu(graph)
        read = batched_linears.read_as_linears(graph)
        assert batched_linears.restore(graph, read) == 0  # an mm stays an mm
        return len(read)

    traced, read, expected = traced_and_rewritten(as_on_a_gpu_then_read, fn, *_inputs(*x_shape))
    assert read == 1
    (mm,) = [n for n in traced.graph.nodes if n.target is aten.mm.default]
    assert mm.args[1].target is aten.permute.default and mm.args[1].args[0].op == "placeholder"
    got = traced(*_inputs(*x_shape))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.stride() == expected.stride()


@pytest.mark.parametrize("name", list(_linear_spellings()))
def test_restore_puts_the_bmm_back_with_bitwise_equal_results(name):
    fn, x_shape = _linear_spellings()[name]
    args = _inputs(*x_shape)

    def read_and_restore(graph):
        read = batched_linears.read_as_linears(graph)
        return batched_linears.restore(graph, read)

    traced, restored, expected = traced_and_rewritten(read_and_restore, fn, *args)
    assert restored == 1
    assert count_calls(traced.graph, aten.bmm.default) == 1 and count_calls(traced.graph, aten.mm.default) == 0
    (bmm,) = [n for n in traced.graph.nodes if n.target is aten.bmm.default]
    a, b = (arg.meta["val"] for arg in bmm.args)
    assert a.shape[0] == b.shape[0] == 1
    assert torch.equal(traced(*args), expected)


def test_nothing_restored_once_the_mm_is_read_by_nothing():
    def fuse_everything(graph):
        read = batched_linears.read_as_linears(graph)
        for linear in read:  # a fused group's stand-in: the mm's readers read another node, the mm is erased
            with graph.inserting_after(linear.mm):
                stand_in = graph.call_function(aten.mm.default, linear.mm.args)
            stand_in.meta["val"] = linear.mm.meta["val"]
            linear.mm.replace_all_uses_with(stand_in)
            graph.erase_node(linear.mm)
        return batched_linears.restore(graph, read)

    fn, x_shape = _linear_spellings()["batched"]
    traced, restored, expected = traced_and_rewritten(fuse_everything, fn, *_inputs(*x_shape))
    assert restored == 0
    assert count_calls(traced.graph, aten.bmm.default) == 0
    torch.testing.assert_close(traced(*_inputs(*x_shape)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "fn, x_shape, transposed_weight",
    [
        (lambda x, w: torch.einsum("bti,bsi->bts", x, x) + w.sum(), (1, 5, HIDDEN), False),  # no weight
        (lambda x, w: torch.einsum("bti,oi->bto", x, w.t().contiguous().t()), (1, 5, HIDDEN), False),  # copied
        (lambda x, w: torch.einsum("bti,oi->bto", x, w * 2.0), (2, 5, HIDDEN), False),  # computed weight
    ],
    ids=["attention_scores", "weight_copied", "weight_computed"],
)
def test_other_batched_products_stay(fn, x_shape, transposed_weight):
    args = _inputs(*x_shape, transposed_weight=transposed_weight)
    traced, read, expected = traced_and_rewritten(_read, fn, *args)
    assert read == 0
    assert count_calls(traced.graph, aten.mm.default) == 0
    assert torch.equal(traced(*args), expected)


class _EinsumDraftWithGate(torch.nn.Module):
    """Two layers' K (per-head RMSNorm, rotate-half RoPE) and V by einsum, and an einsum gate of another
    width that no group takes."""

    def __init__(self, heads=2, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        width = heads * head_dim
        self.wk = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(width, HIDDEN) / 4) for _ in range(2))
        self.wv = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(width, HIDDEN) / 4) for _ in range(2))
        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(head_dim, eps=1e-6) for _ in range(2))
        self.gate = torch.nn.Parameter(torch.randn(OUT + 8, HIDDEN) / 4)

    def forward(self, x, cos, sin):
        outs = [torch.einsum("btd,nd->btn", x, self.gate).relu()]
        for wk, wv, norm in zip(self.wk, self.wv, self.norms):
            k = norm(torch.einsum("btd,nd->btn", x, wk).unflatten(-1, (self.heads, self.head_dim)))
            half = self.head_dim // 2
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), -1) * sin
            outs += [k, torch.einsum("btd,nd->btn", x, wv)]
        return outs


def test_through_the_pass_fused_projections_lose_their_bmm_and_the_gate_keeps_its_own(fresh_compile):
    import fx_fusion

    torch.manual_seed(0)
    module = _EinsumDraftWithGate().eval()
    x = torch.randn(2, 5, HIDDEN)
    angles = torch.arange(5)[:, None] * torch.rand(4)
    cos, sin = (torch.cat((t, t), -1)[:, None, :] for t in (angles.cos(), angles.sin()))
    fused_kv_pass, counts = fx_fusion.FusedKVPass(inline_ops=False), {}  # the fused ops kept as calls

    def count_after(graph):
        fused_kv_pass(graph)
        counts.update(bmm=count_calls(graph, aten.bmm.default), mm=count_calls(graph, aten.mm.default))

    count_after.uuid = lambda: None
    with torch.no_grad():
        got = torch.compile(module, options={"post_grad_custom_post_pass": count_after})(x, cos, sin)
        ref = module(x, cos, sin)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=2e-5, atol=2e-5)
    groups = [g for record in fused_kv_pass.records for g in record.fused_groups]
    assert [g.n_layers for g in groups] == [2]
    assert counts["bmm"] == 1 and counts["mm"] == 0, counts  # the gate's bmm, as it was


@pytest.mark.parametrize("name", ["cs336_einsum_linear_pair_rope", "einsum_projections_qwen3_k_norm", "einsum_hidden_first_weights"])
def test_einsum_corpus_fuses_as_inductor_spells_it_on_a_gpu(name, monkeypatch, fresh_compile):
    """The corpus's einsum spellings with Inductor's joint-graph bmm-to-mm rewrite on (as on a GPU; here on
    CPU): all layers fuse and match eager."""
    import torch._inductor.fx_passes.joint_graph as joint_graph

    import spelling_corpus
    from test_spelling_corpus import assert_matches_eager, compile_and_run, describe, groups_and_rejections

    monkeypatch.setattr(joint_graph, "get_gpu_type", lambda: "cpu")
    (case,) = [c for c in spelling_corpus.CASES if c.name == name]
    got, ref, fused_kv_pass = compile_and_run(case, torch.float32)
    assert_matches_eager(got, ref, torch.float32)
    groups, _ = groups_and_rejections(fused_kv_pass)
    assert [g.n_layers for g in groups] == [spelling_corpus.N_LAYERS], describe(fused_kv_pass)
