"""CUDA cases of the K/V materialization and grouped GEMV kernels, sized for a memory checker.

    compute-sanitizer --tool memcheck python tests/gpu_sanitize_cases.py [NAME_PART ...]

Runs the Triton kernel on the inputs most likely to go out of bounds (cache edges, out-of-range positions
inside torch.compile, strided and padded heads, per-layer cos/sin tables, 4-D projections whose heads sit
apart in a per-group QKV buffer, tiny shapes) and compares every result with the float64 reference of
tests/test_fused_kv_op.py, the TMA grouped GEMM on Hopper, plus the KV-cache writes of tests/test_cache_writes.py and the grouped GEMM's K
epilogue of tests/test_k_epilogue.py. Exits nonzero on any mismatch; memcheck reports bad accesses.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from test_cache_writes import LAYOUTS, check_cache_write
from test_k_epilogue import CASES as EPILOGUE_CASES
from test_k_epilogue import Case as EpilogueCase
from test_k_epilogue import run_case as check_k_epilogue
from test_fused_kv_op import Case, check_all_variants, make_inputs, reference, assert_close_to_reference

from fx_fusion.kernels import grouped_gemm_tma
from fx_fusion.kernels.grouped_gemv import grouped_gemv_supported, grouped_linear_reference, launch_grouped_gemv
from fx_fusion.kernels.ops import fused_norm_rope_stacked

CASES = {
    "positions-at-cache-edges": Case(edge_positions=True, max_pos=7),
    "strided-kv-wide": Case(kv_layout="wide"),
    "strided-kv-token-stride": Case(kv_layout="token_stride", dtype=torch.float16),
    "strided-kv-elem-stride": Case(kv_layout="elem_stride", dtype=torch.float32, interleaved=True),
    "head-dim-80-padded": Case(head_dim=80, num_kv_heads=3, rotary_dim=40),
    "head-dim-80-per-token": Case(head_dim=80, rope="per_token", interleaved=True),
    "head-dim-256": Case(head_dim=256, total_ctx=5),
    "one-token-one-layer": Case(total_ctx=1, n_layers=1),
    "one-token-one-layer-one-head": Case(total_ctx=1, n_layers=1, num_kv_heads=1, head_dim=128),
    "many-rows-partial-tile": Case(total_ctx=333, num_kv_heads=8, head_dim=128, n_layers=5),
    "gemma-norm-partial-rotary": Case(head_dim=80, rotary_dim=32, norm_weight_offset=1.0, norm_weight_in_float32=True),
    "round-once-partial-rotary-interleaved": Case(head_dim=80, rotary_dim=48, interleaved=True,
                                                  norm_weight_in_float32=True, norm_round_before_rope=False),
    "per-layer-tables-strided-partial-rotary": Case(rope="per_layer_strided", head_dim=80, rotary_dim=48,
                                                    interleaved=True, num_kv_heads=3),
    "grouped-heads-4d-padded": Case(proj="grouped", head_dim=80, rotary_dim=40, num_kv_heads=3, total_ctx=9),
    "per-layer-norm-pointers-16": Case(norm="per_layer", n_layers=16, total_ctx=5, head_dim=80, rotary_dim=40),
}


def compiled_out_of_range_positions() -> None:
    """Inside torch.compile the eager range check is skipped; the kernel must clamp, not read outside."""
    case = Case(total_ctx=6, max_pos=5, dtype=torch.float32)
    inputs = make_inputs(case, "cuda")
    wild = torch.tensor([-100, -1, 0, 4, 5, 1 << 40], device="cuda")
    expected = reference(case, dataclasses.replace(inputs, positions=wild.clamp(0, case.max_pos - 1)))[0]

    def draft(kv, weight, eps, cache, positions):
        return fused_norm_rope_stacked(kv, weight, eps, cache, positions, case.num_kv_heads, case.head_dim, case.rot)

    k_out, _ = torch.compile(draft, fullgraph=True)(inputs.kv, inputs.k_norm_weight[0], inputs.eps, inputs.cos, wild)
    assert_close_to_reference(k_out, expected, case.dtype)


def strided_positions() -> None:
    """positions = buffer[:, 0] (stride 2): the kernel must follow the stride, not read the decoys."""
    case = Case(total_ctx=9, max_pos=7)
    inputs = make_inputs(case, "cuda")
    strided = torch.stack([inputs.positions, torch.full_like(inputs.positions, 1 << 40)], dim=1)[:, 0]
    k_out, _ = fused_norm_rope_stacked(
        inputs.kv, inputs.k_norm_weight[0], inputs.eps, inputs.cos, strided, case.num_kv_heads, case.head_dim, case.rot
    )
    assert_close_to_reference(k_out, reference(case, inputs)[0], case.dtype)


def compiled_angles_from_the_positions_end() -> None:
    """z-lab DFlash's draft for one sequence, compiled: its noise rows' launches compute cos / sin from the
    last position ids (a view into them, offset by the context's), and must read nothing past them."""
    from test_spelling_corpus import test_zlab_draft_of_one_sequence_on_cuda_computes_the_tables_bits

    test_zlab_draft_of_one_sequence_on_cuda_computes_the_tables_bits()


def grouped_gemv(
    n: int, rows: int, hidden: int, n_weights: int, dtype: torch.dtype, bias: bool, strided: bool,
    split_k: int | None = None, swap_ab: bool | None = None, block_t: int | None = None,
) -> None:
    """The grouped GEMV kernel on shapes with tails (tokens, rows, hidden), more weights than one launch
    takes, a transposed x and weights cut from a wider parameter, into a column slice of a poisoned buffer;
    `split_k`, `swap_ab` and `block_t` override the heuristic's."""
    torch.manual_seed(n * 7 + rows)
    parent = torch.randn(n_weights, rows, hidden + (5 if strided else 0), device="cuda", dtype=dtype)
    weights = [parent[i, :, :hidden] for i in range(n_weights)]
    biases = [torch.randn(rows, device="cuda", dtype=dtype) for _ in range(n_weights)] if bias else []
    x = torch.randn(hidden, n, device="cuda", dtype=dtype).t() if strided else torch.randn(n, hidden, device="cuda", dtype=dtype)
    buffer = torch.full((n, n_weights * rows + 3), float("nan"), device="cuda", dtype=dtype)
    out = buffer[:, 1 : 1 + n_weights * rows]
    assert grouped_gemv_supported(x, weights, biases, out)
    launch_grouped_gemv(x, weights, biases, out, split_k=split_k, swap_ab=swap_ab, block_t=block_t)
    expected = grouped_linear_reference(x, weights, biases)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance * hidden**0.5)
    assert buffer[:, 0].isnan().all() and buffer[:, -2:].isnan().all(), "wrote outside out"


