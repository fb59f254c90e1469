"""Tests of the rotary-angle rewrite: inner-dimension-1 matmuls become multiplies, with identical results."""

from __future__ import annotations

import pytest
import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from fx_fusion import rotary_angles
from fx_fusion.kernels import grouped_gemv

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


# --------------------------------------------------------------------------------------------------------
# find_angle_source: cos / sin tables read back to positions and frequencies
# --------------------------------------------------------------------------------------------------------

TOKENS, ROTARY_DIM = 7, 16


def rope_tables(
    scale=1.0, dtype=torch.bfloat16, interleaved=False, angle_factor=None, trig_dtype=None,
    scale_after_rounding=False, sin_scale=None, widen_before_scale=False, join_after_trig=None,
):  # fmt: skip
    """cos / sin tables [tokens, rotary_dim] as Hugging Face's rotary embedding computes them (the angles as an
    outer-product matmul, neox halves or interleaved pairs), with knobs that change the math."""

    def tables(inv_freq, position_ids):
        inv = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        if join_after_trig is not None:  # halves joined after the trig function, the second one as given
            second = join_after_trig(freqs)
            cos, sin = (torch.cat((trig(freqs), trig(second)), dim=-1) for trig in (torch.cos, torch.sin))
            return cos.to(dtype).reshape(-1, ROTARY_DIM), sin.to(dtype).reshape(-1, ROTARY_DIM)
        emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
        if angle_factor is not None:
            emb = emb * angle_factor
        if trig_dtype is not None:
            emb = emb.to(trig_dtype)
        if scale_after_rounding:
            cos, sin = emb.cos().to(dtype) * scale, emb.sin().to(dtype) * scale
        elif widen_before_scale:  # rounded, widened back to float32, scaled there and rounded again
            cos, sin = ((t.to(dtype).float() * scale).to(dtype) for t in (emb.cos(), emb.sin()))
        else:
            cos, sin = (emb.cos() * scale).to(dtype), (emb.sin() * (sin_scale or scale)).to(dtype)
        return cos.reshape(-1, emb.shape[-1]), sin.reshape(-1, emb.shape[-1])

    return tables


def angle_inputs(inv_freq_dtype=torch.float32, positions_dtype=torch.int64):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, ROTARY_DIM, 2, dtype=torch.float32) / ROTARY_DIM))
    return inv_freq.to(inv_freq_dtype), torch.randint(0, 40000, (1, TOKENS)).to(positions_dtype)


def angle_source(fn, args, interleaved=False, n_tokens=TOKENS):
    graph_module, _ = traced_and_rewritten(fn, *args)
    cos, sin = next(n for n in graph_module.graph.nodes if n.op == "output").args[0]
    return graph_module, rotary_angles.find_angle_source(cos, sin, n_tokens, ROTARY_DIM, interleaved)


def placeholder_index(graph_module, node) -> int:
    return [n for n in graph_module.graph.nodes if n.op == "placeholder"].index(node)


@pytest.mark.parametrize(
    "name, fn, args, interleaved",
    [
        ("hf_bf16", rope_tables(), angle_inputs(), False),
        ("attention_factor", rope_tables(scale=1.25), angle_inputs(), False),
        ("float32_tables", rope_tables(dtype=torch.float32), angle_inputs(), False),
        ("float16_tables", rope_tables(dtype=torch.float16), angle_inputs(), False),
        ("interleaved", rope_tables(interleaved=True), angle_inputs(), True),
        ("bf16_inv_freq", rope_tables(), angle_inputs(inv_freq_dtype=torch.bfloat16), False),
        ("float_positions", rope_tables(), angle_inputs(positions_dtype=torch.float32), False),
        ("int32_positions", rope_tables(), angle_inputs(positions_dtype=torch.int32), False),
        ("halves_joined_after_trig", rope_tables(join_after_trig=lambda f: f), angle_inputs(), False),
    ],
)
def test_tables_read_back_to_positions_and_frequencies(name, fn, args, interleaved) -> None:
    """The source names the graph's own inputs, and its formula gives the tables' bits at the real inputs."""
    graph_module, source = angle_source(fn, args, interleaved)
    assert not isinstance(source, str), source
    assert placeholder_index(graph_module, source.inv_freq) == 0
    assert placeholder_index(graph_module, source.positions) == 1
    inv_freq, positions = args
    freq = torch.arange(ROTARY_DIM)
    freq = freq // 2 if interleaved else freq % (ROTARY_DIM // 2)
    angle = positions.reshape(-1).float()[:, None] * inv_freq.float()[freq][None, :]
    for trig, table in zip((torch.cos, torch.sin), fn(*args)):
        expected = trig(angle) * source.scale
        if source.rounded_to is not None:
            expected = expected.to(source.rounded_to)
        assert table.dtype == expected.dtype and torch.equal(table, expected)


