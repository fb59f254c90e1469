"""Tests of the grouped GEMM's K epilogue (`grouped_gemv.KEpilogue`): K heads normalised and rotated as the
tiles holding them are written, and of its lowering (`op_lowering._fuse_k_epilogues`).

Kernel cases run through the interpreter (CPU, TRITON_INTERPRET=1) and compiled (CUDA, skipped without a
GPU). The projection is compared with a float64 reference; k_out with float64 norm/RoPE math on the
kernel's own (rounded) projection, and with the materialization kernel run on that projection on the same
backend, within one rounding at the head's scale (the two kernels sum the squares of a head in different
orders). Outputs start as NaN.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fx_fusion import drafts
from fx_fusion.diagnostics import RecordSink
from fx_fusion.kernels import grouped_gemv
from fx_fusion.kernels.fused_kv_materialize import launch_fused_kv_materialize
from fx_fusion.kernels.grouped_gemv import KEpilogue, RotaryAngles, k_epilogue_unsupported_reason, launch_grouped_gemv
from fx_fusion.op_lowering import _k_columns

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
INTERPRETER_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
@pytest.fixture
def device(triton_device: str) -> str:
    """The device to build inputs on (conftest's triton_device: the interpreter on CPU, or CUDA)."""
    return triton_device


@dataclasses.dataclass
class Case:
    tokens: int = 3
    layers: int = 3
    heads: int = 2
    head_dim: int = 16
    hidden: int = 40
    dtype: torch.dtype = torch.bfloat16
    interleaved: bool = False
    rotary_dim: int | None = None  # None: head_dim
    norm: str = "list"  # "list" (one weight per layer), "table" ([layers, head_dim]), "none"
    # "shared" per-token cos/sin, "per_layer", "positions" (cos/sin cache), "angles" (computed in the kernel
    # from inv_freq and strided positions, scaled by 1.25; the reference reads the same math's tables)
    tables: str = "shared"
    eps_tensor: bool = False
    weight_in_float32: bool = False
    round_before_rope: bool = True
    # "kv": per layer [K, V] weights; "k_then_v": every K then every V; "qkv_groups": per layer one weight
    # [Q0 K0 V0 Q1 K1 V1 ...] by heads (K heads 3 head_dims apart)
    layout: str = "kv"
    bias: bool = False
    token_major: bool = False
    split_k: int | None = None
    swap_ab: bool | None = None  # None: the heuristic's choice
    weights_transposed: bool = False  # each weight a view W.t() of a [hidden, rows] tensor (`x @ W` weights)


def weights_and_columns(case: Case, gen, device):
    """The grouped weights and (column, block_stride, head_stride) of K head h of layer l."""
    hd = case.heads * case.head_dim

    def randn(rows, hidden):
        if case.weights_transposed:
            return (torch.randn(hidden, rows, generator=gen) / 6).to(case.dtype).to(device).t()
        return (torch.randn(rows, hidden, generator=gen) / 6).to(case.dtype).to(device)

    if case.layout == "kv":
        weights = [randn(hd, case.hidden) for _ in range(2 * case.layers)]
        return weights, (0, 2 * hd, case.head_dim)
    if case.layout == "k_then_v":
        weights = [randn(hd, case.hidden) for _ in range(2 * case.layers)]
        return weights, (0, hd, case.head_dim)
    weights = [randn(3 * hd, case.hidden) for _ in range(case.layers)]
    return weights, (case.head_dim, 3 * hd, 3 * case.head_dim)


def make_inputs(case: Case, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rotary_dim = case.rotary_dim or case.head_dim
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(case.dtype).to(device)
    weights, columns = weights_and_columns(case, gen, device)
    biases = [(torch.randn(w.shape[0], generator=gen) / 4).to(case.dtype).to(device) for w in weights] if case.bias else []
    norm_rows = (torch.randn(case.layers, case.head_dim, generator=gen) / 4 + 1).to(case.dtype).to(device)
    norm_weights = {"list": list(norm_rows), "table": [norm_rows], "none": []}[case.norm]
    eps = (torch.rand(case.layers, generator=gen) * 1e-2).to(device) if case.eps_tensor else None
    positions = rotary_angles = None
    if case.tables == "angles":
        inv_freq = (10000.0 ** (-torch.arange(0, rotary_dim, 2) / rotary_dim)).to(device)
        token_positions = torch.randint(0, 4096, (case.tokens, 2), generator=gen).to(device)[:, 1]  # strided
        freq = torch.arange(rotary_dim, device=device)
        freq = freq // 2 if case.interleaved else freq % (rotary_dim // 2)
        table_angles = token_positions.float()[:, None] * inv_freq[freq][None, :]
        cos, sin = ((f(table_angles) * 1.25).to(case.dtype) for f in (torch.cos, torch.sin))
        rotary_angles = RotaryAngles(inv_freq, token_positions, 1.25, rounded=True)
    elif case.tables == "positions":
        angles = torch.rand(64, rotary_dim // 2, generator=gen) * 6
        cos, sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device), None
        positions = torch.randint(0, 64, (case.tokens,), generator=gen).to(device)
    else:
        shape = (case.layers, case.tokens, rotary_dim) if case.tables == "per_layer" else (case.tokens, rotary_dim)
        angles = torch.rand(*shape, generator=gen) * 6
        cos, sin = angles.cos().to(case.dtype).to(device), angles.sin().to(case.dtype).to(device)
    return x, weights, biases, columns, norm_rows, norm_weights, eps, cos, sin, positions, rotary_angles


def k_view(out: torch.Tensor, case: Case, columns) -> torch.Tensor:
    """K heads of the grouped output as [tokens, layers, heads, head_dim]."""
    column, block_stride, head_stride = columns
    return out.as_strided(
        (case.tokens, case.layers, case.heads, case.head_dim),
        (out.stride(0), block_stride, head_stride, 1),
        out.storage_offset() + column,
    )


def float64_k(k: torch.Tensor, case: Case, norm_rows, eps, cos, sin, positions) -> torch.Tensor:
    """Norm + RoPE in float64, no intermediate rounding: [layers, tokens, heads, head_dim]."""
    rotary_dim, half = case.rotary_dim or case.head_dim, (case.rotary_dim or case.head_dim) // 2
    k = k.double()
    if case.norm != "none":
        eps64 = eps.double().view(1, -1, 1, 1) if eps is not None else 1e-6
        weight = norm_rows.double().view(1, case.layers, 1, -1) + 0.5
        k = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + eps64) * weight
    if positions is not None:
        rows = cos[positions.long()].double()
        c, s = rows[:, :half], rows[:, half:]
        c, s = (t.repeat_interleave(2, -1) if case.interleaved else torch.cat([t, t], -1) for t in (c, s))
        c, s = c[:, None, None], s[:, None, None]
    elif cos.dim() == 3:
        c, s = cos.double().transpose(0, 1)[:, :, None], sin.double().transpose(0, 1)[:, :, None]
    else:
        c, s = cos.double()[:, None, None], sin.double()[:, None, None]
    rot = k[..., :rotary_dim]
    if case.interleaved:
        partner = torch.stack([-rot[..., 1::2], rot[..., 0::2]], dim=-1).flatten(-2)
    else:
        partner = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * c + partner * s, k[..., rotary_dim:]], dim=-1).transpose(0, 1)