GEMV_CASES = {
    "gemv-one-token-tails": dict(n=1, rows=40, hidden=1000, n_weights=3, dtype=torch.bfloat16, bias=False, strided=False),
    "gemv-3-tokens-bias-strided": dict(n=3, rows=48, hidden=777, n_weights=5, dtype=torch.float16, bias=True, strided=True),
    "gemv-17-tokens-dot-tails": dict(n=17, rows=72, hidden=300, n_weights=2, dtype=torch.bfloat16, bias=True, strided=False),
    "gemv-64-tokens-fp32-18-weights": dict(n=64, rows=16, hidden=96, n_weights=18, dtype=torch.float32, bias=False, strided=True),
    "gemv-split-k-3-tails": dict(n=5, rows=40, hidden=1000, n_weights=18, dtype=torch.bfloat16, bias=True, strided=True, split_k=3),
    "gemv-split-k-8-one-token": dict(n=1, rows=1024, hidden=4096, n_weights=2, dtype=torch.bfloat16, bias=False, strided=False, split_k=8),
    # the heuristic's own split past 16 tokens (two weights of 4096 features), a partial token tile
    "gemv-heuristic-split-100-tokens": dict(n=100, rows=1024, hidden=4096, n_weights=2, dtype=torch.bfloat16, bias=True, strided=False),
    # the weight rows as the MMA's M: row, token and K tails; 100 tokens in one 128-token tile
    "gemv-swap-ab-17-tokens-tails": dict(n=17, rows=72, hidden=300, n_weights=18, dtype=torch.bfloat16, bias=True, strided=True, swap_ab=True),
    "gemv-swap-ab-100-tokens-one-tile": dict(n=100, rows=1024, hidden=4096, n_weights=3, dtype=torch.bfloat16, bias=False, strided=False, swap_ab=True, block_t=128),
}


def tma_grouped_gemm(n: int, rows: int, hidden: int, n_weights: int, bias: bool) -> None:
    """The TMA grouped GEMM with token, row and K tails (no multiple of any tile), row blocks of one
    parameter, into an aligned column slice of a poisoned buffer (8 columns in, 16 bytes)."""
    torch.manual_seed(n + rows)
    param = torch.randn(n_weights * rows, hidden, device="cuda", dtype=torch.bfloat16)
    weights = list(param.split(rows))
    biases = [torch.randn(rows, device="cuda", dtype=torch.bfloat16) for _ in range(n_weights)] if bias else []
    x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
    buffer = torch.full((n, n_weights * rows + 24), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = buffer[:, 8 : 8 + n_weights * rows]
    assert grouped_gemm_tma.unsupported_reason(x, weights, biases, out) is None
    grouped_gemm_tma.launch(x, weights, biases, out)
    expected = grouped_linear_reference(x, weights, biases)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2 * hidden**0.5)
    assert buffer[:, :8].isnan().all() and buffer[:, 8 + out.shape[1] :].isnan().all(), "wrote outside out"


