"""FusedKVPass and the fx_fusion backend on real Hugging Face attention blocks (small random configs)."""

from __future__ import annotations

import collections
import io
import pickle
import re

import pytest
import torch
import torch._inductor.utils
from hypothesis import given, settings
from hypothesis import strategies as st
import torch._dynamo.testing
import torch._functorch.config
from torch import nn
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

import fx_fusion
from fx_fusion import cuda_graphs, drafts, kv_patterns
from fx_fusion.kernels import grouped_gemm_tma, grouped_gemv
from fx_fusion.memo import OutcomeMemo
from fx_fusion.diagnostics import RecordSink

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
aten = torch.ops.aten
PROJECTION_OPS = (aten.mm.default, aten.addmm.default)
FUSED_OP = torch.ops.fx_fusion.materialize_k.default
GROUPED_GEMM = torch.ops.fx_fusion.grouped_linear.default


pytestmark = pytest.mark.usefixtures("fresh_compile")


class CountingPass(fx_fusion.FusedKVPass):
    """FusedKVPass that counts op targets in the graph before and after it runs.

    It keeps the fused op calls in the graph (inline_ops=False) unless told otherwise, so that they can be
    counted; tests through the backend check the inlined form."""

    def __init__(self, **kwargs):
        kwargs.setdefault("inline_ops", False)
        super().__init__(**kwargs)

    def __call__(self, graph):
        self.before = collections.Counter(n.target for n in graph.nodes if n.op == "call_function")
        super().__call__(graph)
        self.after = collections.Counter(n.target for n in graph.nodes if n.op == "call_function")
        self.norm_weights = [n.args[1] for n in graph.nodes if n.target == FUSED_OP]  # each call's k_norm_weight


def assert_close_outputs(got, ref, dtype):
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        else:
            err = (g.double() - r.double()).norm() / r.double().norm()
            assert err < 1e-2, err


def only_fused_groups(records) -> list:
    """The fused groups of every record; the message lists what each pass run decided."""
    groups = [group for record in records for group in record.fused_groups]
    assert groups, f"nothing fused in {len(records)} pass run(s): " + " | ".join(r.summary() for r in records)
    return groups


def compile_counting(module, **kwargs):
    counting = CountingPass(**kwargs)
    return torch.compile(module, options={"post_grad_custom_post_pass": counting}), counting


