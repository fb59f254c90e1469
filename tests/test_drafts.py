"""fx_fusion.drafts: the HF-module draft context-K/V modules and the hand-fused path (CPU)."""

import importlib

import pytest
import torch

pytest.importorskip("transformers")

from fx_fusion.drafts import (  # noqa: E402
    ContextKV,
    HandFusedContextKV,
    build_workload,
    example_inputs,
    llama_context_kv,
    qwen3_context_kv,
)

FACTORIES = {"qwen3": qwen3_context_kv, "llama": llama_context_kv}


def _ops_available() -> str | None:
    """None when the fused op imports, else the reason to skip."""
    try:
        importlib.import_module("fx_fusion.kernels.ops")
    except Exception as exc:  # the op module may still be being written
        return f"fx_fusion.kernels.ops is not importable yet ({type(exc).__name__}: {exc})"
    if not hasattr(torch.ops.fx_fusion, "materialize_kv"):
        return "torch.ops.fx_fusion.materialize_kv is not registered by fx_fusion.kernels.ops"
    return None


needs_ops = pytest.mark.skipif(_ops_available() is not None, reason=str(_ops_available()))


def _rel_err(out, ref) -> float:
    return max(((o.float() - r.float()).norm() / r.float().norm()).item() for o, r in zip(out, ref))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_context_kv_shapes(family):
    m = FACTORIES[family](3, num_kv_heads=2, head_dim=16, hidden_size=48)
    assert isinstance(m, ContextKV)
    assert (m.n_layers, m.num_kv_heads, m.head_dim, m.hidden_size) == (3, 2, 16, 48)
    assert m.has_k_norm == (family == "qwen3")
    x, pos = example_inputs(m, batch=2, seq_len=5)
    assert x.shape == (2, 5, 48) and x.dtype == torch.float32
    assert pos.shape == (2, 5) and pos.dtype == torch.int64
    with torch.no_grad():
        out = m(x, pos)
    assert isinstance(out, tuple) and len(out) == 6
    for t in out:
        assert t.shape == (2, 2, 5, 16)
        assert t.dtype == torch.float32
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_context_kv_matches_hf_attention_forward(family):
    """The plain per-layer code yields exactly the K/V the HF attention module itself hands its cache."""
    m = FACTORIES[family](2, attention_bias=True)
    x, pos = example_inputs(m, batch=2, seq_len=6)

    class RecordingCache:
        def __init__(self):
            self.kv = {}

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            self.kv[layer_idx] = (key_states, value_states)
            return key_states, value_states

    cache = RecordingCache()
    with torch.no_grad():
        out = m(x, pos)
        cos, sin = m.rotary_emb(x, pos)
        for layer in m.layers:
            layer(x, (cos, sin), None, cache)
    for i in range(m.n_layers):
        k_hf, v_hf = cache.kv[i]
        torch.testing.assert_close(out[2 * i], k_hf, rtol=0, atol=0)
        torch.testing.assert_close(out[2 * i + 1], v_hf, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_factories_deterministic_and_nontrivial(family):
    a = FACTORIES[family](2, attention_bias=True, seed=3)
    b = FACTORIES[family](2, attention_bias=True, seed=3)
    c = FACTORIES[family](2, attention_bias=True, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    for layer in a.layers:
        assert layer.k_proj.bias is not None and layer.k_proj.bias.abs().sum() > 0
        assert not torch.equal(layer.k_proj.weight, layer.v_proj.weight)
        if family == "qwen3":
            w = layer.k_norm.weight
            assert not torch.allclose(w, torch.ones_like(w))
            assert (w - 1).abs().max() < 1.0
    # different layers get different weights
    assert not torch.equal(a.layers[0].k_proj.weight, a.layers[1].k_proj.weight)
    # example inputs: deterministic, consecutive, not starting at 0, distinct per row
    x1, p1 = example_inputs(a, batch=3, seq_len=4)
    x2, p2 = example_inputs(a, batch=3, seq_len=4)
    assert torch.equal(x1, x2) and torch.equal(p1, p2)
    assert (p1[:, 1:] - p1[:, :-1] == 1).all()
    assert (p1[:, 0] > 0).all()
    assert p1.max() < a.rotary_emb.max_seq_len_cached


def test_dtype_and_workloads():
    m = qwen3_context_kv(2, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.layers.parameters())
    assert m.rotary_emb.inv_freq.dtype == torch.float32
    x, pos = example_inputs(m, seq_len=3)
    assert x.dtype == torch.bfloat16
    with torch.no_grad():
        assert all(t.dtype == torch.bfloat16 for t in m(x, pos))
    small = build_workload("llama-small", dtype=torch.float32)
    assert not small.has_k_norm and small.n_layers == 3
    with pytest.raises(ValueError):
        build_workload("no-such-workload")


@needs_ops
@pytest.mark.parametrize("rope", ["per_token", "cache"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_hand_fused_matches_context_kv_fp32(family, bias, rope):
    m = FACTORIES[family](4, attention_bias=bias)
    hand = HandFusedContextKV(m, rope=rope)
    assert hand.kv_weight.shape == (4 * 2 * m.num_kv_heads * m.head_dim, m.hidden_size)
    x, pos = example_inputs(m, batch=2, seq_len=7)
    with torch.no_grad():
        ref = m(x, pos)
        out = hand(x, pos)
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


@needs_ops
@pytest.mark.parametrize("rope", ["per_token", "cache"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_hand_fused_matches_context_kv_bf16(family, rope):
    m = FACTORIES[family](3, dtype=torch.bfloat16, attention_bias=True)
    hand = HandFusedContextKV(m, rope=rope)
    x, pos = example_inputs(m, batch=1, seq_len=11)
    with torch.no_grad():
        ref = m(x, pos)
        out = hand(x, pos)
    assert all(o.dtype == torch.bfloat16 and o.shape == r.shape for o, r in zip(out, ref))
    assert _rel_err(out, ref) < 2e-2


@needs_ops
def test_hand_fused_stacks_once():
    """The stacked weight is a copy made at init: forward does not re-read the source parameters."""
    m = qwen3_context_kv(2)
    hand = HandFusedContextKV(m)
    ptr = hand.kv_weight.data_ptr()
    x, pos = example_inputs(m, seq_len=4)
    with torch.no_grad():
        hand(x, pos)
        hand(x, pos)
    assert hand.kv_weight.data_ptr() == ptr
    assert hand.k_norm_weight.shape == (2, m.head_dim)
