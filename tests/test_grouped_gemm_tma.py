"""Tests of the TMA grouped GEMM (`kernels/grouped_gemm_tma.py`): several linears over one input, tiles moved
by the tensor memory accelerator, one persistent launch.

Numeric cases run the kernel through Triton's interpreter (CPU, TRITON_INTERPRET=1) and compiled (CUDA of
compute capability 9.0 or newer, skipped elsewhere) against a float64 reference, outputs poisoned with NaN;
the columns beside an output that is a view must stay NaN. Sizes leave tails everywhere: N, R and K are
multiples of none of the tiles (16 on CPU, 128 x 128/256 x 64 on CUDA).
"""

from __future__ import annotations

import pytest
import torch
import triton
from test_grouped_gemv import Case, assert_matches_reference, make_weights, make_x, poisoned_out

from fx_fusion import drafts
from fx_fusion.diagnostics import RecordSink
from fx_fusion.kernels import grouped_gemm_tma as tma
from fx_fusion.kernels import grouped_linear as grouped_linear_module
from fx_fusion.kernels.grouped_gemv import MANY_WEIGHTS

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.fixture
def device(triton_device: str) -> str:
    if triton_device == "cuda" and not HOPPER:
        pytest.skip("TMA needs compute capability 9.0 or newer")
    if triton_device == "cpu" and tma._triton_version() < tma.MIN_INTERPRETER_VERSION:
        pytest.skip(f"Triton {triton.__version__}'s interpreter does not run the kernel")
    return triton_device


def _case(device: str, **fields) -> Case:
    """K and R 16-byte multiples in 16-bit (TMA rows), no multiple of a tile; tokens inside the range."""
    defaults = dict(n=300, k=72, rows=40, n_weights=MANY_WEIGHTS, dtype=torch.bfloat16, bias=False)
    if device == "cuda":
        defaults.update(n=333, k=1096, rows=328)
    defaults.update(fields)
    return Case(**defaults)