def check_compiled_matches_eager(module, *inputs, dtype=torch.float32) -> CountingPass:
    """Compile `module` with the (counting) pass under no_grad, compare with eager; return the pass."""
    with torch.no_grad():
        ref = module(*inputs)
        compiled, counting = compile_counting(module)
        got = compiled(*inputs)
    assert_close_outputs(got, ref, dtype)
    return counting


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("n_layers", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_kv_fused_and_exact(device, family, n_layers, dtype):
    factory = drafts.qwen3_context_kv if family == "qwen3" else drafts.llama_context_kv
    module = factory(n_layers, dtype=dtype, device=device)
    counting = check_compiled_matches_eager(module, *drafts.example_inputs(module, batch=2, seq_len=7), dtype=dtype)
    (record,) = counting.records
    assert len(record.fused_groups) == 1 and not record.rejected
    group = record.fused_groups[0]
    assert (group.n_layers, group.num_kv_heads, group.head_dim, group.rotary_dim) == (n_layers, 2, 32, 32)
    assert group.k_norm == (family == "qwen3") and group.rotary_style == "neox" and group.v_as_view == n_layers
    assert sum(counting.before[op] for op in PROJECTION_OPS) == 2 * n_layers
    assert sum(counting.after[op] for op in PROJECTION_OPS) == 0
    assert counting.after[FUSED_OP] == 1 and counting.after[GROUPED_GEMM] == 1
    assert counting.after[aten.rsqrt.default] == 0 and counting.after[aten.neg.default] == 0
    # The HF rotary angles' outer-product bmm becomes a multiply (on CPU, Inductor decomposes it earlier).
    assert group.rotary_matmuls_as_mul == (1 if device == "cuda" else 0)
    assert counting.after[aten.bmm.default] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_bias_through_backend(device):
    """Qwen2-style K/V bias through the registered backend; V outputs are views of the stacked GEMM."""
    module = drafts.qwen3_context_kv(3, attention_bias=True, device=device)
    inputs = drafts.example_inputs(module, seq_len=5)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        ref = module(*inputs)
        got = torch.compile(module, backend="fx_fusion")(*inputs)
    assert_close_outputs(got, ref, torch.float32)
    (group,) = records[0].fused_groups
    assert group.bias and group.n_layers == 3


def rotate(x, interleaved):
    """sign(i) * x[partner(i)]: GPT-J pairs when interleaved, else neox rotate-half."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FusedKVLinearContext(nn.Module):
    """Each layer projects K and V with ONE linear ([2*kv, hidden]) and slices it; partial rotary."""

    def __init__(self, n_layers=3, hidden=48, heads=2, head_dim=16, rotary_dim=8, interleaved=False, q_size=0):
        super().__init__()
        self.heads, self.head_dim, self.rotary_dim, self.interleaved = heads, head_dim, rotary_dim, interleaved
        self.q_size = q_size  # > 0: a fused qkv linear, Q first (returned untouched)
        width = q_size + 2 * heads * head_dim
        self.kv = nn.ModuleList([nn.Linear(hidden, width, bias=False) for _ in range(n_layers)])
        self.norms = nn.ModuleList([Qwen3RMSNorm(head_dim, eps=1e-5) for _ in range(n_layers)])
        for norm in self.norms:
            nn.init.normal_(norm.weight, 1.0, 0.2)

    def rotate(self, x):
        return rotate(x, self.interleaved)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        kv_size = self.heads * self.head_dim
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        outs = []
        for kv_proj, norm in zip(self.kv, self.norms):
            qkv = kv_proj(x)
            if self.q_size:
                outs.append(qkv[..., : self.q_size])
            kv = qkv[..., self.q_size :]
            k = norm(kv[..., :kv_size].view(B, T, self.heads, self.head_dim)).transpose(1, 2)
            v = kv[..., kv_size:].view(B, T, self.heads, self.head_dim).transpose(1, 2)
            k_rot, k_pass = k[..., : self.rotary_dim], k[..., self.rotary_dim :]
            k = torch.cat((k_rot * cos + self.rotate(k_rot) * sin, k_pass), dim=-1)
            outs += [k, v]
        return tuple(outs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved, q_size", [(False, 0), (True, 0), (False, 32)])
def test_fused_kv_linear_partial_and_interleaved_rotary(device, interleaved, q_size):
    torch.manual_seed(0)
    module = FusedKVLinearContext(interleaved=interleaved, q_size=q_size).to(device)
    x, cos, sin = (torch.randn(2, 5, n, device=device) for n in (48, 8, 8))
    counting = check_compiled_matches_eager(module, x, cos, sin)
    (group,) = counting.records[0].fused_groups
    assert group.rotary_dim == 8 and group.rotary_style == ("interleaved" if interleaved else "neox")
    assert group.v_as_view == 0  # V comes from the same fused linears: no extra projections
    assert sum(counting.after[op] for op in PROJECTION_OPS) == 0 and counting.after[FUSED_OP] == 1


class VariantContext(nn.Module):
    """A Qwen3-like context module whose LAST layer deviates from the others in one way."""

    def __init__(self, variant: str, n_layers=3, hidden=64, heads=2, head_dim=32):
        super().__init__()
        config = Qwen3Config(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=heads, head_dim=head_dim)
        self.variant, self.heads, self.head_dim = variant, heads, head_dim
        self.rotary = Qwen3RotaryEmbedding(config)
        config_other = Qwen3Config(
            hidden_size=hidden, num_attention_heads=4, num_key_value_heads=heads, head_dim=head_dim, rope_theta=10.0
        )
        self.other_rotary = Qwen3RotaryEmbedding(config_other)
        last_dim = head_dim // 2 if variant == "head_dim" else head_dim
        dims = [head_dim] * (n_layers - 1) + [last_dim]
        self.dims = dims
        self.k = nn.ModuleList([nn.Linear(hidden, heads * d, bias=False) for d in dims])
        self.v = nn.ModuleList([nn.Linear(hidden, heads * d, bias=False) for d in dims])
        self.norms = nn.ModuleList([Qwen3RMSNorm(d) for d in dims])
        self.whole_norm = Qwen3RMSNorm(heads * head_dim)
        self.layer_norm = nn.LayerNorm(head_dim)
        config_small = Qwen3Config(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=heads, head_dim=last_dim)
        self.small_rotary = Qwen3RotaryEmbedding(config_small)

    def last_norm(self, k):
        if self.variant == "whole_projection_norm":
            B, T = k.shape[:2]
            return self.whole_norm(k.reshape(B, T, -1)).view(B, T, self.heads, self.head_dim)
        if self.variant == "layer_norm":
            return self.layer_norm(k)
        if self.variant == "eps_outside":
            x = k.float()
            return (self.norms[-1].weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) + 1e-6)).to(k.dtype)
        return self.norms[-1](k)

    def forward(self, x, position_ids):
        B, T, _ = x.shape
        cos, sin = self.rotary(x, position_ids)
        outs = []
        for i, (k_proj, v_proj, norm, d) in enumerate(zip(self.k, self.v, self.norms, self.dims)):
            last = i == len(self.dims) - 1
            k = k_proj(x).view(B, T, self.heads, d)
            k = (self.last_norm(k) if last else norm(k)).transpose(1, 2)
            c, s = cos, sin
            if last and self.variant == "other_cos_sin":
                c, s = self.other_rotary(x, position_ids)
            if last and self.variant == "head_dim":
                c, s = self.small_rotary(x, position_ids)
            _, k = apply_rotary_pos_emb(k, k, c, s)
            outs += [k, v_proj(x).view(B, T, self.heads, d).transpose(1, 2)]
        return tuple(outs)


@pytest.mark.parametrize(
    "variant, reason",
    [
        ("whole_projection_norm", "RMSNorm over the whole projection (64 features), not per head (32)"),
        ("layer_norm", "subtracts the mean (LayerNorm), not an RMSNorm"),
        ("eps_outside", "eps sits elsewhere"),
    ],
)
def test_deviating_layer_left_alone_with_reason(variant, reason):
    torch.manual_seed(0)
    module = VariantContext(variant)
    x, positions = torch.randn(1, 6, 64), torch.arange(6)[None] + 2  # CPU only: graph structure, not device
    counting = check_compiled_matches_eager(module, x, positions)
    (record,) = counting.records
    assert [g.n_layers for g in record.fused_groups] == [2]
    k_reasons = [r for r in record.rejected if not r.reason.startswith("left as a plain linear")]
    assert len(k_reasons) == 1, record.rejected
    assert reason in k_reasons[0].reason
    assert "k.2" in k_reasons[0].location
    # a same-width projection left unfused (here the deviating layer's V) is reported too
    assert all("v.2" in r.location for r in record.rejected if r not in k_reasons)
    # the deviating layer keeps its own K branch (its rotary's neg); its projections join the stacked GEMM
    # when they have the group's width, as any linear on the same input does
    assert counting.after[aten.neg.default] == 1 and counting.after[FUSED_OP] == 1
    assert sum(counting.after[op] for op in PROJECTION_OPS) == 0


def test_head_axis_may_repeat_each_head_in_a_row():
    """Heads broadcast to query heads (`k.expand(B, T, kv, r, D).reshape(B, T, kv * r, D)`) repeat each head
    r times in a row: still one head axis. Heads tiled in another order, or more head values than heads,
    are not."""
    def laid_out(heads: torch.Tensor) -> torch.Tensor:  # [tokens, heads, head_dim], heads on axis 1
        return heads.view(1, -1, 1).expand(2, -1, 4)

    assert kv_patterns._enumerating_axis(laid_out(torch.arange(3).repeat_interleave(2)), 3) == 1
    assert kv_patterns._enumerating_axis(laid_out(torch.arange(3)), 3) == 1
    assert kv_patterns._enumerating_axis(laid_out(torch.zeros(4, dtype=torch.int64)), 1) is None
    for heads, count in [(torch.arange(3).repeat(2), 3), (torch.arange(3).repeat_interleave(2), 2)]:
        with pytest.raises(kv_patterns.NoMatch, match="not laid out along one axis"):
            kv_patterns._enumerating_axis(laid_out(heads), count)


class SharedInputQK(nn.Module):
    """Every layer's Q (4 heads) and K (2 heads) projected from the same hidden states, each normalised
    (Qwen3 q_norm / k_norm) and rotated."""

    def __init__(self, n_layers=3):
        super().__init__()
        config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i).self_attn for i in range(n_layers))
        self.rotary = Qwen3RotaryEmbedding(config)
        for name, param in self.named_parameters():
            if "norm" in name:
                nn.init.uniform_(param, 0.5, 1.5)

    def forward(self, x, position_ids):
        B, T, _ = x.shape
        cos, sin = self.rotary(x, position_ids)
        outs = []
        for attn in self.layers:
            q = attn.q_norm(attn.q_proj(x).view(B, T, -1, 16)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(x).view(B, T, -1, 16)).transpose(1, 2)
            outs += list(apply_rotary_pos_emb(q, k, cos, sin)) + [attn.v_proj(x)]
        return tuple(outs)


@pytest.mark.parametrize("n_layers", [3, 6])
def test_all_layers_q_and_k_of_one_input_fuse_as_blocks_of_heads(n_layers):
    """All layers' Q and K read one input: one group, the projections side by side in one grouped GEMM
    (Q_0, K_0, Q_1, ...) so that their heads are evenly spaced blocks of gcd(4, 2) = 2 heads. The op reads
    each block's norm weight where it is (Q's q_norm for both of its blocks), up to 16 blocks; past that
    (6 layers: 18 blocks) from a table the graph gathers."""
    torch.manual_seed(0)
    module = SharedInputQK(n_layers)
    x, positions = torch.randn(2, 5, 64), torch.arange(5)[None] + 1
    counting = check_compiled_matches_eager(module, x, positions)
    (record,) = counting.records
    (group,) = record.fused_groups
    assert (group.n_layers, group.num_kv_heads, group.layer_heads) == (2 * n_layers, 2, [4, 2] * n_layers), record
    (norm_weights,) = counting.norm_weights
    if n_layers == 3:
        assert all(w.op == "placeholder" for w in norm_weights) and len(norm_weights) == 9
        assert [norm_weights.index(w) for w in norm_weights] == [0, 0, 2, 3, 3, 5, 6, 6, 8]
    else:
        (table,) = norm_weights
        assert table.target == aten.cat.default and table.meta["val"].shape == (18, 16)
    assert not record.rejected, record.rejected
    assert counting.after[FUSED_OP] == 1 and counting.after[GROUPED_GEMM] == 1
    # every Q and K [B, heads, T, D] is one strided view of the token-major output (no reshape to copy)
    views = 2 * n_layers
    assert group.strided_views == views and counting.after[aten.as_strided.default] == views, record
    assert sum(counting.after[op] for op in PROJECTION_OPS) == 0 and counting.after[aten.rsqrt.default] == 0


@pytest.mark.parametrize("batch", [1, 2])
def test_q_and_k_with_dynamic_shapes_are_strided_views(batch):
    """With dynamic shapes a batch's stride is symbolic (tokens per sequence times the row width): Q and K
    are still strided views of the op's output, their sizes and that stride spelled from the graph's
    symbol inputs (at batch 1 the stride of a dim of size one is never stepped). Both match eager."""
    torch.manual_seed(0)
    module = SharedInputQK()
    x, positions = torch.randn(batch, 5, 64), torch.arange(5)[None] + 1
    with torch.no_grad():
        expected = module(x, positions)
        counting = CountingPass()
        compiled = torch.compile(module, dynamic=True, options={"post_grad_custom_post_pass": counting})
        assert_close_outputs(compiled(x, positions), expected, torch.float32)
    (record,) = counting.records
    (group,) = record.fused_groups
    assert group.strided_views == 6 and counting.after[aten.as_strided.default] == 6, record


def test_layer_with_other_head_dim_fuses_in_a_group_of_its_own():
    """A layer with the math but another head_dim cannot join the others' group: it forms its own (K and
    V of that layer in a grouped GEMM of their own), so every layer is fused; with min_layers=2 it is left
    alone, and the reason names the difference."""
    torch.manual_seed(0)
    module = VariantContext("head_dim")
    x, positions = torch.randn(1, 6, 64), torch.arange(6)[None] + 2
    counting = check_compiled_matches_eager(module, x, positions)
    (record,) = counting.records
    assert [(g.n_layers, g.head_dim) for g in record.fused_groups] == [(2, 32), (1, 16)], record
    assert not [r for r in record.rejected], record.rejected
    assert counting.after[FUSED_OP] == 2 and counting.after[GROUPED_GEMM] == 2
    assert sum(counting.after[op] for op in PROJECTION_OPS) == 0 and counting.after[aten.neg.default] == 0
    with torch.no_grad():
        compiled, counting = compile_counting(module, min_layers=2)
        torch.testing.assert_close(compiled(x, positions), module(x, positions))
    (record,) = counting.records
    assert [g.n_layers for g in record.fused_groups] == [2]
    (reason,) = [r for r in record.rejected if not r.reason.startswith("left as a plain linear")]
    assert "k.2" in reason.location and reason.reason.startswith("differs from the fused group in head_dim"), reason
    assert "on its own: only 1 matching layer(s) share this input; min_layers=2" in reason.reason, reason


def test_layer_with_its_own_cos_sin_fuses_with_per_layer_tables():
    """A layer whose rotary embedding has another rope_theta joins the group; the fused op reads one
    cos/sin table per layer, so every layer keeps its own rotation."""
    torch.manual_seed(0)
    module = VariantContext("other_cos_sin")
    x, positions = torch.randn(1, 6, 64), torch.arange(6)[None] + 2
    counting = check_compiled_matches_eager(module, x, positions)
    (record,) = counting.records
    (group,) = record.fused_groups
    assert group.n_layers == 3 and group.rotary_tables == "per-layer cos/sin", record
    assert counting.after[FUSED_OP] == 1 and counting.after[aten.neg.default] == 0


def test_a_repeated_rotary_region_is_identified_once(monkeypatch):
    """Layers that spell one rotary region alike are identified by probing once (the outcome is keyed by
    the region's ops, arguments and shapes), and every layer still gets its own tables and output."""
    from fx_fusion import rotary_action

    identified = []
    identify_on = rotary_action._identify_on
    monkeypatch.setattr(rotary_action, "_IDENTIFIED", OutcomeMemo(rotary_action._IDENTIFIED.errors))
    monkeypatch.setattr(rotary_action, "_identify_on", lambda probe: identified.append(probe) or identify_on(probe))
    module = drafts.qwen3_context_kv(4)
    inputs = drafts.example_inputs(module, seq_len=6)
    records = []
    with torch.no_grad(), RecordSink.collect(records), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        assert_close_outputs(torch.compile(module, backend="fx_fusion")(*inputs), module(*inputs), torch.float32)
    (group,) = only_fused_groups(records)
    assert group.n_layers == 4
    assert len(identified) == 1


def test_a_repeated_head_layout_is_simulated_once(monkeypatch):
    """Layers that lay K out alike are simulated once (keyed by plain data: the layout ops, their arguments
    and shapes, the source and the norm), a differently laid out draft gets its own simulation, and each
    compile still matches eager."""
    simulated = []
    simulate_heads = kv_patterns._simulate_heads
    monkeypatch.setattr(kv_patterns, "_HEAD_LAYOUTS", OutcomeMemo(kv_patterns._HEAD_LAYOUTS.errors))
    monkeypatch.setattr(kv_patterns, "_simulate_heads", lambda *args: simulated.append(args) or simulate_heads(*args))
    records = []
    for build in (drafts.qwen3_context_kv, drafts.llama_context_kv):  # llama: no K norm between the views
        module = build(4)
        inputs = drafts.example_inputs(module, seq_len=6)
        with torch.no_grad(), RecordSink.collect(records), torch._inductor.config.patch(fx_graph_cache=False):
            torch._dynamo.reset()
            assert_close_outputs(torch.compile(module, backend="fx_fusion")(*inputs), module(*inputs), torch.float32)
    assert [g.n_layers for g in only_fused_groups(records)] == [4, 4]
    assert len(simulated) == 2 and len(kv_patterns._HEAD_LAYOUTS) == 2

    def plain(x):
        return all(map(plain, x)) if isinstance(x, tuple) else not isinstance(x, (torch.fx.Node, torch.Tensor))

    assert all(plain(key) for key in kv_patterns._HEAD_LAYOUTS)


class _LateTables(nn.Module):
    """K/V of a few layers over one input, each layer computing its cos/sin itself after its projections
    (the fused group's tables are then an input that comes after the first layer's projections)."""

    def __init__(self, n_layers: int = 3, hidden: int = 64, heads: int = 2, head_dim: int = 16):
        super().__init__()
        self.k = nn.ModuleList(nn.Linear(hidden, heads * head_dim, bias=False) for _ in range(n_layers))
        self.v = nn.ModuleList(nn.Linear(hidden, heads * head_dim, bias=False) for _ in range(n_layers))
        self.heads, self.head_dim = heads, head_dim
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))

    def forward(self, x, positions):
        outs = []
        for k_proj, v_proj in zip(self.k, self.v):
            k = k_proj(x).view(*x.shape[:-1], self.heads, self.head_dim)
            v = v_proj(x)
            angles = positions[..., None].float() * self.inv_freq
            emb = torch.cat([angles, angles], dim=-1)[..., None, :]
            outs += [k * emb.cos() + rotate(k, False) * emb.sin(), v]
        return tuple(outs)


