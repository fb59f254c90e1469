"""padded_linears: products that Inductor zero-padded to aligned shapes (its shape padding, which on CUDA it
chooses by timing) are read as the linears they compute, and fuse as the unpadded ones do."""

from __future__ import annotations

import os
import sys
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
import torch._inductor.config
import torch._inductor.decomposition
import torch.nn.functional as F
from torch import nn
from torch._inductor.fx_passes import pad_mm
from torch.fx.experimental.proxy_tensor import make_fx

import fx_fusion  # noqa: F401  (registers backend="fx_fusion")
from fx_fusion.diagnostics import RecordSink
from fx_fusion.padded_linears import padded_linear

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spelling_corpus  # noqa: E402
from test_spelling_corpus import assert_matches_eager, compile_and_run, describe, groups_and_rejections  # noqa: E402

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("fresh_compile")


@pytest.fixture
def inductor_pads_products():
    """Inductor's shape padding on every mm it may pad, here on CPU too: its CUDA-only device and Triton
    checks let through, and the timing vote forced (`force_shape_pad`). The graph the pass then sees is the
    one a CUDA compile gets where padding wins the timing."""
    with (
        mock.patch.object(pad_mm, "check_device", lambda a, b: True),
        mock.patch.object(pad_mm, "has_triton", lambda: True),
        torch._inductor.config.patch(force_shape_pad=True),
    ):
        yield


def _count(graph: torch.fx.Graph, target) -> int:
    return sum(1 for node in graph.nodes if node.op == "call_function" and node.target is target)


class UnalignedContext(nn.Module):
    """Three layers' K (per-head RMSNorm, rotate-half RoPE) and V, at sizes that pad in every dim of the
    product: 12 tokens, hidden 60, 2 heads x 18 features, with biases."""

    def __init__(self, layers=3, hidden=60, heads=2, head_dim=18):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.k_proj = nn.ModuleList(nn.Linear(hidden, heads * head_dim) for _ in range(layers))
        self.v_proj = nn.ModuleList(nn.Linear(hidden, heads * head_dim) for _ in range(layers))
        self.k_norm = nn.ParameterList(nn.Parameter(torch.rand(head_dim) + 0.5) for _ in range(layers))

    def forward(self, x, cos, sin):
        outs = []
        for k_proj, v_proj, weight in zip(self.k_proj, self.v_proj, self.k_norm):
            k = k_proj(x).view(x.shape[0], self.heads, self.head_dim).float()
            k = (weight * (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype))
            half = self.head_dim // 2
            rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
            outs += [k * cos[:, None] + rotated * sin[:, None], v_proj(x).view(x.shape[0], self.heads, -1)]
        return tuple(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_padded_projections_fuse_and_match_eager(inductor_pads_products, dtype):
    torch.manual_seed(0)
    module = UnalignedContext().to(dtype)
    angles = torch.arange(12.0)[:, None] * 0.3 ** torch.arange(9.0)
    cos, sin = (torch.cat([t, t], dim=-1).to(dtype) for t in (angles.cos(), angles.sin()))
    x = torch.randn(12, 60, dtype=dtype)
    records = []
    with RecordSink.collect(records, keep_graphs=True), torch.no_grad():
        got = torch.compile(module, backend="fx_fusion")(x, cos, sin)
        ref = module(x, cos, sin)
    assert_matches_eager(got, ref, dtype)
    (record,) = records
    before, after = record.full_graph_before, record.full_graph_after
    # every product was padded (6 x and 6 weights), its bias too (columns 36 -> 40)
    assert _count(before, aten.constant_pad_nd.default) == 12 and _count(before, aten.cat.default) >= 6, before
    (group,) = record.fused_groups
    assert group.n_layers == 3 and group.v_as_view == 3, record.summary()
    assert not record.rejected, record.summary()
    # the padded products are gone: nothing reads them once their cuts are rewritten
    assert _count(after, aten.constant_pad_nd.default) == 0 and _count(after, aten.mm.default) == 0, after


@pytest.mark.parametrize(
    "name",
    [
        "hf_qwen3_bias", "sglang_dflash_kv_proj_only_bias", "zlab_dflash_ctx_noise_cat",
        "dflash_projection_of_joined_rows",  # a padded linear over joined rows: read plain, run per piece
        "vllm_dflash_precompute_stacked_norms",
        # the canonical-form rewrites read a padded product as the linear it is
        "vllm_dflash_precompute_one_norm_stacked_weights", "vllm_dflash_precompute_one_norm_shared_weight",
        "vllm_dflash_precompute_chunked_kv", "sglang_stacked_kv_unbind",
    ],
)  # fmt: skip
def test_corpus_spellings_fuse_when_padded(inductor_pads_products, name):
    (case,) = [c for c in spelling_corpus.CASES if c.name == name]
    got, ref, fused_kv_pass = compile_and_run(case, torch.bfloat16)
    assert_matches_eager(got, ref, torch.bfloat16)
    groups, _ = groups_and_rejections(fused_kv_pass)
    assert any(g.n_layers >= spelling_corpus.N_LAYERS for g in groups), describe(fused_kv_pass)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "name", ["hf_qwen3_bias", "sglang_dflash_kv_proj_only_bias", "falcon_new_decoder_broadcast_k", "dflash_projection_of_joined_rows"]
)
def test_corpus_spellings_fuse_when_padded_on_cuda(name):
    """Inductor's own CUDA shape padding, forced instead of timed."""
    (case,) = [c for c in spelling_corpus.CASES if c.name == name]
    with torch._inductor.config.patch(force_shape_pad=True):
        got, ref, fused_kv_pass = compile_and_run(case, torch.bfloat16, "cuda")
    assert_matches_eager(got, ref, torch.bfloat16)
    groups, _ = groups_and_rejections(fused_kv_pass)
    assert any(g.n_layers >= spelling_corpus.N_LAYERS for g in groups), describe(fused_kv_pass)