def test_positions_computed_in_the_graph_are_read_where_they_are() -> None:
    """Positions made by other ops (an arange plus an offset) are the tensor the angles start from."""

    def tables(inv_freq, start):
        return rope_tables()(inv_freq, (torch.arange(TOKENS) + start)[None])

    graph_module, source = angle_source(tables, (angle_inputs()[0], torch.tensor(5)))
    assert not isinstance(source, str), source
    assert source.positions.target == aten.add.Tensor and source.positions.meta["val"].shape == (TOKENS,)


def test_positions_shared_across_a_batch_are_read_as_laid_out() -> None:
    """Position ids expanded over a batch (stride 0, as a generate loop often passes them): the replay lays
    its random positions out the same way, and the source is that input."""
    inv_freq, positions = angle_inputs()
    batched = positions.expand(3, -1)
    assert batched.stride()[0] == 0
    graph_module, source = angle_source(rope_tables(), (inv_freq, batched), n_tokens=3 * TOKENS)
    assert not isinstance(source, str), source
    assert placeholder_index(graph_module, source.positions) == 1


@pytest.mark.parametrize(
    "name, fn, interleaved, reason",
    [
        ("trig_in_float64", rope_tables(trig_dtype=torch.float64), False, "not computed in float32"),
        ("scaled_after_rounding", rope_tables(scale=1.25, scale_after_rounding=True), False, "after a rounding"),
        ("scaled_after_a_round_trip", rope_tables(scale=1.25, widen_before_scale=True), False, "after a rounding"),
        ("doubled_angles", rope_tables(angle_factor=2.0), False, "not trig(position * frequency)"),
        ("neox_tables_read_as_pairs", rope_tables(), True, "not trig(position * frequency)"),
        ("pairs_read_as_neox", rope_tables(interleaved=True), False, "not trig(position * frequency)"),
        ("cos_and_sin_scaled_apart", rope_tables(scale=1.25, sin_scale=1.5), False, "scaled or rounded differently"),
        ("halves_of_other_angles", rope_tables(join_after_trig=lambda f: f * 2), False, "not trig(position * frequency)"),
        ("halves_rounded_apart", rope_tables(join_after_trig=lambda f: f.half().float()), False, "not trig(position"),
    ],
)
def test_other_math_keeps_its_tables(name, fn, interleaved, reason) -> None:
    _, source = angle_source(fn, angle_inputs(), interleaved)
    assert isinstance(source, str) and reason in source, source


def test_angles_from_a_third_tensor_or_a_matmul_keep_their_tables(monkeypatch) -> None:
    def scaled_by_a_tensor(inv_freq, position_ids, factor):
        return rope_tables()(inv_freq * factor, position_ids)

    _, source = angle_source(scaled_by_a_tensor, (*angle_inputs(), torch.tensor(0.5)))
    assert isinstance(source, str) and "3 tensors" in source, source

    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")  # the bmm stays a bmm
    _, source = angle_source(rope_tables(), angle_inputs())
    assert isinstance(source, str) and "1 tensors" in source, source