def test_rewrite_keeps_graph_order_without_a_sort(monkeypatch):
    """The replacement is built in order before the group's first projection, with inputs formed later
    (tables a layer computes after its projections) moved there first: no graph-wide sort. When they cannot
    move, it goes after the last input and the graph is sorted; every case matches eager."""
    from fx_fusion import fused_kv_pass

    sorts = []
    sort = fused_kv_pass.stable_topological_sort
    monkeypatch.setattr(fused_kv_pass, "stable_topological_sort", lambda graph: sorts.append(graph) or sort(graph))

    class LintingPass(CountingPass):
        def __call__(self, graph):
            super().__call__(graph)
            graph.lint()  # every node after its inputs

    late_inputs = (torch.randn(1, 5, 64), torch.arange(5)[None])
    cases = [
        (drafts.qwen3_context_kv(3), drafts.example_inputs(drafts.qwen3_context_kv(3), seq_len=5), True, 0),
        (_LateTables(), late_inputs, True, 0),
        (_LateTables(), late_inputs, False, 1),
    ]
    for module, inputs, can_move, expected_sorts in cases:
        sorts.clear()
        if not can_move:
            monkeypatch.setattr(kv_patterns, "hoist_before", lambda anchor, nodes: False)
        counting = LintingPass()
        with torch.no_grad():
            torch._dynamo.reset()
            ref = module(*inputs)
            got = torch.compile(module, options={"post_grad_custom_post_pass": counting})(*inputs)
        assert_close_outputs(got, ref, torch.float32)
        assert only_fused_groups(counting.records)[0].n_layers == 3
        assert len(sorts) == expected_sorts


