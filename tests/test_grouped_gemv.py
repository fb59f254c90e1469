"""Tests of the grouped GEMV/skinny-GEMM kernel (`kernels/grouped_gemv.py`): several linears over one input, one launch.

Every numeric case runs the Triton kernel through the interpreter (CPU, TRITON_INTERPRET=1 set per test and
read at call time) and compiled (CUDA, skipped without a GPU), against a float64 reference. Outputs start
as NaN, so an element the kernel does not write fails the comparison; memory around an output that is a
view must stay NaN.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fx_fusion.kernels import grouped_gemv as gg
from fx_fusion.kernels.grouped_gemv import (
    MANY_WEIGHTS,
    MAX_TOKENS,
    MAX_TOKENS_MANY_WEIGHTS,
    MAX_WEIGHTS_PER_LAUNCH,
    grouped_gemv_supported,
    grouped_gemv_unsupported_reason,
    grouped_linear_reference,
    launch_grouped_gemv,
)
from fx_fusion.kernels import grouped_linear as grouped_linear_module
from fx_fusion.kernels.grouped_linear import equal_row_blocks

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Sizes: R = 20 is no multiple of any BLOCK_N, K = 50 no multiple of any BLOCK_K; N = 1, 3 and 17 leave
# token rows of their tile (16, 16, 32) masked off.
TOKENS = [1, 3, 16, 17]


@pytest.fixture
def device(triton_device: str) -> str:
    """The device to build inputs on (conftest's triton_device: the interpreter on CPU, or CUDA)."""
    return triton_device


# --------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    n: int = 3
    k: int = 50
    rows: int = 20
    n_weights: int = 2
    dtype: torch.dtype = torch.float32
    bias: bool = True
    x_layout: str = "contiguous"  # "contiguous", "transposed" (x = X.t()), "sliced" (every other column of a wider X)
    # "contiguous"; "row_sliced": W_i = P[rows_i, 3:3+K] of a wider parameter P (row stride K + 7);
    # "transposed": W_i = Q_i.t(), Q_i [K, R] contiguous (row stride 1, K stride R)
    w_layout: str = "contiguous"
    out_layout: str = "contiguous"  # "contiguous", "column_slice" (of a wider buffer), "transposed"
    bias_layout: str = "contiguous"  # "contiguous", "strided" (every other element)


def make_x(case: Case, device: str, gen: torch.Generator) -> torch.Tensor:
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(case.dtype).to(device)

    if case.x_layout == "transposed":
        return randn(case.k, case.n).t()
    if case.x_layout == "sliced":
        return randn(case.n, 2 * case.k + 3)[:, 1 : 1 + 2 * case.k : 2]
    return randn(case.n, case.k)


def make_weights(case: Case, device: str, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(case.dtype).to(device)

    g, r, k = case.n_weights, case.rows, case.k
    if case.w_layout == "row_sliced":
        param = randn(g * r + 5, k + 7)
        weights = [param[2 + i * r : 2 + (i + 1) * r, 3 : 3 + k] for i in range(g)]
    elif case.w_layout == "transposed":
        weights = [randn(k, r).t() for _ in range(g)]
    else:
        weights = [randn(r, k) for _ in range(g)]
    if not case.bias:
        return weights, []
    if case.bias_layout == "strided":
        biases = [randn(2 * r)[::2] for _ in range(g)]
    else:
        biases = [randn(r) for _ in range(g)]
    return weights, biases


def poisoned_out(case: Case, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, the buffer it is a view of), all NaN."""
    cols = case.n_weights * case.rows
    if case.out_layout == "column_slice":
        buffer = torch.full((case.n, cols + 9), float("nan"), dtype=case.dtype, device=device)
        return buffer[:, 5 : 5 + cols], buffer
    if case.out_layout == "transposed":
        buffer = torch.full((cols, case.n), float("nan"), dtype=case.dtype, device=device)
        return buffer.t(), buffer
    buffer = torch.full((case.n, cols), float("nan"), dtype=case.dtype, device=device)
    return buffer, buffer


# --------------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------------

# Relative error of one rounding of a float32 value to the output dtype. Triton's interpreter converts
# float32 to bfloat16 by truncation (GPUs round to nearest): one whole ulp there.
ROUNDING = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
SMALLEST_SUBNORMAL = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}


def assert_matches_reference(out: torch.Tensor, x, weights, biases) -> None:
    """|out - ref| <= float32 accumulation error + one rounding to out's dtype, element by element.

    The accumulation bound is K * 2**-23 * sum_k |x_k * w_k| (+|b|): loose for float32 sums, yet 50x
    below what TF32 inputs (10-bit mantissas) would give, so float32 cases also check input_precision.
    """
    dtype = out.dtype
    expected = grouped_linear_reference(x, weights, biases).cpu()
    magnitude = grouped_linear_reference(x.abs(), [w.abs() for w in weights], [b.abs() for b in biases]).cpu()
    actual = out.double().cpu()
    assert not actual.isnan().any(), f"{int(actual.isnan().sum())} output elements unwritten (still NaN)"
    rounding = ROUNDING[dtype]
    if dtype == torch.bfloat16 and out.device.type == "cpu":
        rounding *= 2  # the interpreter truncates
    accumulation = x.shape[1] * 2.0**-23 * magnitude
    bound = accumulation + rounding * (expected.abs() + accumulation) + SMALLEST_SUBNORMAL[dtype]
    error = (actual - expected).abs()
    worst = int((error - bound).argmax())
    assert (error <= bound).all(), (
        f"{int((error > bound).sum())} of {error.numel()} elements off; worst at {divmod(worst, error.shape[1])}: "
        f"{actual.flatten()[worst].item()} vs {expected.flatten()[worst].item()} (bound {bound.flatten()[worst].item():.3g})"
    )


def run_case(case: Case, device: str, seed: int = 0, **overrides) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = make_x(case, device, gen)
    weights, biases = make_weights(case, device, gen)
    out, buffer = poisoned_out(case, device)
    assert grouped_gemv_unsupported_reason(x, weights, biases, out) is None
    launch_grouped_gemv(x, weights, biases, out, **overrides)
    assert_matches_reference(out, x, weights, biases)
    if case.out_layout == "column_slice":  # the columns beside out stay untouched
        assert buffer[:, :5].isnan().all() and buffer[:, 5 + out.shape[1] :].isnan().all()


# --------------------------------------------------------------------------------------------------------
# Numeric cases
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype: torch.dtype, n: int, bias: bool, device: str) -> None:
    run_case(Case(n=n, dtype=dtype, bias=bias), device)


@pytest.mark.parametrize("n", [3, 17])
@pytest.mark.parametrize("n_weights", [1, 2, 5, MAX_WEIGHTS_PER_LAUNCH, MAX_WEIGHTS_PER_LAUNCH + 2])
def test_number_of_weights(n_weights: int, n: int, device: str) -> None:
    """G = 18 takes two launches (16 + 2 weights), each writing its own columns of out."""
    run_case(Case(n=n, n_weights=n_weights, rows=18, k=20, dtype=torch.bfloat16), device)


@pytest.mark.parametrize("out_layout", ["contiguous", "column_slice", "transposed"])
@pytest.mark.parametrize("w_layout", ["contiguous", "row_sliced", "transposed"])
@pytest.mark.parametrize("x_layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("n", [3, 17])
def test_strided_views(n: int, x_layout: str, w_layout: str, out_layout: str, device: str) -> None:
    """Any strides for x, the weights (the same for all) and out, read and written in place."""
    case = Case(n=n, n_weights=3, x_layout=x_layout, w_layout=w_layout, out_layout=out_layout)
    run_case(case, device)


@pytest.mark.parametrize("n", [1, 17])
def test_strided_biases_and_chunked_column_slice(n: int, device: str) -> None:
    """Biases with stride 2; 18 weights (two launches) into a column slice of a wider buffer."""
    case = Case(n=n, n_weights=18, rows=9, k=33, bias_layout="strided", out_layout="column_slice")
    run_case(case, device)


@pytest.mark.parametrize("n", [1, 2, 8, 16, 64])
def test_long_k_multi_step(n: int, device: str) -> None:
    """K over several BLOCK_K steps with a tail, R over several column blocks with a tail."""
    run_case(Case(n=n, k=129, rows=37, n_weights=2, dtype=torch.float16), device)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("split_k", [2, 3, 7])
@pytest.mark.parametrize("n", [1, 17])
def test_split_k(n: int, split_k: int, bias: bool, device: str) -> None:
    """K split over programs (the last to arrive sums the float32 partials): K steps with a tail, two launches
    (18 weights) into a column slice, transposed x; 7 splits of 5 K steps leave none empty (5 splits)."""
    case = Case(n=n, k=129, rows=37, n_weights=18, bias=bias, x_layout="transposed", out_layout="column_slice")
    run_case(case, device, split_k=split_k, block_k=32 if device == "cpu" else 16)


@pytest.mark.parametrize("masked_k", [False, True], ids=["whole_steps", "masked"])
@pytest.mark.parametrize("split_k", [1, 2])
def test_k_in_whole_steps(split_k: int, masked_k: bool, device: str) -> None:
    """K a multiple of BLOCK_K (192 = 6 steps of 32): the loop without K masks (EVEN_K), alone and split
    (3 steps each), and the masked loop on the same shapes."""
    case = Case(n=17, k=192, rows=37, n_weights=3, bias=True, x_layout="transposed", out_layout="column_slice")
    run_case(case, device, split_k=split_k, block_k=32, masked_k=masked_k)


def test_split_k_below_one_is_refused() -> None:
    x, weights, biases, out = _args(dtype=torch.float32)
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        launch_grouped_gemv(x, weights, biases, out, split_k=0)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 17])
def test_weight_rows_as_the_mma_m(n: int, dtype: torch.dtype, split_k: int, device: str) -> None:
    """swap_ab: each step multiplies the transposed tiles (weight rows as M, tokens as N) and the
    accumulator is transposed back: row and token tails, a K tail, bias, transposed x, a column slice."""
    case = Case(n=n, k=129, rows=37, n_weights=3, dtype=dtype, bias=True, x_layout="transposed", out_layout="column_slice")
    run_case(case, device, swap_ab=True, split_k=split_k, block_k=32)


@pytest.mark.parametrize("block_t", [16, 64])
def test_wide_token_tiles_for_few_tokens(block_t: int, device: str) -> None:
    """Tiles wider than the tokens (the `block_t` override): most token rows masked off."""
    gen = torch.Generator().manual_seed(1)
    case = Case(n=2, dtype=torch.bfloat16)
    x = make_x(case, device, gen)
    weights, biases = make_weights(case, device, gen)
    out, _ = poisoned_out(case, device)
    launch_grouped_gemv(x, weights, biases, out, block_t=block_t)
    assert_matches_reference(out, x, weights, biases)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_weights_of_different_rows_run_as_row_blocks(bias: bool, device: str) -> None:
    """A GQA layer's Q beside its K and V (4 + 1 + 1 blocks of gcd rows): one grouped launch, views only."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 40, generator=gen).to(device)
    weights = [torch.randn(rows, 40, generator=gen).to(device) for rows in (4 * 64, 64, 64)]
    biases = [torch.randn(w.shape[0], generator=gen).to(device) for w in weights] if bias else []
    blocks, bias_blocks = equal_row_blocks(weights, biases)
    assert [b.shape[0] for b in blocks] == [64] * 6 and all(b._base is not None for b in blocks[:4])
    assert blocks[0].data_ptr() == weights[0].data_ptr() and len(bias_blocks) == (6 if bias else 0)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # new tensors come filled with NaN: unwritten columns show
    try:
        out = torch.ops.fx_fusion.grouped_linear(x, weights, biases)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert grouped_gemv_supported(x, blocks, bias_blocks, out)
    assert_matches_reference(out, x, weights, biases)
    assert equal_row_blocks(weights[1:], biases[1:])[0] == weights[1:]  # equal rows: left as they are
    narrow = [weights[0][:96], weights[1]]  # gcd 32 < MIN_BLOCK_ROWS: no blocks (per-weight GEMMs)
    assert equal_row_blocks(narrow, [])[0] == narrow


def test_token_limit_counts_the_weights_as_given(device: str, monkeypatch) -> None:
    """Past MAX_TOKENS the op launches the kernel for six or more weights, and counts weights as given: a
    GQA layer's Q, K and V (6 row blocks, but 3 GEMMs, one of them 4x larger) stay GEMMs."""
    launches = []

    def counted_launch(*args, **kwargs):
        launches.append(args)
        launch_grouped_gemv(*args, **kwargs)

    monkeypatch.setattr(grouped_linear_module, "launch_grouped_gemv", counted_launch)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(MAX_TOKENS + 1, 40, generator=gen).to(device)
    for rows, launched in [((16,) * MANY_WEIGHTS, True), ((16,) * (MANY_WEIGHTS - 1), False), ((4 * 64, 64, 64), False)]:
        weights = [torch.randn(r, 40, generator=gen).to(device) for r in rows]
        launches.clear()
        out = torch.ops.fx_fusion.grouped_linear(x, weights, [])
        assert bool(launches) == launched, rows
        assert_matches_reference(out, x, weights, [])


def test_more_tokens_than_max_tokens(device: str) -> None:
    """The launcher itself takes any N (several token blocks), though the dispatcher stops at max_tokens."""
    case = Case(n=gg.max_tokens(2) + 5, k=20, rows=16, dtype=torch.bfloat16, bias=False)
    gen = torch.Generator().manual_seed(2)
    x = make_x(case, device, gen)
    weights, biases = make_weights(case, device, gen)
    out, _ = poisoned_out(case, device)
    assert not grouped_gemv_supported(x, weights, biases, out)
    launch_grouped_gemv(x, weights, biases, out)
    assert_matches_reference(out, x, weights, biases)


def test_no_tokens(device: str) -> None:
    case = Case(n=0)
    gen = torch.Generator().manual_seed(3)
    x = make_x(case, device, gen)
    weights, biases = make_weights(case, device, gen)
    out, _ = poisoned_out(case, device)
    assert grouped_gemv_supported(x, weights, biases, out)
    launch_grouped_gemv(x, weights, biases, out)  # nothing to do, nothing launched


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 20),
    k=st.integers(1, 70),
    rows=st.integers(1, 40),
    n_weights=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_interpreter(n, k, rows, n_weights, dtype, bias, seed, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run_case(Case(n=n, k=k, rows=rows, n_weights=n_weights, dtype=dtype, bias=bias), "cpu", seed=seed)


# --------------------------------------------------------------------------------------------------------
# Applicability, heuristic, reference
# --------------------------------------------------------------------------------------------------------


def _args(n=3, k=8, rows=4, g=2, dtype=torch.bfloat16, bias=True):
    x = torch.randn(n, k).to(dtype)
    weights = [torch.randn(rows, k).to(dtype) for _ in range(g)]
    biases = [torch.randn(rows).to(dtype) for _ in range(g)] if bias else []
    out = torch.empty(n, g * rows, dtype=dtype)
    return x, weights, biases, out


def _refusals():
    """(name, arguments) pairs that grouped_gemv_supported must refuse."""
    x, ws, bs, out = _args()
    yield "no weights", (x, [], [], out)
    yield "3-D x", (x[None], ws, bs, out)
    yield "1-D weight", (x, [ws[0], ws[1][0]], bs, out)
    yield "weight shapes differ", (x, [ws[0], torch.randn(5, 8).bfloat16()], bs, out[:, :9])
    yield "weight strides differ", (x, [ws[0], torch.randn(8, 4).bfloat16().t()], bs, out)
    yield "weight dtypes differ", (x, [ws[0], ws[1].half()], bs, out)
    yield "float64", _args(dtype=torch.float64)
    yield "int8", (x.to(torch.int8), [w.to(torch.int8) for w in ws], [], out.to(torch.int8))
    yield "x dtype differs", (x.float(), ws, bs, out)
    yield "out dtype differs", (x, ws, bs, out.float())
    yield "K differs", (x[:, :7], ws, bs, out)
    yield "out shape", (x, ws, bs, out[:, :7])
    yield "too many tokens", _args(n=MAX_TOKENS + 1, g=MANY_WEIGHTS - 1)
    yield "too many tokens for many weights", _args(n=MAX_TOKENS_MANY_WEIGHTS + 1, g=MANY_WEIGHTS)
    yield "bias count", (x, ws, bs[:1], out)
    yield "bias shape", (x, ws, [bs[0], torch.randn(5).bfloat16()], out)
    yield "bias dtype", (x, ws, [b.float() for b in bs], out)
    yield "bias strides differ", (x, ws, [bs[0], torch.randn(8).bfloat16()[::2]], out)
    yield "empty weights", (x[:, :0], [w[:, :0] for w in ws], bs, out)
    yield "zero rows", (x, [w[:0] for w in ws], [], out[:, :0])


@pytest.mark.parametrize("name,args", list(_refusals()), ids=[name for name, _ in _refusals()])
def test_unsupported(name: str, args, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not grouped_gemv_supported(*args)
    assert isinstance(grouped_gemv_unsupported_reason(*args), str)


def test_supported_and_cpu_needs_interpreter(monkeypatch) -> None:
    args = _args(n=MAX_TOKENS)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert grouped_gemv_supported(*args)
    assert grouped_gemv_supported(*_args(bias=False, dtype=torch.float32))
    assert grouped_gemv_supported(*_args(n=MAX_TOKENS_MANY_WEIGHTS, g=MANY_WEIGHTS))  # more weights, more tokens
    # ... counted as the GEMMs they replace: row blocks of fewer, larger weights keep the lower limit
    assert not grouped_gemv_supported(*_args(n=MAX_TOKENS + 1, g=MANY_WEIGHTS), gemms=MANY_WEIGHTS - 1)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "TRITON_INTERPRET" in grouped_gemv_unsupported_reason(*args)


def test_launch_heuristic(monkeypatch) -> None:
    """The measured tiles: 16-token tiles with long K steps for a few tokens, BLOCK_N giving >= 2 programs
    per SM, 64-token tiles past 64 tokens; K split when fewer programs than SMs, or past 16 tokens fewer
    than 2 per SM over rows of 4096 bf16 features."""
    monkeypatch.setattr(gg, "_sm_count", lambda index: 132)  # an H200
    cuda = torch.device("cuda", 0)
    bf16 = torch.bfloat16
    # qwen3-8b-dflash: 10 weights [1024, 4096]. BLOCK_N 64 -> 160 programs < 264; 32 -> 320.
    for n in (1, 3, 16):
        assert gg.default_launch_config(n, 1024, 4096, 10, bf16, cuda) == {
            "BLOCK_T": 16, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "SPLIT_K": 1,
        }  # fmt: skip
    assert gg.default_launch_config(1, 1024, 4096, 10, torch.float32, cuda)["BLOCK_K"] == 128
    assert gg.default_launch_config(17, 1024, 4096, 10, bf16, cuda) == {
        "BLOCK_T": 32, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "SPLIT_K": 1,
    }  # fmt: skip
    assert gg.default_launch_config(17, 1024, 4096, 10, torch.float32, cuda)["BLOCK_K"] == 64
    # Two weights: even 16-row tiles give 128 programs < 132 SMs -> K split over programs.
    assert gg.default_launch_config(1, 1024, 4096, 2, bf16, cuda) == {
        "BLOCK_T": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "SPLIT_K": 8,
    }  # fmt: skip
    assert gg.default_launch_config(40, 1024, 4096, 2, torch.float32, cuda) == {
        "BLOCK_T": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "SPLIT_K": 4,
    }  # fmt: skip
    # Three weights: 192 programs of 16 rows, no split.
    assert gg.default_launch_config(1, 1024, 4096, 3, bf16, cuda)["SPLIT_K"] == 1
    # Past 64 tokens: several token blocks count toward the programs per SM.
    assert gg.default_launch_config(MAX_TOKENS, 1024, 4096, 10, bf16, cuda) == {
        "BLOCK_T": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "SPLIT_K": 1, "num_stages": 4,
    }  # fmt: skip
    # ... and two weights of 4096 features: 256 programs of 16 rows < 264 -> 64-row tiles, K split
    for n, block_t in ((17, 32), (65, 64), (MAX_TOKENS, 64)):
        assert gg.default_launch_config(n, 1024, 4096, 2, bf16, cuda) == {
            "BLOCK_T": block_t, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "SPLIT_K": 4,
        }  # fmt: skip
    # ... but not over shorter rows (2048 features: no gain measured), nor up to 16 tokens (not measured)
    assert gg.default_launch_config(MAX_TOKENS, 1024, 2048, 2, bf16, cuda) == {
        "BLOCK_T": 64, "BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "SPLIT_K": 1,
    }  # fmt: skip
    assert gg.default_launch_config(64, 1024, 1024, 4, bf16, cuda)["SPLIT_K"] == 1
    assert gg.default_launch_config(16, 2048, 4096, 2, bf16, cuda)["SPLIT_K"] == 1
    # Short K: BLOCK_K no larger than needed (but >= 16).
    assert gg.default_launch_config(1, 1024, 8, 10, bf16, cuda)["BLOCK_K"] == 16


def test_reference_is_float64_cat_of_linears() -> None:
    x, ws, bs, _ = _args(dtype=torch.float32)
    expected = torch.cat([torch.nn.functional.linear(x.double(), w.double(), b.double()) for w, b in zip(ws, bs)], 1)
    actual = grouped_linear_reference(x, ws, bs)
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected)
    assert grouped_linear_reference(x, ws, []).shape == (3, 8)
