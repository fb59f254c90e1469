"""The TMA grouped GEMM against cuBLAS, and its tilings, on one GPU (CUDA-graphed kernel times).

    python benchmarks/bench_grouped_gemm_tma.py [--tokens 256,384,512,768,1024] [--weights 10] [--epilogue] [--out F.json]

For each token count: G weights [rows, hidden] (bf16, default Qwen3-8B's K/V: 1024 x 4096) over x [T, hidden],
timed as a CUDA graph of --copies calls (per call: the replay's median over --copies), columns side by side:
one cuBLAS GEMM per weight into its column slice, one cuBLAS GEMM over a stacked copy of the weights (what a
framework that stacks its weights at load time runs), the TMA kernel with `launch_config`'s choice, and each
variant of --variants, BLOCK_N:num_stages[:num_warps[:warp_specialize]] (warp_specialize 1: Triton splits
the tile loop between a producer warp group that loads tiles and consumer warp groups that multiply them). Every column's output is checked against float64 first; a variant that fails to compile is
reported as such. With --epilogue the weights are L = G / 2 layers' K and V ([K_0, V_0, K_1, ...], heads of
128 dims) and every column also normalises and rotates each layer's K (per-layer norm weights, per-token
cos/sin tables): the GEMMs above followed by the materialization kernel, against the TMA kernel's own
epilogue (`tma_epilogue`, and each variant with it). Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from fx_fusion import cuda_graphs
from fx_fusion.kernels import grouped_gemm_tma as tma
from fx_fusion.kernels.fused_kv_materialize import launch_fused_kv_materialize
from fx_fusion.kernels.grouped_gemv import KEpilogue, grouped_linear_reference, k_epilogue_unsupported_reason

HEAD_DIM = 128

DEFAULT_VARIANTS = "128:4,128:5,256:3"  # 256 x 4 stages needs more shared memory than an H200 has


def graphed_per_call_us(fn, copies: int) -> float:
    """Median replay time of a CUDA graph of `copies` calls of fn, divided by copies."""
    replay = cuda_graphs.capture(lambda: [fn() for _ in range(copies)])
    return do_bench(replay, warmup=25, rep=200) * 1e3 / copies


def with_k_epilogue(columns: dict, variants: dict, x, weights, out, layers: int, rows: int):
    """The columns followed by the materialization kernel over each layer's K, plus the TMA kernel's own
    epilogue (as chosen and per variant); k_out [layers, T, heads, 128] and a check of it against the
    materialization kernel run on the plain TMA kernel's output (relative error)."""
    n, heads = x.shape[0], rows // HEAD_DIM
    k_out = x.new_empty((layers, n, heads, HEAD_DIM))
    norms = [torch.rand(HEAD_DIM, device=x.device, dtype=x.dtype) + 0.5 for _ in range(layers)]
    angles = torch.rand(n, HEAD_DIM, device=x.device) * 6
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    k_heads = out.view(n, layers, 2, heads, HEAD_DIM)[:, :, 0]  # [K_0, V_0, K_1, V_1, ...]

    def materialize(k_target):
        launch_fused_kv_materialize(
            k_heads, None, norms, None, 1e-6, cos, sin, None, k_target, None, heads, HEAD_DIM, HEAD_DIM, False, 0.0,
            False, True, interpret=x.device.type != "cuda",
        )  # fmt: skip

    def then_materialize(fn):
        def run():
            fn()
            materialize(k_out)
        return run

    epilogue = KEpilogue(k_out, 0, 2 * rows, HEAD_DIM, norms, None, 1e-6, cos, sin, None, HEAD_DIM, False, 0.0, False, True)
    assert k_epilogue_unsupported_reason(rows, out.shape[1], epilogue, out) is None  # any T: the launch is direct
    fused = {"tma_epilogue": lambda: tma.launch(x, weights, [], out, k_epilogue=epilogue)}
    for variant, options in variants.items():
        if options["BLOCK_N"] == HEAD_DIM:
            fused[f"tma_epilogue[{variant}]"] = lambda o=options: tma.launch(x, weights, [], out, k_epilogue=epilogue, **o)
    tma.launch(x, weights, [], out)
    expected = x.new_empty(k_out.shape)
    materialize(expected)
    expected = expected.double()

    def check() -> float:
        return ((k_out.double() - expected).norm() / expected.norm()).item()

    return {name: then_materialize(fn) for name, fn in columns.items()} | fused, k_out, check


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="256,384,512,768,1024")
    parser.add_argument("--weights", default="10", help="comma-separated weight counts")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="BLOCK_N:num_stages,...")
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--epilogue", action="store_true", help="K norm + RoPE too (see above)")
    parser.add_argument("--out", default="bench_grouped_gemm_tma.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    results = []
    for g in (int(v) for v in args.weights.split(",")):
        weights = [torch.randn(args.rows, args.hidden, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(g)]
        stacked = torch.cat(weights)
        for n in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(n, args.hidden, device="cuda", dtype=torch.bfloat16)
            out = x.new_empty((n, g * args.rows))
            expected = grouped_linear_reference(x, weights, [])
            columns = {
                "per_weight": lambda: [torch.mm(x, w.t(), out=out[:, i * args.rows : (i + 1) * args.rows]) for i, w in enumerate(weights)],
                "stacked": lambda: torch.mm(x, stacked.t(), out=out),
                "tma": lambda: tma.launch(x, weights, [], out),
            }
            variants = {}
            for variant in args.variants.split(","):
                block_n, stages, *more = (int(v) for v in variant.split(":"))
                options = {"BLOCK_N": block_n, "num_stages": stages}
                if more:
                    options["num_warps"] = more[0]
                if len(more) > 1:
                    options["WARP_SPECIALIZE"] = bool(more[1])
                variants[variant] = options
                columns[f"tma[{variant}]"] = lambda o=options: tma.launch(x, weights, [], out, **o)
            if args.epilogue:
                columns, k_out, k_check = with_k_epilogue(columns, variants, x, weights, out, g // 2, args.rows)
            row = {"T": n, "G": g, "default": tma.launch_config(n, args.rows, g, x.device), "us": {}}
            for name, fn in columns.items():
                out.fill_(float("nan"))
                try:
                    fn()
                except Exception as error:  # a variant Triton cannot build on this GPU
                    row["us"][name] = f"FAIL ({type(error).__name__}: {str(error)[:200]})"
                    continue
                error = ((out.double() - expected).norm() / expected.norm()).item()
                if args.epilogue:
                    k_out.fill_(float("nan"))
                    fn()
                    error = max(error, k_check())
                if not error < 1e-2:
                    row["us"][name] = f"FAIL (relative error {error:.3g})"
                    continue
                row["us"][name] = round(graphed_per_call_us(fn, args.copies), 1)
            results.append(row)
            print(json.dumps({"T": n, "G": g, **row["us"]}), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