def test_rewrite_builds_no_reshape_of_a_reshape():
    """Reshapes the rewrite builds one after another (a branch's output re-laid out as the original) are
    one reshape: no new reshape reads another new reshape that only it reads."""
    reshapes = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)

    class NewNodesPass(CountingPass):
        def __call__(self, graph):
            old = set(graph.nodes)
            super().__call__(graph)
            self.new = [n for n in graph.nodes if n not in old]

    module = drafts.qwen3_context_kv(3)
    inputs = drafts.example_inputs(module, seq_len=5)
    counting = NewNodesPass()
    with torch.no_grad():
        got = torch.compile(module, options={"post_grad_custom_post_pass": counting})(*inputs)
    assert_close_outputs(got, module(*inputs), torch.float32)
    new = set(counting.new)
    new_reshapes = [n for n in counting.new if n.target in reshapes]
    assert new_reshapes  # the branch outputs are laid out with reshapes
    chained = [n for n in new_reshapes if n.args[0] in new and n.args[0].target in reshapes and len(n.args[0].users) == 1]
    assert not chained, [n.format_node() for n in chained]


def test_erase_unused_removes_only_what_nothing_reads():
    graph = torch.fx.Graph()
    x, cache = graph.placeholder("x"), graph.placeholder("cache")
    shared = graph.call_function(aten.neg.default, (x,))
    replaced = graph.call_function(aten.mul.Tensor, (graph.call_function(aten.exp.default, (shared,)), 2))
    kept = graph.call_function(aten.sin.default, (shared,))
    written = graph.call_function(aten.copy_.default, (cache, shared))  # an effect: never erased
    graph.output((kept,))
    kv_patterns.erase_unused([replaced, written, x])
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [
        aten.neg.default, aten.sin.default, aten.copy_.default,
    ]  # fmt: skip
    graph.lint()


def test_a_cut_reader_that_fails_leaves_the_projection_read_whole(monkeypatch, fresh_compile):
    """An error while reading a projection's cuts (a layout nothing foresaw) never fails the compile: each
    projection is read whole (separate K projections still fuse) and the results are eager's."""

    def unforeseen(projection):
        raise IndexError("unforeseen layout")

    monkeypatch.setattr(kv_patterns, "branch_sources", unforeseen)
    module = drafts.qwen3_context_kv(3)
    inputs = drafts.example_inputs(module, seq_len=4)
    with torch.no_grad():
        compiled, counting = compile_counting(module)
        assert_close_outputs(compiled(*inputs), module(*inputs), torch.float32)
    assert [g.n_layers for g in counting.records[0].fused_groups] == [3]


def test_single_layer_fused_by_default_and_min_layers_leaves_it_alone():
    module = drafts.qwen3_context_kv(1)
    inputs = drafts.example_inputs(module, seq_len=4)
    with torch.no_grad():
        ref = module(*inputs)
        compiled, counting = compile_counting(module)
        assert_close_outputs(compiled(*inputs), ref, torch.float32)
        assert counting.records[0].fused_groups[0].n_layers == 1
        torch._dynamo.reset()
        compiled, counting = compile_counting(module, min_layers=2)
        assert_close_outputs(compiled(*inputs), ref, torch.float32)
        assert not counting.records[0].fused_groups
        assert "only 1 matching layer(s) share this input; min_layers=2" in counting.records[0].rejected[0].reason


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make_layer", ["qwen3", "llama"])
def test_full_decoder_layer_matches_eager(device, make_layer):
    if make_layer == "qwen3":
        config = Qwen3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1)
        layer, rotary = Qwen3DecoderLayer(config, 0), Qwen3RotaryEmbedding(config)
    else:
        config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
        layer, rotary = LlamaDecoderLayer(config, 0), LlamaRotaryEmbedding(config)
    config._attn_implementation = "sdpa"
    layer, rotary = layer.eval().to(device), rotary.to(device)
    x, positions = torch.randn(1, 6, 64, device=device), torch.arange(6, device=device)[None]
    with torch.no_grad():
        cos_sin = rotary(x, positions)
        ref = layer(x, attention_mask=None, position_embeddings=cos_sin)
        got = torch.compile(layer, backend="fx_fusion", options={"min_layers": 1})(
            x, attention_mask=None, position_embeddings=cos_sin
        )
    ref = ref[0] if isinstance(ref, tuple) else ref
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_seq_len_does_not_recompile(device):
    module = drafts.qwen3_context_kv(3, device=device)
    counter = torch._dynamo.testing.CompileCounterWithBackend("fx_fusion")
    compiled = torch.compile(module, backend=counter, dynamic=True)
    with torch.no_grad():
        for seq_len in (3, 5, 9, 17):
            inputs = drafts.example_inputs(module, batch=1, seq_len=seq_len, seed=seq_len)
            assert_close_outputs(compiled(*inputs), module(*inputs), torch.float32)
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
def test_seq_len_one_with_unbacked_size_does_not_recompile(device):
    """dynamo specializes sizes 0/1 even with dynamic=True; mark the token dim unbacked to cover T=1."""
    module = drafts.qwen3_context_kv(2, device=device)
    counter = torch._dynamo.testing.CompileCounterWithBackend("fx_fusion")
    compiled = torch.compile(module, backend=counter)
    with torch.no_grad():
        for seq_len in (4, 1, 6):
            hidden, positions = drafts.example_inputs(module, batch=1, seq_len=seq_len, seed=seq_len)
            torch._dynamo.decorators.mark_unbacked(hidden, 1)
            torch._dynamo.decorators.mark_unbacked(positions, 1)
            assert_close_outputs(compiled(hidden, positions), module(hidden, positions), torch.float32)
    assert counter.frame_count == 1


def _parameter_facts(module: nn.Module) -> dict:
    """What a user can observe about the parameters: identity, storage, address, values."""
    return {
        name: (id(p), p.untyped_storage().data_ptr(), p.data_ptr(), p.detach().clone())
        for name, p in module.named_parameters()
    }


def _saved_bytes(obj) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer().nbytes


