"""The TMA grouped GEMM against cuBLAS, and its tilings, on one GPU (CUDA-graphed kernel times).

    python benchmarks/bench_grouped_gemm_tma.py [--tokens 256,384,512,768,1024] [--weights 10] [--out F.json]

For each token count: G weights [rows, hidden] (bf16, default Qwen3-8B's K/V: 1024 x 4096) over x [T, hidden],
timed as a CUDA graph of --copies calls (per call: the replay's median over --copies), columns side by side:
one cuBLAS GEMM per weight into its column slice, one cuBLAS GEMM over a stacked copy of the weights (what a
framework that stacks its weights at load time runs), the TMA kernel with `launch_config`'s choice, and each
(BLOCK_N, num_stages) of --variants. Every column's output is checked against float64 first. Writes JSON to
--out.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from fx_fusion import cuda_graphs
from fx_fusion.kernels import grouped_gemm_tma as tma
from fx_fusion.kernels.grouped_gemv import grouped_linear_reference

DEFAULT_VARIANTS = "128:4,128:5,256:3"  # 256 x 4 stages needs more shared memory than an H200 has


def graphed_per_call_us(fn, copies: int) -> float:
    """Median replay time of a CUDA graph of `copies` calls of fn, divided by copies."""
    replay = cuda_graphs.capture(lambda: [fn() for _ in range(copies)])
    return do_bench(replay, warmup=25, rep=200) * 1e3 / copies


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="256,384,512,768,1024")
    parser.add_argument("--weights", default="10", help="comma-separated weight counts")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="BLOCK_N:num_stages,...")
    parser.add_argument("--copies", type=int, default=10)
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
            for variant in args.variants.split(","):
                block_n, stages = (int(v) for v in variant.split(":"))
                columns[f"tma[{variant}]"] = lambda b=block_n, s=stages: tma.launch(
                    x, weights, [], out, BLOCK_N=b, num_stages=s
                )
            row = {"T": n, "G": g, "default": tma.launch_config(n, args.rows, g, x.device), "us": {}}
            for name, fn in columns.items():
                out.fill_(float("nan"))
                fn()
                error = ((out.double() - expected).norm() / expected.norm()).item()
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