def _graph(fn, *shapes) -> torch.fx.Graph:
    """`fn` traced to the ATen ops Inductor's graphs hold (t as permute, new_zeros as full, F.pad as
    constant_pad_nd)."""
    decompositions = torch._inductor.decomposition.select_decomp_table()
    return make_fx(fn, decompositions, tracing_mode="fake")(*(torch.randn(s) for s in shapes)).graph


def _cuts(graph: torch.fx.Graph) -> list:
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    return [padded_linear(node) for node in outputs]


def test_reads_the_linear_out_of_padded_products():
    def padded(x, w, b):
        product = torch.addmm(torch.cat([b, b.new_zeros(4)]), F.pad(x, (0, 2, 0, 3)), F.pad(w.t(), (0, 4, 0, 2)))
        return product[:-3, :-4], torch.mm(F.pad(x, (0, 0, 0, 3)), w.t())[:5], F.pad(x, (0, 0, 0, 3))[:5]

    graph = _graph(padded, (5, 6), (12, 6), (12,))
    x, w, b = (n for n in graph.nodes if n.op == "placeholder")
    with_bias, without_bias, not_a_product = _cuts(graph)
    assert with_bias.x2d is x and with_bias.rhs.args[0] is w and with_bias.bias is b
    assert without_bias.x2d is x and without_bias.bias is None
    assert not_a_product is None


@pytest.mark.parametrize(
    "cut",
    [
        lambda x, w: torch.mm(F.pad(x, (0, 0, 0, 3)), w.t())[1:6],  # other rows than x's
        lambda x, w: torch.mm(F.pad(x, (0, 0, 0, 3)), w.t())[:6],  # a padded row kept
        lambda x, w: torch.mm(F.pad(x, (0, 0, 3, 0)), w.t())[:5],  # zeros in front: rows shifted
        lambda x, w: torch.mm(F.pad(x, (0, 2, 0, 3), value=1.0), F.pad(w.t(), (0, 0, 0, 2)))[:5],  # ones
        lambda x, w: torch.mm(F.pad(x, (0, 0, 0, 3)), w.t())[:5:2],  # every other row
        lambda x, w: torch.mm(x, w.t())[:3],  # nothing padded
    ],
    ids=["offset", "padded-row-kept", "padded-in-front", "padded-with-ones", "strided", "unpadded"],
)
def test_other_cuts_are_not_read_as_linears(cut):
    (found,) = _cuts(_graph(lambda x, w: (cut(x, w),), (5, 6), (12, 6)))
    assert found is None


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.tuples(st.integers(1, 6), st.integers(1, 5), st.integers(1, 5)),
    pads=st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.integers(0, 2)),
    cut=st.tuples(st.integers(0, 2), st.integers(-3, 9), st.integers(0, 2), st.integers(-3, 9), st.integers(1, 2)),
    bias=st.booleans(),
    pad_value=st.sampled_from([0.0, 1.0]),
)
@example(sizes=(5, 4, 3), pads=(3, 2, 1, 0), cut=(0, 5, 0, 3, 1), bias=True, pad_value=0.0)
@example(sizes=(5, 4, 3), pads=(3, 0, 0, 0), cut=(0, -3, 0, 9, 1), bias=False, pad_value=0.0)
def test_a_cut_read_as_a_linear_holds_its_values(sizes, pads, cut, bias, pad_value):
    """Whatever the pads (at either end, zeros or not) and the cuts: when padded_linear reads a cut as
    x2d @ rhs + bias, the cut holds exactly those values."""
    m, k, n = sizes
    pad_m, pad_k, pad_n, pad_front = pads
    row_start, row_end, col_start, col_end, step = cut

    def product(x, w, b):
        padded_x = F.pad(x, (0, pad_k, pad_front, pad_m), value=pad_value)
        padded_w = F.pad(w.t(), (0, pad_n, 0, pad_k))
        out = torch.addmm(F.pad(b, (0, pad_n)), padded_x, padded_w) if bias else torch.mm(padded_x, padded_w)
        return (out[row_start:row_end:step, col_start:col_end],)

    decompositions = torch._inductor.decomposition.select_decomp_table()
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    traced = make_fx(product, decompositions, tracing_mode="fake")(x, w, b)
    (cut_node,) = next(n for n in traced.graph.nodes if n.op == "output").args[0]
    found = padded_linear(cut_node)
    rows = range(m + pad_front + pad_m)[row_start:row_end:step]
    cols = range(n + pad_n)[col_start:col_end]
    exact = rows == range(m) and cols == range(n) and pad_front == 0 and pad_value == 0.0
    if exact and (pad_m or pad_n) and (pad_m or pad_k or pad_n):
        assert found is not None  # what Inductor's padding writes is read (the cut drops padding)
    if found is None:
        return
    values = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            values[node] = super().run_node(node)
            return values[node]

    Recorder(traced).run(x, w, b)
    expected = values[found.x2d] @ values[found.rhs]
    if found.bias is not None:
        expected = expected + values[found.bias]
    torch.testing.assert_close(values[found.cut], expected, rtol=1e-5, atol=1e-5)