def _tied_draft(device: str) -> tuple[nn.Module, torch.Tensor]:
    """A 3-layer draft whose K/V weights are views of one flat buffer (an FSDP-style tie), and that buffer."""
    module = drafts.qwen3_context_kv(3, device=device)
    kv_weights = [p for name, p in module.named_parameters() if name.endswith(("k_proj.weight", "v_proj.weight"))]
    flat = torch.cat([w.detach().reshape(-1) for w in kv_weights])
    offset = 0
    for weight in kv_weights:
        weight.data = flat[offset : offset + weight.numel()].view_as(weight)
        offset += weight.numel()
    return module, flat


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiling_never_touches_parameters(device, mode):
    """No weight surgery: storage, identity, state_dict, pickle and torch.save are the user's, before and
    after compiled calls, and every way of changing a weight afterwards is honoured."""
    if mode == "reduce-overhead" and device != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    module, flat = _tied_draft(device)
    state = module.state_dict()  # taken before the first compiled call; shares the parameters' storage
    facts, saved = _parameter_facts(module), _saved_bytes(module.layers[0].state_dict())
    first, second = (drafts.example_inputs(module, seq_len=5, seed=seed) for seed in (1, 2))
    # torch.compile itself marks the module and its parameters (`_is_torch_compile`, dynamo's input kinds):
    # the pickle must be what a stock compile of the same module leaves
    stock, _ = _tied_draft(device)
    with torch.no_grad():
        torch.compile(stock, mode=mode)(*first)
    pickled = len(pickle.dumps(stock))
    records = []
    compiled = torch.compile(module, backend="fx_fusion", mode=mode)
    with torch.no_grad(), RecordSink.collect(records):
        for _ in range(3):
            assert_close_outputs(compiled(*first), module(*first), torch.float32)
            assert_close_outputs(compiled(*second), module(*second), torch.float32)
        assert records and records[0].fused_groups, "the draft must be fused for this test to mean anything"

        after = _parameter_facts(module)
        assert after.keys() == facts.keys()
        for name, (ident, storage, address, value) in facts.items():
            assert after[name][:3] == (ident, storage, address), f"{name} was moved"
            assert torch.equal(after[name][3], value), f"{name} changed value"
        # dynamo's annotations of the parameters differ by a few bytes from compile to compile; a weight
        # copy would add at least one weight (16 KiB here)
        assert abs(len(pickle.dumps(module)) - pickled) < 1024
        assert _saved_bytes(module.layers[0].state_dict()) == saved

        state["layers.1.k_proj.weight"].mul_(-0.5)  # through the early state_dict
        assert_close_outputs(compiled(*first), module(*first), torch.float32)
        flat.mul_(0.75)  # through the tie
        assert_close_outputs(compiled(*first), module(*first), torch.float32)
        module.load_state_dict(drafts.qwen3_context_kv(3, seed=7, device=device).state_dict())
        assert_close_outputs(compiled(*first), module(*first), torch.float32)
        module.layers[1].v_proj.weight = nn.Parameter(torch.randn_like(module.layers[1].v_proj.weight))
        assert_close_outputs(compiled(*first), module(*first), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_freezing_with_backend(device):
    module = drafts.qwen3_context_kv(3, device=device)
    inputs = drafts.example_inputs(module, seq_len=5)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        ref = module(*inputs)
        compiled = torch.compile(module, backend="fx_fusion", options={"freezing": True})
        got, codes = torch._inductor.utils.run_and_get_code(compiled, *inputs)
    assert_close_outputs(got, ref, torch.float32)
    (group,) = only_fused_groups(records)
    assert records[0].stage == "joint" and group.n_layers == 3
    # the grouped GEMM is an mm over weights concatenated in the graph, which freezing folds into a constant
    assert "fx_fusion.grouped_linear" not in "\n".join(codes)


def test_pass_uuid_covers_every_module_of_the_pass_whatever_else_is_imported():
    """The FX graph cache key hashes the pass's modules, found from its imports: the canonical-form rewrites
    among them, and the same key in a process that imported other parts of fx_fusion first."""
    import subprocess
    import sys

    from fx_fusion import fused_kv_pass, layer_unstack, scatter_forwarding, select_cuts, token_cats, values

    files = fused_kv_pass._pass_module_files()
    assert {m.__file__ for m in (fused_kv_pass, layer_unstack, scatter_forwarding, select_cuts, token_cats, values)} <= set(files)
    script = "import fx_fusion.cli, fx_fusion.explain, fx_fusion; print(fx_fusion.FusedKVPass().uuid().hex())"
    other_order = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert other_order.stdout.strip() == fx_fusion.FusedKVPass().uuid().hex()


def test_pass_uuid_is_stable_and_option_dependent():
    assert fx_fusion.FusedKVPass().uuid() == fx_fusion.FusedKVPass().uuid()
    assert fx_fusion.FusedKVPass(min_layers=3).uuid() != fx_fusion.FusedKVPass().uuid()


def test_fx_graph_cache_serves_the_rewritten_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    module = drafts.qwen3_context_kv(2)
    inputs = drafts.example_inputs(module, seq_len=4)
    counters = torch._dynamo.utils.counters
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        ref = module(*inputs)
        counters.clear()
        assert_close_outputs(torch.compile(module, backend="fx_fusion")(*inputs), ref, torch.float32)
        assert counters["inductor"]["fxgraph_cache_miss"] == 1
        torch._dynamo.reset()
        assert_close_outputs(torch.compile(module, backend="fx_fusion")(*inputs), ref, torch.float32)
        assert counters["inductor"]["fxgraph_cache_hit"] == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seq_len", [5, 200, 300, 1100])
@pytest.mark.parametrize("options", [{}, {"cpp_wrapper": True}, {"max_autotune": True}], ids=["python", "cpp", "autotune"])
def test_inductor_generates_the_fused_code(device, seq_len, options):
    """The fused op reaches Inductor as code, not as an op call: on CUDA a launch of our Triton kernels from
    Inductor's generated code (few tokens: the grouped GEMM with the K epilogue; more: the grouped GEMM, then
    the materialization kernel; a few hundred on Hopper: the TMA grouped GEMM, then the materialization
    kernel; many: cuBLAS GEMMs and the materialization kernel), elsewhere the op's math compiled with the
    graph."""
    if options.get("max_autotune") and device != "cuda":
        pytest.skip("max-autotune benchmarks GPU kernels")
    if seq_len > grouped_gemv.MAX_TOKENS and device != "cuda":
        pytest.skip("the many-token path differs from the few-token one on CUDA only")
    n_layers = 3
    module = drafts.qwen3_context_kv(n_layers, dtype=torch.bfloat16, device=device)
    inputs = drafts.example_inputs(module, seq_len=seq_len)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        compiled = torch.compile(module, backend="fx_fusion", options=options)
        got, codes = torch._inductor.utils.run_and_get_code(compiled, *inputs)
        assert_close_outputs(got, module(*inputs), torch.bfloat16)
    code = "\n".join(codes)
    (group,) = only_fused_groups(records)
    assert not records[0].ops_kept and "fx_fusion.materialize_k" not in code
    if device == "cuda" and seq_len <= grouped_gemv.MAX_EPILOGUE_TOKENS:  # the grouped kernel normalises and rotates K
        assert records[0].ops_inlined == 2 and "fx_fusion.grouped_linear" not in code
        assert records[0].gemm_epilogues == 1, records[0].gemm_epilogue_notes
        assert "_fused_kv_materialize_kernel" not in code and "_grouped_gemv_kernel" in code
    elif device == "cuda" and seq_len <= grouped_gemv.max_tokens(2 * n_layers):  # K and V of every layer
        assert records[0].ops_inlined == 2 and "fx_fusion.grouped_linear" not in code
        assert records[0].gemm_epilogues == 0
        assert "_grouped_gemv_kernel" in code and "_fused_kv_materialize_kernel" in code
    elif device == "cuda" and torch.cuda.get_device_capability() >= (9, 0) and seq_len <= grouped_gemm_tma.MAX_TOKENS_TMA:
        assert records[0].ops_inlined == 2 and "fx_fusion.grouped_linear" not in code
        assert records[0].gemm_epilogues == 0 and "_grouped_gemv_kernel" not in code
        assert "_grouped_gemm_tma_kernel" in code and "_fused_kv_materialize_kernel" in code
    elif device == "cuda":  # one GEMM per weight into column slices, then the materialization kernel
        assert records[0].ops_inlined == 2 and "fx_fusion.grouped_linear" not in code
        assert records[0].gemm_epilogues == 0 and "_grouped_gemv_kernel" not in code
        assert "_grouped_gemm_tma_kernel" not in code and "_fused_kv_materialize_kernel" in code
    else:  # the linears as ATen ops, compiled with the graph
        assert records[0].ops_inlined == 2 and "fx_fusion.grouped_linear" not in code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphed", [False, True], ids=["plain", "cudagraphs"])
@pytest.mark.parametrize(
    "n_layers, tokens, expected", [(1, 3, {"SPLIT_K": 8}), (5, 100, {"num_stages": 4})], ids=["split_k", "stages"]
)
def test_grouped_kernel_launch_options_in_inductor_code(n_layers, tokens, expected, graphed):
    """The grouped kernel's launch options reach Inductor's launch: one layer's K and V (2 x 1024 rows) split K
    (partials and arrival counters allocated by Inductor's code, replayed by CUDA graphs); 5 layers at 100
    tokens take 64 x 64 tiles through 4 pipeline stages. The results match eager."""
    from fx_fusion.kernels import grouped_gemv

    module = drafts.qwen3_context_kv(
        n_layers, hidden_size=2048, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda"
    )
    inputs = drafts.example_inputs(module, seq_len=tokens)
    config = grouped_gemv.default_launch_config(tokens, 1024, 2048, 2 * n_layers, torch.bfloat16, inputs[0].device)
    assert expected.items() <= config.items()
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        ref = module(*inputs)
        options = {"min_layers": 1, "triton.cudagraphs": graphed}  # "reduce-overhead", with an option
        compiled = torch.compile(module, backend="fx_fusion", options=options)
        got, codes = torch._inductor.utils.run_and_get_code(compiled, *inputs)
        assert_close_outputs(got, ref, torch.bfloat16)
        for _ in range(2):  # CUDA graphs: recorded, then replayed
            assert_close_outputs(compiled(*inputs), ref, torch.bfloat16)
    only_fused_groups(records)
    assert "_grouped_gemv_kernel" in "\n".join(codes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_many_tokens_on_cuda_run_cublas_from_inductor_code():
    """Past the grouped kernels' token counts the projections are cuBLAS GEMMs launched by Inductor (into
    column slices of one output), not a Python-level op call."""
    n_layers = 3
    module = drafts.qwen3_context_kv(n_layers, dtype=torch.bfloat16, device="cuda")
    inputs = drafts.example_inputs(module, seq_len=grouped_gemm_tma.token_range(2 * n_layers)[1] + 1)  # K and V each
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        got, codes = torch._inductor.utils.run_and_get_code(torch.compile(module, backend="fx_fusion"), *inputs)
        assert_close_outputs(got, module(*inputs), torch.bfloat16)
    code = "\n".join(codes)
    assert only_fused_groups(records) and records[0].ops_inlined == 2 and not records[0].ops_kept
    assert "fx_fusion.grouped_linear" not in code and "extern_kernels.mm(" in code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n_layers", [3, 1])
def test_symbolic_token_count_on_cuda_keeps_one_grouped_linear_call(n_layers, fresh_compile):
    """With a symbolic token count (dynamic=True) a multi-layer draft's grouped GEMM stays one op call that
    picks its kernel per call (the grouped kernel, the TMA kernel or a GEMM per weight), rather than a GEMM
    per weight at every count; one layer's two weights keep GEMMs per weight launched by Inductor. One
    compile gives eager's K/V at each count, the report says why a call was kept. The norm eps, a CPU
    scalar input under dynamic=True, reaches the kernel without a copy to the device, so a CUDA graph
    captures the compiled call."""
    module = drafts.qwen3_context_kv(n_layers, dtype=torch.bfloat16, device="cuda")
    counter = torch._dynamo.testing.CompileCounterWithBackend("fx_fusion")
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        compiled = torch.compile(module, backend=counter, dynamic=True)
        for seq_len in (3, 17, 300, 1100):
            inputs = drafts.example_inputs(module, seq_len=seq_len, seed=seq_len)
            if seq_len == 3:
                got, codes = torch._inductor.utils.run_and_get_code(compiled, *inputs)
                code = "\n".join(codes)
            else:
                got = compiled(*inputs)
            assert_close_outputs(got, module(*inputs), torch.bfloat16)
            replay = cuda_graphs.capture(lambda: compiled(*inputs))  # noqa: B023  (captured and run here)
            assert_close_outputs(replay(), module(*inputs), torch.bfloat16)
    assert counter.frame_count == 1
    kept_for_symbolic = any("symbolic token count" in kept for kept in records[0].ops_kept)
    assert only_fused_groups(records) and ("fx_fusion.grouped_linear" in code) == (n_layers > 1), records[0].summary()
    assert kept_for_symbolic == (n_layers > 1), records[0].ops_kept


class NegatedAngleWeightlessNormContext(nn.Module):
    """K normalised without a weight (`F.rms_norm(k, (D,))`), then rotated by -angle written on K's side:
    k*cos - rotate_half(k)*sin, i.e. x1*cos + x2*sin, x2*cos - x1*sin."""

    def __init__(self, n_layers=3, hidden=48, heads=2, head_dim=16):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.k_proj = nn.ModuleList(nn.Linear(hidden, heads * head_dim, bias=False) for _ in range(n_layers))
        self.v_proj = nn.ModuleList(nn.Linear(hidden, heads * head_dim, bias=False) for _ in range(n_layers))

    def forward(self, x, cos, sin):  # x [T, hidden]; cos, sin [T, head_dim]
        outs = []
        for k_proj, v_proj in zip(self.k_proj, self.v_proj):
            k = torch.nn.functional.rms_norm(k_proj(x).view(-1, self.heads, self.head_dim), (self.head_dim,))
            k = k * cos[:, None] - rotate(k, False) * sin[:, None]
            outs += [k, v_proj(x).view(-1, self.heads, self.head_dim)]
        return tuple(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weightless_norm_and_negated_angle_fuse(dtype):
    torch.manual_seed(0)
    module = NegatedAngleWeightlessNormContext().to(dtype)
    x = torch.randn(7, 48, dtype=dtype)
    angles = torch.randn(7, 8)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    counting = check_compiled_matches_eager(module, x, cos, sin, dtype=dtype)
    (group,) = only_fused_groups(counting.records)
    assert group.n_layers == 3 and group.k_norm
    assert counting.after[FUSED_OP] == 1 and counting.after[aten.rsqrt.default] == 0


class BroadcastShapedNormWeightContext(nn.Module):
    """Each layer's K norm weight a [1, 1, D] parameter, shaped to broadcast over [T, H, D]."""

    def __init__(self, n_layers=3, hidden=48, heads=2, head_dim=16):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.k_proj = nn.ModuleList(nn.Linear(hidden, heads * head_dim, bias=False) for _ in range(n_layers))
        self.v_proj = nn.ModuleList(nn.Linear(hidden, heads * head_dim, bias=False) for _ in range(n_layers))
        self.k_norm = nn.ParameterList(nn.Parameter(torch.rand(1, 1, head_dim) + 0.5) for _ in range(n_layers))

    def forward(self, x, cos, sin):  # x [T, hidden]; cos, sin [T, head_dim]
        outs = []
        for k_proj, v_proj, weight in zip(self.k_proj, self.v_proj, self.k_norm):
            k = k_proj(x).view(-1, self.heads, self.head_dim)
            k = weight * (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6))
            k = k * cos[:, None] + rotate(k, False) * sin[:, None]
            outs += [k, v_proj(x).view(-1, self.heads, self.head_dim)]
        return tuple(outs)


def test_norm_weights_shaped_to_broadcast_fuse():
    torch.manual_seed(0)
    module = BroadcastShapedNormWeightContext()
    x = torch.randn(7, 48)
    angles = torch.randn(7, 8)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1) for f in (torch.cos, torch.sin))
    counting = check_compiled_matches_eager(module, x, cos, sin)
    (group,) = only_fused_groups(counting.records)
    assert group.n_layers == 3 and group.k_norm
    assert counting.after[FUSED_OP] == 1 and counting.after[aten.rsqrt.default] == 0


