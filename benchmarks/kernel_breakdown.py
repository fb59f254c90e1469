"""Per-kernel GPU timeline of one CUDA-graph replay of each form, L2 emptied by reading before each call (GPU).

    python benchmarks/kernel_breakdown.py [--workloads qwen3-8b-dflash,llama3-8b-ctx] [--seq-lens 1,32]
        [--forms fxf,sglang,inductor] [--calls 30]

Forms (each captured into a CUDA graph by hand, as `bench_module.py`'s *_graph columns):
    fxf        torch.compile(m, backend="fx_fusion")
    sglang     HandFusedContextKV(m, rope="cache"): one GEMM over weights stacked at load time, then the op
    inductor   torch.compile(m)

For each form: the event-timed median of `bench_module.Timer` (the `--l2-flush read` loop), then, from
torch.profiler's CUDA trace of `--calls` calls each after the reading flush, the median of
- each kernel's duration (kernels named in launch order within a call),
- the gap from the flush's end to the call's first kernel (graph launch latency seen by the GPU),
- the gaps between the call's kernels, and its span (first kernel start to last kernel end).
So a difference between two forms reads as kernel time, launch latency or gaps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_module import Timer  # noqa: E402

import fx_fusion.backend  # noqa: E402,F401  (registers the backend when no entry point did)
from fx_fusion import cuda_graphs  # noqa: E402
from fx_fusion.drafts import HandFusedContextKV, build_workload, example_inputs  # noqa: E402

FLUSH_KERNEL = "reduce_kernel"  # torch.sum's CUDA kernel: `Timer.flush`, the reading flush


def calls_from_trace(prof) -> list[list[tuple[str, float, float]]]:
    """The trace's kernels split into calls: each call a list of (name, start_us, end_us) after one flush,
    with the flush itself first."""
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0),
        key=lambda e: e.time_range.start,
    )
    calls: list[list[tuple[str, float, float]]] = []
    for event in kernels:
        item = (event.name, float(event.time_range.start), float(event.time_range.end))
        if FLUSH_KERNEL in event.name:
            calls.append([item])
        elif calls:
            calls[-1].append(item)
    return [c for c in calls if len(c) > 1]


def summarize(calls: list[list[tuple[str, float, float]]]) -> list[str]:
    """Median kernel durations, launch gap, inner gaps and span over calls of one shape."""
    shapes = [tuple(name for name, _, _ in call[1:]) for call in calls]
    common = max(set(shapes), key=shapes.count)
    calls = [c for c, s in zip(calls, shapes) if s == common]
    lines = [f"  {len(calls)} calls of {len(common)} kernels"]
    launch = statistics.median(call[1][1] - call[0][2] for call in calls)
    lines.append(f"  flush end -> first kernel: {launch:7.2f} us")
    for i, name in enumerate(common):
        dur = statistics.median(call[1 + i][2] - call[1 + i][1] for call in calls)
        line = f"  {dur:7.2f} us  {name[:90]}"
        if i:
            gap = statistics.median(call[1 + i][1] - call[i][2] for call in calls)
            line += f"   (gap before {gap:.2f})"
        lines.append(line)
    span = statistics.median(call[-1][2] - call[1][1] for call in calls)
    lines.append(f"  span {span:.2f} us; launch + span {launch + span:.2f} us")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="qwen3-8b-dflash,llama3-8b-ctx")
    parser.add_argument("--seq-lens", default="1,32")
    parser.add_argument("--forms", default="fxf,sglang")
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args(argv)
    timer = Timer(torch.device("cuda"), warmup=25, rep=100, l2_flush="read")
    for workload in args.workloads.split(","):
        model = build_workload(workload, device="cuda")
        hand = HandFusedContextKV(model, rope="cache")
        for seq_len in (int(t) for t in args.seq_lens.split(",")):
            x, pos = example_inputs(model, seq_len=seq_len)
            with torch.no_grad():
                for form in args.forms.split(","):
                    torch._dynamo.reset()
                    if form == "sglang":
                        target = hand
                    else:
                        target = torch.compile(model, backend="fx_fusion" if form == "fxf" else "inductor")
                    for _ in range(3):
                        target(x, pos)
                    graphed = cuda_graphs.capture(lambda: target(x, pos))
                    us = timer(graphed)
                    torch.cuda.synchronize()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(args.calls):
                            timer.flush()
                            graphed()
                        torch.cuda.synchronize()
                    print(f"=== {workload} T={seq_len} {form}: event-timed median {us:.2f} us", flush=True)
                    print("\n".join(summarize(calls_from_trace(prof))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