def run_case(case: Case, device: str) -> None:
    if case.tables == "angles" and device == "cpu" and INTERPRETER_VERSION < (3, 9):
        pytest.skip(f"Triton {triton.__version__}'s interpreter fails on the in-kernel cos/sin (3.6's does; 3.9's runs it)")
    x, weights, biases, columns, norm_rows, norm_weights, eps, cos, sin, positions, angles = make_inputs(case, device)
    n_columns = sum(w.shape[0] for w in weights)
    out = torch.full((case.tokens, n_columns), float("nan"), dtype=case.dtype, device=device)
    shape = (case.layers, case.tokens, case.heads, case.head_dim)
    if case.token_major:
        k_out = torch.full((case.tokens, case.layers, case.heads, case.head_dim), float("nan"), dtype=case.dtype, device=device).transpose(0, 1)
    else:
        k_out = torch.full(shape, float("nan"), dtype=case.dtype, device=device)
    rotary_dim = case.rotary_dim or case.head_dim
    offset = 0.5 if case.norm != "none" else 0.0
    epilogue = KEpilogue(
        k_out, *columns, norm_weights, eps, 1e-6, cos, sin, positions, rotary_dim, case.interleaved, offset,
        case.weight_in_float32, case.round_before_rope, angles,
    )  # fmt: skip
    assert k_epilogue_unsupported_reason(weights[0].shape[0], n_columns, epilogue, out) is None
    launch_grouped_gemv(x, weights, biases, out, k_epilogue=epilogue, split_k=case.split_k, swap_ab=case.swap_ab)

    expected = torch.cat([x.double() @ w.double().t() for w in weights], dim=1)
    if biases:
        expected += torch.cat(biases).double()
    tolerance = 1e-5 if case.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)

    k = k_view(out, case, columns)
    reference = float64_k(k, case, norm_rows if case.norm != "none" else None, eps, cos, sin, positions)
    torch.testing.assert_close(k_out.double(), reference, rtol=2 * tolerance, atol=2 * tolerance)

    materialized = torch.full(shape, float("nan"), dtype=case.dtype, device=device)
    table = norm_rows if case.norm != "none" else None
    launch_fused_kv_materialize(
        k, None, table, eps, 1e-6, cos, sin, positions, materialized, None, case.heads, case.head_dim, rotary_dim,
        case.interleaved, offset, case.weight_in_float32, case.round_before_rope, interpret=device == "cpu",
    )  # fmt: skip
    # The kernels sum a head's squares in different orders, so a normalised element may round one way in one
    # and the other way in the other: apart by at most one rounding at the scale of the head's largest
    # element (RoPE mixes two elements, so a small output can carry its inputs' rounding). With angles the
    # tables' cos and sin (torch's) and the kernel's (Triton's) may differ in the last bit before rounding.
    materialized = materialized.double()
    relative = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-20}[case.dtype]
    if case.tables == "angles" and device == "cpu" and case.dtype == torch.bfloat16:
        # The interpreter converts float32 to bfloat16 by truncation (torch and the GPU round to nearest), so
        # its cos and sin can sit a table ulp (2**-7 at 1.25) from torch's, and RoPE scales that by two elements.
        relative *= 4
    bound = materialized.abs().amax(-1, keepdim=True) * relative
    assert ((k_out.double() - materialized).abs() <= bound).all()