def test_compiling_leaves_the_global_rng_alone():
    module = drafts.qwen3_context_kv(3)
    inputs = drafts.example_inputs(module, seq_len=5)
    torch.manual_seed(1234)
    expected = torch.randn(4)
    torch.manual_seed(1234)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        torch.compile(module, backend="fx_fusion")(*inputs)
    only_fused_groups(records)
    assert torch.equal(torch.randn(4), expected)


def test_untraceable_op_body_keeps_the_op_call_with_its_reason(monkeypatch):
    """A fused op whose body cannot be traced stays an op call (still correct), and the record says why."""

    def broken_body(*args):
        raise RuntimeError("cannot trace this")

    monkeypatch.setattr(
        fx_fusion.op_lowering, "_bodies", lambda: {torch.ops.fx_fusion.materialize_k.default: (broken_body, frozenset())}
    )
    module = drafts.qwen3_context_kv(3)
    inputs = drafts.example_inputs(module, seq_len=5)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        got, codes = torch._inductor.utils.run_and_get_code(torch.compile(module, backend="fx_fusion"), *inputs)
        assert_close_outputs(got, module(*inputs), torch.float32)
    only_fused_groups(records)
    assert records[0].ops_inlined == 0 and "RuntimeError: cannot trace this" in records[0].ops_kept[0]
    assert "fx_fusion.materialize_k" in "\n".join(codes)


