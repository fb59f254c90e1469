"""Uncaptured draft context K/V, back to back: torch.compile default vs fx_fusion, the columns interleaved.

    python benchmarks/bench_uncaptured.py [--workloads a,b] [--seq-lens 1,16,...] [--repeats 16] [--dynamic] [--out DIR]

Without CUDA graphs a call up to T ~ 1024 is bound by host work, and this host's speed drifts by up to 2x
over seconds, so timing one column after the other compares the drift. Here both columns are compiled in
one process and timed in the same rounds: each round times one block of back-to-back calls (at least
--block-ms long, one synchronize at its end, as a decode loop calls the draft) of every column, the order
alternating between rounds (`bench_whole_model.block_times_interleaved`). Cells: the median per-call time
over the rounds with its 10th-90th percentile, and the ratio of the medians with the 10th-90th percentile
of the per-round ratios. Outputs are checked against eager first (relative Frobenius error < 2e-2).
The workloads are bench_module's (`fx_fusion.drafts.build_workload`); writes bench_uncaptured.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_module  # noqa: E402
import bench_whole_model  # noqa: E402
import fx_fusion.backend  # noqa: E402,F401  (registers the backend when no entry point did)
from fx_fusion.drafts import build_workload, example_inputs  # noqa: E402

COLUMNS = ("inductor", "fx_fusion")


def compiled_call(model, inputs: tuple, backend: str, reference, dynamic: bool = False) -> callable:
    """The warmed-up compiled call of `model` on `inputs`, its outputs checked against `reference`."""
    with bench_whole_model.caches_off():  # the pass runs (no compiled graph served from a cache)
        compiled = torch.compile(model, backend=backend, dynamic=dynamic)
        error = bench_module.rel_error(compiled(*inputs), reference)
    if not error < 2e-2:
        raise RuntimeError(f"{backend}: relative error {error:.3g} against eager")
    return lambda: compiled(*inputs)


def measure(workload: str, seq_len: int, device: torch.device, dtype: torch.dtype, args) -> dict:
    model = build_workload(workload, dtype=dtype, device=device)
    inputs = example_inputs(model, seq_len=seq_len, device=device)
    reference = model(*inputs)
    torch._dynamo.reset()  # once per model: the columns' compiled code lives side by side
    calls = {column: compiled_call(model, inputs, column, reference, args.dynamic) for column in COLUMNS}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = bench_whole_model.block_times_interleaved(calls, args, sync)
    ratios = sorted(f / i for f, i in zip(times["fx_fusion"]["rounds_us"], times["inductor"]["rounds_us"]))
    return {
        "workload": workload,
        "T": seq_len,
        **{column: times[column] for column in COLUMNS},
        "ratio": times["fx_fusion"]["median_us"] / times["inductor"]["median_us"],
        "ratio_p10": bench_whole_model._percentile(ratios, 0.1),
        "ratio_p90": bench_whole_model._percentile(ratios, 0.9),
    }


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# fx-fusion: draft context K/V uncaptured, back to back (columns interleaved)",
        "",
        f"{meta['device']}; torch {meta['torch']}; {meta['dtype']}, batch 1"
        f"{', dynamic=True' if meta.get('dynamic') else ''}; {meta['repeats']} rounds, blocks of "
        f">= {meta['block_ms']} ms. Cells: median us per call (10th-90th percentile over rounds); ratio: "
        "fx_fusion / torch.compile, ratio of the medians (10th-90th percentile of the per-round ratios).",
        "",
        "| workload | T | torch.compile | fx_fusion | fx_fusion / torch.compile |",
        "|---|---:|---:|---:|---:|",
    ]
    cell = lambda c: f"{c['median_us']:.1f} ({c['p10_us']:.1f}-{c['p90_us']:.1f})"  # noqa: E731
    for row in rows:
        lines.append(
            f"| {row['workload']} | {row['T']} | {cell(row['inductor'])} | {cell(row['fx_fusion'])} | "
            f"{row['ratio']:.2f} ({row['ratio_p10']:.2f}-{row['ratio_p90']:.2f}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(bench_module.DEFAULT_WORKLOADS))
    parser.add_argument("--seq-lens", default=",".join(map(str, bench_module.DEFAULT_SEQ_LENS)))
    parser.add_argument("--repeats", type=int, default=16, help="rounds (each times one block per column)")
    parser.add_argument("--block-ms", type=float, default=50.0, help="minimum length of one block")
    parser.add_argument("--min-calls", type=int, default=10, help="minimum calls per block")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only for smoke runs")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dynamic", action="store_true", help="compile with dynamic=True (symbolic token count)")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.set_grad_enabled(False)
    meta = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, dtype=args.dtype, repeats=args.repeats, block_ms=args.block_ms, dynamic=args.dynamic,
    )
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for workload in args.workloads.split(","):
        for seq_len in map(int, args.seq_lens.split(",")):
            rows.append(measure(workload, seq_len, device, dtype, args))
            r = rows[-1]
            print(f"{workload} T={seq_len}: torch.compile {r['inductor']['median_us']:.1f} us, "
                  f"fx_fusion {r['fx_fusion']['median_us']:.1f} us, ratio {r['ratio']:.2f}", flush=True)
            with open(os.path.join(args.out, "bench_uncaptured.json"), "w") as f:  # after every row
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    text = markdown(rows, meta)
    with open(os.path.join(args.out, "bench_uncaptured.md"), "w") as f:
        f.write(text)
    print(text)
    slower = [f"{r['workload']} T={r['T']}" for r in rows if r["ratio_p10"] > 1.0]
    print("fx_fusion slower in most rounds at: " + (", ".join(slower) if slower else "no point"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