CASES = {
    "neox": Case(),
    "interleaved": Case(interleaved=True),
    "partial_rotary": Case(rotary_dim=8),
    "partial_rotary_interleaved": Case(rotary_dim=8, interleaved=True),
    "norm_table": Case(norm="table"),
    "no_norm": Case(norm="none"),
    "positions": Case(tables="positions"),
    "positions_interleaved": Case(tables="positions", interleaved=True),
    "per_layer_tables": Case(tables="per_layer"),
    "angles": Case(tables="angles"),
    "angles_interleaved_partial": Case(tables="angles", interleaved=True, rotary_dim=8),
    "angles_float32": Case(tables="angles", dtype=torch.float32),
    "angles_float16": Case(tables="angles", dtype=torch.float16),
    "angles_one_token": Case(tables="angles", tokens=1),  # one head-wide row per token
    "angles_partial_rotate_half": Case(tables="angles", rotary_dim=8),  # likewise: no tile serves
    "angles_partial_token_tile": Case(tables="angles", tokens=17),
    "eps_tensor": Case(eps_tensor=True),
    "weight_in_float32": Case(weight_in_float32=True),
    "float32_through_rope": Case(weight_in_float32=True, round_before_rope=False),
    "float32": Case(dtype=torch.float32),
    "float16": Case(dtype=torch.float16),
    "one_token": Case(tokens=1),
    "partial_token_tile": Case(tokens=17),
    "k_then_v": Case(layout="k_then_v"),
    "qkv_groups": Case(layout="qkv_groups", heads=3),
    "bias": Case(bias=True),
    "token_major": Case(token_major=True),
    "split_k": Case(split_k=3, hidden=200),
    "two_launches": Case(layers=9, tokens=2),  # 18 weights: K heads in both launches of 16 and 2
    # the weight rows as the MMA's M (tl.dot over the transposed tiles, the accumulator transposed back)
    "swap_ab": Case(swap_ab=True, tokens=17),
    "weights_transposed": Case(weights_transposed=True, tokens=5),
    "weights_transposed_swap_ab_split_k": Case(weights_transposed=True, swap_ab=True, split_k=3, hidden=200, tokens=17),
    "swap_ab_angles_interleaved": Case(swap_ab=True, tables="angles", interleaved=True),
    "swap_ab_float32_split_k": Case(swap_ab=True, dtype=torch.float32, split_k=3, hidden=200),
}


