"""Per-kernel GPU time of the fx_fusion-compiled module, plain calls and CUDA-graph replays (GPU).

    python benchmarks/kernel_breakdown.py [--workload qwen3-8b-dflash] [--seq-len 8192]

Prints do_bench medians of both forms in alternating rounds (so clock drift shows up as such) and, for
each form, torch.profiler's table of the GPU kernels of 10 calls: which kernel takes the time.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import fx_fusion.backend  # noqa: F401  (registers the backend when no entry point did)
from fx_fusion import cuda_graphs
from fx_fusion.drafts import build_workload, example_inputs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="qwen3-8b-dflash")
    parser.add_argument("--seq-len", type=int, default=8192)
    args = parser.parse_args(argv)
    model = build_workload(args.workload, device="cuda")
    x, pos = example_inputs(model, seq_len=args.seq_len)
    with torch.no_grad():
        compiled = torch.compile(model, backend="fx_fusion")
        for _ in range(3):
            compiled(x, pos)

        def plain():
            return compiled(x, pos)

        graphed = cuda_graphs.capture(plain)
        for round_ in range(3):
            plain_us, graphed_us = do_bench(plain, rep=200) * 1e3, do_bench(graphed, rep=200) * 1e3
            print(f"round {round_}: plain {plain_us:.1f} us, graphed {graphed_us:.1f} us", flush=True)
        for name, fn in (("plain", plain), ("graphed", graphed)):
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
            print(f"--- {name}: GPU kernels of 10 calls")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
