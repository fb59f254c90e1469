"""Tests of the rotary-angle rewrite: inner-dimension-1 matmuls become multiplies, with identical results."""

from __future__ import annotations

import pytest
import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from fx_fusion import rotary_angles

aten = torch.ops.aten
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def cos_sin_via_matmul(inner: int):
    """Hugging Face's rotary embedding, angles as a matmul over `inner` (1: the outer product it uses)."""

    def cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor):
        inv = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, inner)
        pos = position_ids[:, None, :].float().expand(-1, inner, -1)
        freqs = (inv @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    return cos_sin


hf_style_cos_sin = cos_sin_via_matmul(1)


def inputs(device: str, dtype=torch.float32):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32, device=device) / 64))
    positions = torch.randint(0, 40000, (2, 9), device=device)
    return inv_freq.to(dtype), positions


def traced_and_rewritten(fn, *args):
    graph_module = make_fx(fn, tracing_mode="fake")(*args)
    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph_module.graph.nodes if n.op == "placeholder"])
    created = rotary_angles.outer_products_to_mul(graph_module.graph, fake_mode, list(output.all_input_nodes))
    graph_module.graph.lint()
    graph_module.recompile()
    return graph_module, created


def count(graph_module, target) -> int:
    return sum(1 for n in graph_module.graph.nodes if n.target == target)


@pytest.mark.parametrize("device", DEVICES)
def test_outer_product_becomes_a_multiply_with_identical_values(device: str) -> None:
    args = inputs(device)
    assert count(make_fx(hf_style_cos_sin)(*args), aten.bmm.default) == 1
    rewritten, created = traced_and_rewritten(hf_style_cos_sin, *args)
    assert len(created) == 1 and count(rewritten, aten.bmm.default) == 0
    assert created[0].meta["val"].shape == (2, 32, 9)
    for expected, got in zip(hf_style_cos_sin(*args), rewritten(*args)):
        assert torch.equal(got, expected)  # bit for bit


def test_other_matmuls_are_left_alone(monkeypatch) -> None:
    inv_freq, positions = inputs("cpu")

    _, created = traced_and_rewritten(cos_sin_via_matmul(2), inv_freq, positions)
    assert created == [], "inner dimension 2 is a real reduction"

    def not_an_ancestor(inv_freq, position_ids):
        unrelated = inv_freq[None, :, None] @ position_ids[:, None, :].float()
        return hf_style_cos_sin(inv_freq, position_ids), unrelated

    graph_module = make_fx(not_an_ancestor, tracing_mode="fake")(inv_freq, positions)
    cos_node = next(n for n in graph_module.graph.nodes if n.target == aten.cos.default)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph_module.graph.nodes if n.op == "placeholder"])
    created = rotary_angles.outer_products_to_mul(graph_module.graph, fake_mode, [cos_node])
    assert len(created) == 1 and count(graph_module, aten.bmm.default) == 1  # only the cos/sin ancestor

    def bf16_angles(inv_freq, position_ids):
        return (inv_freq[None, :, None] @ position_ids[:, None, :].to(inv_freq.dtype)).cos()

    _, created = traced_and_rewritten(bf16_angles, *inputs("cpu", torch.bfloat16))
    assert created == [], "bf16 matmuls stay as they are"

    previous = torch.get_float32_matmul_precision()
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert previous == "highest"
    _, created = traced_and_rewritten(hf_style_cos_sin, inv_freq, positions)
    assert created == [], "with TF32/bf16 matmuls allowed the product is not the matmul's result"