def run_case(case: Case, device: str, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = make_x(case, device, gen)
    weights, biases = make_weights(case, device, gen)
    out, _ = poisoned_out(case, device)
    assert tma.unsupported_reason(x, weights, biases, out) is None
    tma.launch(x, weights, biases, out)
    assert_matches_reference(out, x, weights, biases)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_matches_reference(dtype: torch.dtype, bias: bool, device: str) -> None:
    run_case(_case(device, dtype=dtype, bias=bias), device)


def test_row_blocks_of_one_parameter_into_a_column_slice(device: str) -> None:
    """Weights cut as row blocks of one parameter (a fused kv linear split), strided biases, out an aligned
    column slice of a wider buffer."""
    case = _case(device, bias=True, bias_layout="strided", out_layout="column_slice")
    gen = torch.Generator().manual_seed(1)
    x = make_x(case, device, gen)
    param = torch.randn(case.n_weights * case.rows, case.k, generator=gen).to(case.dtype).to(device)
    weights = list(param.split(case.rows))
    _, biases = make_weights(case, device, gen)
    buffer = torch.full((case.n, param.shape[0] + 24), float("nan"), dtype=case.dtype, device=device)
    out = buffer[:, 8 : 8 + param.shape[0]]
    assert tma.unsupported_reason(x, weights, biases, out) is None
    tma.launch(x, weights, biases, out)
    assert_matches_reference(out, x, weights, biases)
    assert buffer[:, :8].isnan().all() and buffer[:, 8 + out.shape[1] :].isnan().all()


def test_more_than_one_launch_and_few_weights(device: str) -> None:
    """18 weights: two launches, the second into a column slice of out; 2 weights past 640 tokens."""
    run_case(_case(device, n_weights=18, n=260 if device == "cpu" else 300), device, seed=3)
    run_case(_case(device, n_weights=2, n=650, rows=24 if device == "cpu" else 328), device, seed=4)


def test_token_range() -> None:
    lo, hi = tma.token_range(MANY_WEIGHTS)
    assert lo == 256 and hi == tma.MAX_TOKENS_TMA
    assert tma.token_range(2) == (tma.MIN_TOKENS_FEW_WEIGHTS, tma.MAX_TOKENS_TMA)


@pytest.mark.parametrize(
    "name, change, expect",
    [
        ("float32", dict(dtype=torch.float32), "must share one of"),
        ("too_few_tokens", dict(n=200), "outside (256, 1024]"),
        ("too_many_tokens", dict(n=1100), "outside (256, 1024]"),
        ("few_weights_few_tokens", dict(n_weights=2, n=500), "outside (640, 1024]"),
        ("x_unaligned", dict(x_layout="sliced"), "not laid out for TMA"),
        ("weights_transposed", dict(w_layout="transposed"), "not laid out for TMA"),
        ("rows_not_16_bytes", dict(rows=20), "not laid out for TMA"),
        ("out_transposed", dict(out_layout="transposed"), "not laid out for TMA"),
    ],
)
def test_unsupported(name: str, change: dict, expect: str, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tma, "MIN_INTERPRETER_VERSION", (0, 0))
    case = _case("cpu", **change)
    gen = torch.Generator().manual_seed(0)
    x = make_x(case, "cpu", gen)
    weights, biases = make_weights(case, "cpu", gen)
    out, _ = poisoned_out(case, "cpu")
    reason = tma.unsupported_reason(x, weights, biases, out)
    assert reason is not None and expect in reason, reason


def test_checks_agree_on_real_parameters_and_fake_tensors(monkeypatch) -> None:
    """Alignment is read from a real tensor's address and from a fake one's storage offset: both must refuse
    a parameter one element off a 16-byte boundary and admit the aligned one; weights that differ in shape
    are named as such."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tma, "MIN_INTERPRETER_VERSION", (0, 0))
    case = _case("cpu")
    gen = torch.Generator().manual_seed(0)
    x = make_x(case, "cpu", gen)
    weights, _ = make_weights(case, "cpu", gen)
    out, _ = poisoned_out(case, "cpu")
    flat = torch.zeros(case.rows * case.k + 1, dtype=case.dtype)
    shifted = torch.nn.Parameter(flat[1:].view(case.rows, case.k))  # storage offset 1: 2 bytes off
    aligned = torch.nn.Parameter(weights[0].clone())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in (x, out, shifted, aligned, *weights)]
    fx, fout, fshifted, faligned, *fweights = fake
    for args in ((x, out, shifted, aligned, weights), (fx, fout, fshifted, faligned, fweights)):
        x_, out_, shifted_, aligned_, weights_ = args
        assert tma.unsupported_reason(x_, [aligned_, *weights_[1:]], [], out_) is None
        reason = tma.unsupported_reason(x_, [shifted_, *weights_[1:]], [], out_)
        assert reason is not None and "not laid out for TMA" in reason, reason
        reason = tma.unsupported_reason(x_, [*weights_[:-1], weights_[-1][:-8]], [], out_)
        assert reason is not None and "differ in shape" in reason, reason


def test_cpu_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = _case("cpu")
    gen = torch.Generator().manual_seed(0)
    x, (weights, _) = make_x(case, "cpu", gen), make_weights(case, "cpu", gen)
    assert "TRITON_INTERPRET" in tma.unsupported_reason(x, weights, [], poisoned_out(case, "cpu")[0])


def test_op_dispatches_weights_of_one_shape(device: str, monkeypatch) -> None:
    """grouped_linear takes this kernel past grouped_gemv's tokens for weights of one shape; a GQA layer's Q,
    K and V (rows differ) stay GEMMs."""
    launches, launch = [], tma.launch

    def counted(*args, **kwargs):
        launches.append(args)
        launch(*args, **kwargs)

    monkeypatch.setattr(grouped_linear_module.grouped_gemm_tma, "launch", counted)
    case = _case(device)
    gen = torch.Generator().manual_seed(5)
    x = make_x(case, device, gen)
    for rows, launched in [((case.rows,) * MANY_WEIGHTS, True), ((4 * 64, 64, 64), False)]:
        weights = [torch.randn(r, case.k, generator=gen).to(case.dtype).to(device) for r in rows]
        launches.clear()
        out = torch.ops.fx_fusion.grouped_linear(x, weights, [])
        assert bool(launches) == launched, rows
        assert_matches_reference(out, x, weights, [])


@pytest.mark.skipif(not HOPPER, reason="TMA needs a CUDA device of compute capability 9.0 or newer")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "cpp_wrapper"])
def test_inductor_launches_it_in_a_draft(mode: str, fresh_compile) -> None:
    """A 3-layer draft at 300 tokens: Inductor's generated code launches the TMA kernel (its launcher, the
    C++ wrapper's, or inside a CUDA graph), and the outputs match eager for fresh inputs."""
    module = drafts.qwen3_context_kv(3, dtype=torch.bfloat16, device="cuda")
    kwargs = {"mode": "reduce-overhead"} if mode == "reduce-overhead" else {}
    if mode == "cpp_wrapper":
        kwargs["options"] = {"cpp_wrapper": True}
    compiled = torch.compile(module, backend="fx_fusion", **kwargs)
    records = []
    with torch.no_grad(), RecordSink.collect(records):
        for seed in range(3):
            inputs = drafts.example_inputs(module, seq_len=300, seed=seed)
            if seed == 0:
                got, codes = torch._inductor.utils.run_and_get_code(compiled, *inputs)
                assert "_grouped_gemm_tma_kernel" in "\n".join(codes)
            else:
                got = compiled(*inputs)
            for g, r in zip(got, module(*inputs)):
                torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2)