TMA_CASES = {
    "tma-333-tokens-6-weights-bias": dict(n=333, rows=328, hidden=1096, n_weights=6, bias=True),
    "tma-300-tokens-18-weights": dict(n=300, rows=136, hidden=520, n_weights=18, bias=False),
    "tma-1000-tokens-2-weights": dict(n=1000, rows=1024, hidden=4096, n_weights=2, bias=False),
}


def check_on_cuda(case: Case) -> None:
    check_all_variants(case, make_inputs(case, "cuda"))


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    failures = []
    checks = {name: functools.partial(check_on_cuda, case) for name, case in CASES.items()}
    checks["compiled-out-of-range-positions"] = compiled_out_of_range_positions
    checks["strided-positions"] = strided_positions
    checks.update({name: functools.partial(grouped_gemv, **shape) for name, shape in GEMV_CASES.items()})
    if torch.cuda.get_device_capability() >= (9, 0):
        checks.update({name: functools.partial(tma_grouped_gemm, **shape) for name, shape in TMA_CASES.items()})
    for layout in LAYOUTS:  # slots of -1 and past the cache skipped, guard regions around every cache
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            checks[f"cache-write-{layout}-{str(dtype)[6:]}"] = functools.partial(check_cache_write, layout, dtype, "cuda")
    for norm in ("stacked", "per_layer"):  # 8 layers per launch; per-layer norm weights as pointers
        checks[f"cache-write-11-layers-{norm}"] = functools.partial(
            check_cache_write, "static", torch.bfloat16, "cuda", n_layers=11, norm=norm
        )
    for name in ("one_token", "partial_token_tile", "two_launches", "split_k", "qkv_groups", "token_major",
                 "positions_interleaved", "partial_rotary", "per_layer_tables", "bias", "angles",
                 "angles_interleaved_partial", "angles_one_token", "angles_partial_rotate_half", "swap_ab",
                 "swap_ab_angles_interleaved", "swap_ab_float32_split_k"):  # fmt: skip
        checks[f"k-epilogue-{name}"] = functools.partial(check_k_epilogue, EPILOGUE_CASES[name], "cuda")
    # real widths: the heuristic's unsplit 4-stage launches (5 layers, up to 32 tokens; on Hopper with the
    # weight rows as the MMA's M), 64-token tiles, K splits (one layer)
    for layers, tokens in ((5, 1), (5, 32), (5, 100), (1, 1)):
        real = EpilogueCase(tokens=tokens, layers=layers, heads=8, head_dim=128, hidden=4096)
        checks[f"k-epilogue-{layers}-layers-{tokens}-tokens"] = functools.partial(check_k_epilogue, real, "cuda")
    real_angles = EpilogueCase(tokens=17, layers=5, heads=8, head_dim=128, hidden=4096, tables="angles")
    checks["k-epilogue-5-layers-17-tokens-angles"] = functools.partial(check_k_epilogue, real_angles, "cuda")
    heads_256 = EpilogueCase(tokens=32, layers=2, heads=4, head_dim=256, hidden=2048, tables="angles", swap_ab=True)
    checks["k-epilogue-2-layers-32-tokens-heads-256-swap-ab"] = functools.partial(check_k_epilogue, heads_256, "cuda")
    unswapped = dataclasses.replace(real_angles, tokens=32, swap_ab=False)  # the launch off Hopper
    checks["k-epilogue-5-layers-32-tokens-angles-no-swap"] = functools.partial(check_k_epilogue, unswapped, "cuda")
    checks["compiled-zlab-angles-from-the-positions-end"] = compiled_angles_from_the_positions_end
    selected = sys.argv[1:]  # names containing any of these (default: every case)
    checks = {name: check for name, check in checks.items() if not selected or any(p in name for p in selected)}
    for name, check in checks.items():
        try:
            check()
            torch.cuda.synchronize()
            print(f"ok    {name}")
        except Exception as error:  # report every case, then fail
            failures.append(name)
            print(f"FAIL  {name}: {type(error).__name__}: {error}")
    print(f"{len(checks) - len(failures)}/{len(checks)} cases passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