def test_disable_option_leaves_graph_alone():
    module = drafts.llama_context_kv(2)
    inputs = drafts.example_inputs(module, seq_len=4)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        got = torch.compile(module, backend="fx_fusion", options={"disable": True})(*inputs)
        assert_close_outputs(got, module(*inputs), torch.float32)
    assert records == []


def test_shape_guard_fires_when_compiled_op_gets_2d_input():
    kv = torch.randn(4, 2 * 2 * 16)
    cache = torch.randn(8, 16)

    def materialize(kv, cache, positions):
        return fx_fusion.fused_norm_rope_stacked(kv, torch.ones(1, 16), torch.full((1,), 1e-6), cache, positions, 2, 16, 16)

    message = "Invalid stacked fused KV projection shape: got (4, 64), expected 3D [total_ctx, n_layers, kv_size*2]."
    with pytest.raises(Exception, match=re.escape(message)):
        torch.compile(materialize, backend="fx_fusion", fullgraph=True)(kv, cache, torch.arange(4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_overhead_replays_fused_graph(dtype):
    module = drafts.qwen3_context_kv(4, dtype=dtype, device="cuda")
    compiled = torch.compile(module, backend="fx_fusion", mode="reduce-overhead")
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        for seed in range(4):  # warm-up, record, then replays with fresh inputs
            inputs = drafts.example_inputs(module, batch=2, seq_len=9, seed=seed)
            assert_close_outputs(compiled(*inputs), module(*inputs), dtype)
    (group,) = only_fused_groups(records)
    assert group.n_layers == 4


class StackedSpellingContext(nn.Module):
    """The explicit stacked spelling: torch.stack of per-layer fused kv linears, stacked norm weights."""

    def __init__(self, n_layers=4, hidden=48, heads=2, head_dim=16, bias=False):
        super().__init__()
        self.n_layers, self.heads, self.head_dim = n_layers, heads, head_dim
        self.kv = nn.ModuleList([nn.Linear(hidden, 2 * heads * head_dim, bias=bias) for _ in range(n_layers)])
        self.k_norm_weight = nn.Parameter(1 + 0.2 * torch.randn(n_layers, head_dim))

    def forward(self, x, cos, sin):  # x [T, hidden]; cos, sin [T, head_dim]
        T, L, H, D = x.shape[0], self.n_layers, self.heads, self.head_dim
        kv = torch.stack([proj(x) for proj in self.kv], dim=1)  # [T, L, 2*H*D]
        k = kv[..., : H * D].view(T, L, H, D)
        v = kv[..., H * D :].view(T, L, H, D)
        kf = k.float()
        k = self.k_norm_weight[:, None, :] * (kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(k.dtype)
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]
        k = k * cos + torch.cat((-k[..., D // 2 :], k[..., : D // 2]), dim=-1) * sin
        return k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_explicit_stacked_spelling(device, bias):
    torch.manual_seed(0)
    module = StackedSpellingContext(bias=bias).to(device)
    x, cos, sin = torch.randn(6, 48, device=device), torch.randn(6, 16, device=device), torch.randn(6, 16, device=device)
    counting = check_compiled_matches_eager(module, x, cos, sin)
    (group,) = only_fused_groups(counting.records)
    assert (group.n_layers, group.num_kv_heads, group.head_dim, group.bias) == (4, 2, 16, bias)
    assert sum(counting.after[op] for op in PROJECTION_OPS) == 0 and counting.after[aten.cat.default] == 0
    assert counting.after[FUSED_OP] == 1


def test_unfused_bias_add_projection():
    """`mm(x, W.T) + b`, the form Inductor leaves on GPU after unfusing addmm, traced to ATen here."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from fx_fusion.fused_kv_pass import fuse_kv_groups

    torch.manual_seed(0)
    n_layers, hidden, heads, head_dim = 3, 48, 2, 16
    kv = heads * head_dim

    def context(x, cos, sin, weights, biases, norm_weights):  # x [T, hidden]; cos, sin [T, head_dim]
        outs = []
        for layer in range(n_layers):
            wk, wv = weights[2 * layer], weights[2 * layer + 1]
            bk, bv = biases[2 * layer], biases[2 * layer + 1]
            k = (torch.ops.aten.mm(x, wk.t()) + bk).view(-1, heads, head_dim)
            kf = k.float()
            k = norm_weights[layer] * (kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(k.dtype)
            _, k = apply_rotary_pos_emb(k, k, cos, sin, unsqueeze_dim=1)
            outs += [k, (torch.ops.aten.mm(x, wv.t()) + bv).view(-1, heads, head_dim)]
        return outs

    inputs = (
        torch.randn(5, hidden),
        torch.randn(5, head_dim),
        torch.randn(5, head_dim),
        [0.1 * torch.randn(kv, hidden) for _ in range(2 * n_layers)],
        [torch.randn(kv) for _ in range(2 * n_layers)],
        [1 + 0.1 * torch.randn(head_dim) for _ in range(n_layers)],
    )
    graph_module = make_fx(context, decomposition_table=select_decomp_table(), tracing_mode="fake")(*inputs)
    assert sum(n.target is aten.mm.default for n in graph_module.graph.nodes) == 2 * n_layers
    record = fuse_kv_groups(graph_module.graph)
    graph_module.recompile()
    (group,) = record.fused_groups
    assert group.bias and group.n_layers == n_layers and group.v_as_view == n_layers
    assert not any(n.target is aten.mm.default for n in graph_module.graph.nodes)
    assert_close_outputs(graph_module(*inputs), context(*inputs), torch.float32)


@pytest.mark.parametrize("dynamic", [False, True])
def test_positions_shared_by_the_batch(dynamic):
    """position_ids [1, T] with hidden states [B, T, hidden]: one cos/sin row serves every sequence."""
    module = drafts.qwen3_context_kv(3)
    counter = torch._dynamo.testing.CompileCounterWithBackend("fx_fusion")
    compiled = torch.compile(module, backend=counter, dynamic=dynamic)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        for batch, seq_len in ((3, 5), (2, 7)):
            hidden, positions = drafts.example_inputs(module, batch=batch, seq_len=seq_len, seed=batch)
            positions = positions[:1]
            assert_close_outputs(compiled(hidden, positions), module(hidden, positions), torch.float32)
    assert records[0].fused_groups[0].n_layers == 3, records[0].rejected
    if dynamic:
        assert counter.frame_count == 1


def test_training_graph_keeps_gradients():
    """With autograd on, the pass sees the partitioned forward graph, whose K intermediates are also saved
    for backward; whatever it does there, outputs and gradients must match eager."""
    module = drafts.qwen3_context_kv(3)
    hidden, positions = drafts.example_inputs(module, seq_len=5)
    weights = [torch.randn(2, 2, 5, 32, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def gradients(fn):
        module.zero_grad()
        x = hidden.clone().requires_grad_(True)
        sum((out * w).sum() for out, w in zip(fn(x, positions), weights)).backward()
        return [x.grad, module.layers[1].k_proj.weight.grad, module.layers[2].k_norm.weight.grad]

    ref = gradients(module)
    records = []
    with RecordSink.collect(records):
        got = gradients(torch.compile(module, backend="fx_fusion"))
    assert records, "the pass did not run"
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


class RandomContext(nn.Module):
    """A context K/V module drawn from the supported variants (for the property test below)."""

    def __init__(self, n_layers, heads, head_dim, rotary_dim, interleaved, k_norm, bias, heads_first, hidden=32):
        super().__init__()
        self.heads, self.head_dim, self.rotary_dim = heads, head_dim, rotary_dim
        self.interleaved, self.heads_first = interleaved, heads_first
        kv = heads * head_dim
        self.k = nn.ModuleList([nn.Linear(hidden, kv, bias=bias) for _ in range(n_layers)])
        self.v = nn.ModuleList([nn.Linear(hidden, kv, bias=bias) for _ in range(n_layers)])
        self.norms = nn.ModuleList([Qwen3RMSNorm(head_dim, eps=1e-5) for _ in range(n_layers)]) if k_norm else None
        if k_norm:
            for norm in self.norms:
                nn.init.normal_(norm.weight, 1.0, 0.2)

    def rotate(self, x):
        return rotate(x, self.interleaved)

    def forward(self, x, cos, sin):  # x [B, T, hidden]; cos, sin [B, T, rotary_dim]
        B, T, _ = x.shape
        head_axis = 1 if self.heads_first else 2
        cos, sin = cos.unsqueeze(head_axis), sin.unsqueeze(head_axis)
        outs = []
        for layer, (k_proj, v_proj) in enumerate(zip(self.k, self.v)):
            k = k_proj(x).view(B, T, self.heads, self.head_dim)
            if self.norms is not None:
                k = self.norms[layer](k)
            if self.heads_first:
                k = k.transpose(1, 2)
            r = self.rotary_dim
            k = torch.cat((k[..., :r] * cos + self.rotate(k[..., :r]) * sin, k[..., r:]), dim=-1) if r < self.head_dim else k * cos + self.rotate(k) * sin
            outs += [k, v_proj(x).view(B, T, self.heads, self.head_dim)]
        return tuple(outs)


@settings(max_examples=6, deadline=None)
@given(
    n_layers=st.integers(2, 4),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([16, 32]),
    partial=st.booleans(),
    interleaved=st.booleans(),
    k_norm=st.booleans(),
    bias=st.booleans(),
    heads_first=st.booleans(),
    batch=st.integers(1, 2),
    seq_len=st.integers(2, 6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_random_variants_fuse_and_match_eager(
    n_layers, heads, head_dim, partial, interleaved, k_norm, bias, heads_first, batch, seq_len, dtype
):
    torch._dynamo.reset()
    torch.manual_seed(0)
    rotary_dim = head_dim // 2 if partial else head_dim
    module = RandomContext(n_layers, heads, head_dim, rotary_dim, interleaved, k_norm, bias, heads_first).to(dtype)
    x = torch.randn(batch, seq_len, 32, dtype=dtype)
    cos, sin = (torch.randn(batch, seq_len, rotary_dim, dtype=dtype) for _ in range(2))
    counting = check_compiled_matches_eager(module, x, cos, sin, dtype=dtype)
    (group,) = counting.records[0].fused_groups
    assert (group.n_layers, group.num_kv_heads, group.head_dim, group.rotary_dim) == (n_layers, heads, head_dim, rotary_dim)
    assert (group.k_norm, group.bias, group.rotary_style == "interleaved") == (k_norm, bias, interleaved)
    assert sum(counting.after[op] for op in PROJECTION_OPS) == 0 and counting.after[FUSED_OP] == 1


class _ScaledThenSplit(nn.Module):
    """Falcon-H1's mamba in_proj: a linear output times a per-token table, then split (a list value inside
    the region the rotary matcher walks)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 16, bias=False)

    def forward(self, x, table):
        first, second = (self.proj(x) * table).split([8, 8], dim=-1)
        return first + 1, second * 2


def test_a_split_after_a_linear_is_analysed_without_error():
    module, x, table = _ScaledThenSplit(), torch.randn(5, 32), torch.randn(5, 16)
    fused_kv_pass = fx_fusion.FusedKVPass()
    with torch.no_grad():
        got = torch.compile(module, options={"post_grad_custom_post_pass": fused_kv_pass})(x, table)
        for g, r in zip(got, module(x, table)):
            torch.testing.assert_close(g, r)
    reasons = [j.reason for record in fused_kv_pass.records for j in record.rejected]
    assert fused_kv_pass.records and not any("could not be analysed" in r for r in reasons), reasons