@pytest.mark.parametrize("name", list(CASES))
def test_epilogue_matches_references(name: str, device: str) -> None:
    run_case(CASES[name], device)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.integers(1, 20),
    layers=st.integers(1, 4),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([16, 32]),
    rotary_eighths=st.sampled_from([2, 4, 8]),
    interleaved=st.booleans(),
    norm=st.sampled_from(["list", "table", "none"]),
    tables=st.sampled_from(["shared", "per_layer", "positions", "angles"]),
    layout=st.sampled_from(["kv", "k_then_v", "qkv_groups"]),
    split_k=st.sampled_from([None, 2]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_property_interpreter(
    tokens, layers, heads, head_dim, rotary_eighths, interleaved, norm, tables, layout, split_k, dtype, monkeypatch
) -> None:
    """Random compositions of the epilogue's options through the interpreter, against both references."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = Case(
        tokens=tokens, layers=layers, heads=heads, head_dim=head_dim, hidden=80, dtype=dtype,
        rotary_dim=head_dim * rotary_eighths // 8, interleaved=interleaved, norm=norm, tables=tables,
        layout=layout, split_k=split_k,
    )  # fmt: skip
    run_case(case, "cpu")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize(
    "layers, tokens, tables",
    [(5, 1, "shared"), (5, 16, "shared"), (5, 32, "shared"), (5, 100, "shared"), (1, 1, "shared"), (4, 16, "shared"),
     (5, 17, "angles"), (5, 32, "angles"), (1, 1, "angles"), (1, 16, "angles")],
)  # fmt: skip
def test_epilogue_at_real_widths(layers: int, tokens: int, tables: str, monkeypatch) -> None:
    """Qwen3-8B-like widths on CUDA: layers of 8 heads x 128 over hidden 4096, the launch heuristic's own
    tiles, pipeline stages, K splits (5 layers unsplit in 4 stages up to 32 tokens, 1 and 4 split) and, on
    Hopper, the weight rows as the MMA's M,
    with cos / sin read from tables or computed in the kernel."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    run_case(Case(tokens=tokens, layers=layers, heads=8, head_dim=128, hidden=4096, tables=tables), "cuda")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("layers, tokens, tables", [(5, 1, "shared"), (5, 16, "angles"), (5, 32, "angles"), (1, 16, "shared")])
def test_weight_rows_as_the_mma_n_at_real_widths(layers: int, tokens: int, tables: str, monkeypatch) -> None:
    """swap_ab off at Qwen3-8B-like widths on CUDA: the launch other GPUs than Hopper get (tokens as the
    MMA's M), the heuristic's tiles, stages and K splits otherwise."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = Case(tokens=tokens, layers=layers, heads=8, head_dim=128, hidden=4096, tables=tables, swap_ab=False)
    run_case(case, "cuda")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("swap_ab", [None, True], ids=["heuristic", "rows_as_m"])
@pytest.mark.parametrize("tokens", [1, 32])
def test_heads_of_256_dims_on_cuda(tokens: int, swap_ab: bool | None, monkeypatch) -> None:
    """Gemma-wide heads (256 dims: BLOCK_K halved to keep a stage's weight tile at 32 KiB), as the heuristic
    launches them (tokens as the MMA's M) and swapped (M = 256 over the heuristic's 4 warps)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = Case(tokens=tokens, layers=2, heads=4, head_dim=256, hidden=2048, tables="angles", swap_ab=swap_ab)
    run_case(case, "cuda")


def _epilogue(k_out, columns=(0, 64, 16), norm_weights=(), angles=None):
    cos = torch.ones(k_out.shape[1], 16)
    return KEpilogue(
        k_out, *columns, list(norm_weights), None, 1e-6, cos, cos, None, 16, False, 0.0, False, True, angles
    )  # fmt: skip


def _angles(inv_freq=torch.ones(8), positions=torch.arange(3)):
    return _epilogue(torch.empty(2, 3, 2, 16), angles=RotaryAngles(inv_freq, positions, 1.0, True))


@pytest.mark.parametrize(
    "name, epilogue, rows, reason",
    [
        ("head_dim_not_power_of_2", _epilogue(torch.empty(2, 3, 2, 24), (0, 96, 24)), 48, "power of 2"),
        ("misaligned_column", _epilogue(torch.empty(2, 3, 2, 16), (8, 64, 16)), 32, "aligned"),
        ("weights_not_whole_heads", _epilogue(torch.empty(2, 3, 2, 16)), 40, "aligned"),
        ("overlapping_heads", _epilogue(torch.empty(2, 3, 2, 16), (0, 16, 16)), 32, "overlap"),
        ("heads_past_the_output", _epilogue(torch.empty(2, 3, 2, 16), (64, 64, 16)), 32, "outside"),
        ("inv_freq_not_half_the_rotary_dim", _angles(inv_freq=torch.ones(16)), 32, "inv_freq must be [8]"),
        ("integer_inv_freq", _angles(inv_freq=torch.ones(8, dtype=torch.int32)), 32, "must be floating"),
        ("a_position_per_layer", _angles(positions=torch.arange(6).view(2, 3)), 32, "positions must be [3]"),
        ("boolean_positions", _angles(positions=torch.ones(3, dtype=torch.bool)), 32, "integer or floating"),
        ("too_many_norm_weights", _epilogue(torch.empty(2, 3, 2, 16), norm_weights=[torch.ones(16)] * 17), 32, "norm"),
        (
            "norm_weights_of_different_strides",
            _epilogue(torch.empty(2, 3, 2, 16), norm_weights=[torch.ones(16), torch.ones(32)[::2]]), 32, "strides",
        ),
    ],
)
def test_unsupported_epilogues(name, epilogue, rows, reason) -> None:
    out = torch.empty(3, 128)
    assert reason in k_epilogue_unsupported_reason(rows, out.shape[1], epilogue, out)


def _fake_node(value: torch.Tensor) -> torch.fx.Node:
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["val"] = value
    return node


@pytest.mark.parametrize(
    "view, heads, expected",
    [
        (lambda out: out[:, :192].view(3, 3, 64)[:, :, :32], 2, (0, 64, 16)),  # [K V] per layer
        (lambda out: out[:, 32:128].view(3, 2, 48).view(3, 2, 3, 16)[:, :, :2], 2, (32, 48, 16)),
        (lambda out: out[:, 16:144].view(3, 2, 64)[:, :, :48].view(3, 2, 3, 16)[:, :, :2], 2, (16, 64, 16)),
        (lambda out: out[:, 64:96].view(3, 1, 32), 2, (64, 224, 16)),  # one block: stride past the output
        (lambda out: out[:, :192].view(3, 6, 32)[:, :, :16], 1, (0, 32, 32)),  # one head per block
    ],
)
def test_k_columns_from_fake_values(view, heads, expected) -> None:
    with torch._subclasses.FakeTensorMode():
        out = torch.empty(3, 224)
        k = view(out)
        assert _k_columns(_fake_node(out), _fake_node(k), heads, 16) == expected


def test_k_columns_need_the_output_rows_as_tokens() -> None:
    with torch._subclasses.FakeTensorMode():
        out = torch.empty(4, 64)
        strided_tokens = out[::2].view(2, 2, 32)[:, :, :16]  # token stride of two rows
        assert _k_columns(_fake_node(out), _fake_node(strided_tokens), 1, 16) is None
        one_token = out[:1].view(1, 2, 32)[:, :, :16]
        assert _k_columns(_fake_node(out[:1]), _fake_node(one_token), 1, 16) == (0, 32, 32)
        copied = torch.empty_strided((4, 2, 16), (64, 32, 1))  # laid out as a view would be, own storage
        assert _k_columns(_fake_node(out), _fake_node(copied), 1, 16) is None


# --------------------------------------------------------------------------------------------------------
# Compiled drafts (CUDA): the epilogue reaches Inductor's code
# --------------------------------------------------------------------------------------------------------


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.usefixtures("fresh_compile")
@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("graphed", [False, True], ids=["plain", "cudagraphs"])
@pytest.mark.parametrize("family, n_layers, tokens", [("qwen3", 5, 1), ("qwen3", 1, 16), ("llama", 3, 32)])
def test_compiled_draft_runs_one_kernel_for_its_context_kv(family, n_layers, tokens, graphed) -> None:
    """The grouped GEMM normalises and rotates K itself: Inductor's code launches the grouped kernel and no
    materialization kernel; the results match eager and the run without the epilogue."""
    build = drafts.qwen3_context_kv if family == "qwen3" else drafts.llama_context_kv
    module = build(n_layers, hidden_size=2048, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
    inputs = drafts.example_inputs(module, seq_len=tokens)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        ref = module(*inputs)
        options = {"min_layers": 1, "triton.cudagraphs": graphed}
        compiled = torch.compile(module, backend="fx_fusion", options=options)
        got, codes = torch._inductor.utils.run_and_get_code(compiled, *inputs)
        got = [t.clone() for t in got]  # CUDA graphs reuse their output memory
        for _ in range(2):
            replayed = [t.clone() for t in compiled(*inputs)]
        torch._dynamo.reset()
        unfused = torch.compile(module, backend="fx_fusion", options={**options, "gemm_epilogue": False})(*inputs)
    code = "\n".join(codes)
    assert records[0].gemm_epilogues == 1 and not records[0].ops_kept, records[0].gemm_epilogue_notes
    assert "_grouped_gemv_kernel" in code and "_fused_kv_materialize_kernel" not in code
    assert records[-1].gemm_epilogues == 0
    for g, r, u, again in zip(got, ref, unfused, replayed):
        assert _relative_error(g, r) < 1e-2
        assert _relative_error(g, u) < 4e-3 and torch.equal(g, again)


@pytest.mark.usefixtures("fresh_compile")
@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize(
    "family, batch, tokens", [("qwen3", 1, 1), ("qwen3", 2, 2), ("llama", 1, 4), ("llama", 2, 8), ("qwen3", 1, 32)]
)
def test_compiled_draft_computes_cos_sin_with_the_tables_bits(family, batch, tokens) -> None:
    """The launch's own cos / sin are the bits of Inductor's tables: K and V equal, bit for bit, those of
    the same compile reading the tables (rotary_angles_in_kernel=False), and Inductor's code computes no
    table (no tl_math.cos)."""
    build = drafts.qwen3_context_kv if family == "qwen3" else drafts.llama_context_kv
    module = build(3, hidden_size=2048, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
    inputs = drafts.example_inputs(module, batch=batch, seq_len=tokens)
    runs = {}
    with torch.no_grad():
        for in_kernel in (True, False):
            records = []
            with RecordSink.collect(records):
                compiled = torch.compile(module, backend="fx_fusion", options={"rotary_angles_in_kernel": in_kernel})
                outputs, codes = torch._inductor.utils.run_and_get_code(compiled, *inputs)
            runs[in_kernel] = records[0], "\n".join(codes), outputs
            torch._dynamo.reset()
        ref = module(*inputs)
    (record, code, got), (_, table_code, from_tables) = runs[True], runs[False]
    assert record.gemm_epilogues == record.rotary_angles_in_kernel == 1, record.rotary_angle_notes
    assert "tl_math.cos" not in code and "tl_math.cos" in table_code
    for g, t, r in zip(got, from_tables, ref):
        assert torch.equal(g, t)
        assert _relative_error(g, r) < 1e-2


@pytest.mark.usefixtures("fresh_compile")
@pytest.mark.gpu
@CUDA
def test_past_the_epilogue_token_count_the_norm_rope_keeps_its_kernel() -> None:
    """More tokens than MAX_EPILOGUE_TOKENS: the grouped GEMM, then the materialization kernel (measured
    faster there); the record says why."""
    module = drafts.qwen3_context_kv(3, hidden_size=2048, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
    inputs = drafts.example_inputs(module, seq_len=grouped_gemv.MAX_EPILOGUE_TOKENS + 1)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        got, codes = torch._inductor.utils.run_and_get_code(torch.compile(module, backend="fx_fusion"), *inputs)
        ref = module(*inputs)
    code = "\n".join(codes)
    assert records[0].gemm_epilogues == 0 and "tokens" in records[0].gemm_epilogue_notes[0]
    assert "_grouped_gemv_kernel" in code and "_fused_kv_materialize_kernel" in code
    for g, r in zip(got, ref):
        assert _relative_error(g, r) < 1e-2


def test_epilogue_launch_heuristic(monkeypatch) -> None:
    """The measured choices: head-wide tiles, K split (up to 8 ways for up to 16 tokens, 4 past that) only
    while programs are fewer than half the SMs, else unsplit launches of up to 32 tokens in 4 pipeline
    stages; on Hopper, 16-bit heads of 128 dims up to 32 tokens with the weight rows as the MMA's M in 8
    warps; the interpreter never splits."""
    monkeypatch.setattr(grouped_gemv, "_sm_count", lambda index: 132)  # an H200
    monkeypatch.setattr(grouped_gemv, "_capability", lambda index: (9, 0))
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16

    def config(n, n_weights, dtype=bf16, device=cuda, head_dim=128):
        return grouped_gemv.epilogue_launch_config(n, 1024, 4096, n_weights, head_dim, dtype, device)

    # 5 layers' K and V: 80 head tiles (>= 66) -> unsplit, 4 stages up to 32 tokens, Triton's default past that
    unsplit = {"BLOCK_T": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "SPLIT_K": 1, "num_stages": 4, "SWAP_AB": True}
    assert config(1, 10) == unsplit and config(16, 10) == unsplit
    assert config(32, 10) == {**unsplit, "BLOCK_T": 32}
    assert config(64, 10) == {"BLOCK_T": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "SPLIT_K": 1}
    # 4 layers: 64 head tiles -> 3 splits (ceil(132 / 64)), pipelined as Triton's default
    assert config(1, 8)["SPLIT_K"] == 3 and "num_stages" not in config(1, 8)
    # one layer: 16 head tiles -> 8 splits, then 4
    assert config(1, 2)["SPLIT_K"] == 8 and config(32, 2)["SPLIT_K"] == 4 and config(1, 2)["SWAP_AB"]
    assert config(1, 2, torch.float32)["BLOCK_K"] == 64  # 256 bytes of a weight row per step
    wide = config(1, 10, head_dim=256)
    assert wide["BLOCK_N"] == 256 and wide["BLOCK_K"] == 64  # a stage's weight tile stays at 32 KiB
    # the weight rows stay tl.dot's N: float32 (no warp-group MMA), heads of 64 or 256 dims (not measured),
    # other GPUs, the interpreter
    unswapped = (config(1, 10, torch.float32), config(1, 10, head_dim=64), wide, config(1, 2, device=torch.device("cpu")))
    for plain in unswapped:
        assert "SWAP_AB" not in plain and plain["num_warps"] == 4
    monkeypatch.setattr(grouped_gemv, "_capability", lambda index: (8, 0))
    assert "SWAP_AB" not in config(1, 10)
    assert config(1, 2, device=torch.device("cpu"))["SPLIT_K"] == 1


@pytest.mark.usefixtures("fresh_compile")
def test_cpu_graphs_keep_the_separate_norm_rope_and_say_why() -> None:
    """On CPU the K epilogue (a CUDA launch) is not traced at all; the record says why per call."""
    module = drafts.qwen3_context_kv(3)
    inputs = drafts.example_inputs(module, seq_len=4)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        got = torch.compile(module, backend="fx_fusion")(*inputs)
        ref = module(*inputs)
    (record,) = records
    assert record.fused_groups and record.gemm_epilogues == 0
    assert record.gemm_epilogue_notes and all("CUDA" in note for note in record.gemm_epilogue_notes)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------------
# The lowering's graph surgery on CPU, with conftest's stand-in body (`k_epilogue_on_cpu`)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("fresh_compile", "k_epilogue_on_cpu")
@pytest.mark.parametrize("model", ["qwen3_draft", "llama_draft", "qwen3_gqa_decoder", "llama_mha_decoder"])
def test_lowering_fuses_pairs_with_the_right_columns(model) -> None:
    """With the launch replaced by conftest's stand-in on CPU, the lowering (hoisting the norm/RoPE inputs,
    replacing both calls, dropping K's views) gives eager's results: drafts of K and V, and decoders whose
    Q and K heads are blocks of one QKV output (strided 4-D K views, token-major outputs)."""
    import transformers

    torch.manual_seed(0)
    if model.endswith("draft"):
        module = (drafts.qwen3_context_kv if model.startswith("qwen3") else drafts.llama_context_kv)(3)
        inputs = drafts.example_inputs(module, seq_len=5)
    else:
        config_class = transformers.Qwen3Config if model.startswith("qwen3") else transformers.LlamaConfig
        kv_heads = 2 if "gqa" in model else 4
        config = config_class(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=kv_heads, head_dim=16, vocab_size=100,
        )  # fmt: skip
        causal_lm = (transformers.Qwen3ForCausalLM if model.startswith("qwen3") else transformers.LlamaForCausalLM)
        module = causal_lm(config).eval()
        inputs = (torch.randint(0, 100, (1, 6)),)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        ref = module(*inputs)
        got = torch.compile(module, backend="fx_fusion")(*inputs)
    (record,) = records
    assert record.gemm_epilogues == len(record.fused_groups) >= 1, record.gemm_epilogue_notes
    if hasattr(ref, "logits"):
        ref, got = (ref.logits,), (got.logits,)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("fresh_compile", "k_epilogue_on_cpu")
@pytest.mark.parametrize(
    "dtype, batch, tokens, shared_positions, angle_limit",
    [(torch.float32, 2, 2, False, None), (torch.float32, 2, 2, True, None), (torch.bfloat16, 1, 4, False, None),
     (torch.bfloat16, 1, 9, False, None), (torch.bfloat16, 1, 5, False, 4)],
)  # fmt: skip
def test_lowering_computes_cos_sin_in_the_launch_and_drops_the_tables(
    dtype, batch, tokens, shared_positions, angle_limit, monkeypatch
) -> None:
    """Hugging Face's rotary tables read back to position_ids and inv_freq: up to `max_angle_tokens` tokens
    (MAX_ANGLE_TILE_TOKENS for Qwen3's whole-head rotate-half; `angle_limit` sets it) the launch gets those
    (the stand-in computes cos / sin from them) and the graph no longer computes the tables; past it the
    launch reads the tables, and the record says why. Shared positions: one row of position ids expanded
    over the batch (stride 0)."""
    from fx_fusion import op_lowering

    if angle_limit is not None:
        monkeypatch.setattr(grouped_gemv, "MAX_ANGLE_TILE_TOKENS", angle_limit)
    trig_counts = []
    lower = op_lowering.lower_fused_ops

    def lower_and_count(graph, *args):
        lowered = lower(graph, *args)
        trig_counts.append(sum(n.target in (torch.ops.aten.cos.default, torch.ops.aten.sin.default) for n in graph.nodes))
        return lowered

    monkeypatch.setattr(op_lowering, "lower_fused_ops", lower_and_count)
    module = drafts.qwen3_context_kv(3).to(dtype)
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in drafts.example_inputs(module, batch=batch, seq_len=tokens)]
    if shared_positions:
        inputs[1] = inputs[1][:1].expand(batch, -1)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        ref = module(*inputs)
        got = torch.compile(module, backend="fx_fusion")(*inputs)
    (record,) = records
    if batch * tokens <= (angle_limit or grouped_gemv.MAX_ANGLE_TILE_TOKENS):
        assert record.gemm_epilogues == record.rotary_angles_in_kernel == 1, record.rotary_angle_notes
        assert "computing their own cos/sin" in record.summary()
        assert trig_counts == [2]  # the stand-in's cos and sin; the graph's own went with the tables
    else:
        assert record.gemm_epilogues == 1 and record.rotary_angles_in_kernel == 0
        assert "reading tables is faster" in record.rotary_angle_notes[0]
        assert trig_counts == [2]  # the graph's tables, read by the launch
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=tolerance, atol=tolerance)


@pytest.mark.usefixtures("fresh_compile", "k_epilogue_on_cpu")
def test_a_failing_read_back_costs_the_angles_only(monkeypatch) -> None:
    """Should reading the tables back raise, the launch still carries the K norm/RoPE, reading the tables,
    and the record names the error."""
    from fx_fusion import rotary_angles

    def broken(*args, **kwargs):
        raise RuntimeError("read-back broke")

    monkeypatch.setattr(rotary_angles, "find_angle_source", broken)
    module = drafts.qwen3_context_kv(2)
    inputs = drafts.example_inputs(module, seq_len=2)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        ref = module(*inputs)
        got = torch.compile(module, backend="fx_fusion")(*inputs)
    (record,) = records
    assert record.gemm_epilogues == 1 and record.rotary_angles_in_kernel == 0
    assert "RuntimeError: read-back broke" in record.rotary_angle_notes[0]
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fresh_compile", "k_epilogue_on_cpu")
def test_lowering_leaves_symbolic_token_counts_to_the_separate_kernels() -> None:
    """With dynamic shapes the K columns have no fixed place in the grouped output's rows: the pair is
    lowered one by one (the note says why) and the results still match eager."""
    module = drafts.qwen3_context_kv(3)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        compiled = torch.compile(module, backend="fx_fusion", dynamic=True)
        for seq_len in (5, 7):
            inputs = drafts.example_inputs(module, seq_len=seq_len)
            for g, r in zip(compiled(*inputs), module(*inputs)):
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert records and all(r.fused_groups and r.gemm_epilogues == 0 for r in records)
    notes = [note for r in records for note in r.gemm_epilogue_notes]
    assert notes and all("symbolic" in note for note in notes)