@pytest.mark.parametrize(
    "name, second_half, reason",
    [
        ("scaled_apart", lambda f: torch.cos(f) * 1.5, "joins pieces scaled or rounded differently"),
        ("rounded_apart", lambda f: torch.cos(f).to(torch.float16).float(), "joins pieces scaled or rounded differently"),
        ("not_a_trig", lambda f: torch.ones_like(f), "computed with aten.ones_like.default"),
    ],
)
def test_halves_joined_unlike_keep_their_tables(name, second_half, reason) -> None:
    """A table whose halves are joined after the trig function folds only when every half is the same trig
    function of the angles, scaled and rounded alike."""

    def tables(inv_freq, position_ids):
        freqs = position_ids[0, :, None].float() * inv_freq[None, :].float()
        cos = torch.cat((torch.cos(freqs), second_half(freqs)), dim=-1)
        sin = torch.cat((torch.sin(freqs), torch.sin(freqs)), dim=-1)
        return cos, sin

    _, source = angle_source(tables, angle_inputs())
    assert isinstance(source, str) and reason in source, source


def rows_of(tables_fn, rows):
    """The tables of `tables_fn` cut to `rows` (a slice, or a callable on each table) after the trig function."""

    def tables(inv_freq, position_ids):
        return tuple(rows(t) if callable(rows) else t[rows] for t in tables_fn(inv_freq, position_ids))

    return tables


@pytest.mark.parametrize(
    "name, rows, n_tokens, first, step",
    [
        ("a_run_of_rows", slice(2, 6), 4, 2, 1),
        ("every_other_row", slice(1, 9, 2), 4, 1, 2),
        ("the_last_row", slice(9, 10), 1, 9, 1),
        ("one_row_for_every_token", lambda t: t[4:5].expand(3, -1), 3, 4, 0),
    ],
)
def test_tokens_reading_part_of_the_positions_read_them_evenly_spaced(name, rows, n_tokens, first, step) -> None:
    """Tables cut after the trig function from tables over more positions (a draft's context rows of a table
    over context and noise): the source is the positions input, read from `first` every `step`, and its
    formula gives the cut tables' bits at the real inputs."""
    inv_freq = angle_inputs()[0]
    positions = torch.randint(0, 40000, (1, 10))
    fn = rows_of(rope_tables(), rows)
    graph_module, source = angle_source(fn, (inv_freq, positions), n_tokens=n_tokens)
    assert not isinstance(source, str), source
    assert placeholder_index(graph_module, source.positions) == 1
    assert (source.first, source.step) == (first, step)
    per_token = grouped_gemv.token_positions(positions, source.first, source.step, n_tokens)
    angle = per_token.float()[:, None] * inv_freq.float()[torch.arange(ROTARY_DIM) % (ROTARY_DIM // 2)][None, :]
    for trig, table in zip((torch.cos, torch.sin), fn(inv_freq, positions)):
        assert torch.equal(table, (trig(angle) * source.scale).to(source.rounded_to))


@pytest.mark.parametrize(
    "name, rows, batch, reason",
    [
        ("rows_out_of_order", lambda t: torch.cat([t[5:6], t[2:3], t[7:8], t[0:1]]), 1, "not evenly spaced"),
        ("positions_shared_by_a_batch", slice(0, 4), 2, "not distinct"),
    ],
)
def test_tokens_reading_positions_out_of_step_keep_their_tables(name, rows, batch, reason) -> None:
    inv_freq = angle_inputs()[0]
    positions = torch.randint(0, 40000, (1, 10)).expand(batch, -1)
    _, source = angle_source(rows_of(rope_tables(), rows), (inv_freq, positions), n_tokens=4)
    assert isinstance(source, str) and reason in source, source


def test_too_many_positions_to_replay_keep_their_tables(monkeypatch) -> None:
    monkeypatch.setattr(rotary_angles, "MAX_GATHERED_POSITIONS", 8)
    _, source = angle_source(rows_of(rope_tables(), slice(0, 4)), (angle_inputs()[0], torch.arange(10)[None]), n_tokens=4)
    assert isinstance(source, str) and "too many to replay" in source, source
