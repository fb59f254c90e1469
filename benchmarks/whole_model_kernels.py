"""Whole models at large T, CUDA-graphed (GPU): where fx_fusion's time differs from torch.compile's.

    python benchmarks/whole_model_kernels.py [--models llama3-8b,qwen3-8b] [--seq-len 4096] [--layers 4] [--out DIR]

1. The projections' output layout on their own: Q, K and V as three cuBLAS GEMMs into separate outputs
   (torch.compile's form) against the same GEMMs into column slices of one [T, q + 2 kv] buffer (fx_fusion's),
   CUDA-event timing in alternating rounds.
2. Per model: torch.compile and fx_fusion compiled in one process, each captured in a CUDA graph, the
   replays timed in alternating rounds (CUDA events, back to back, per-round ratios), then torch.profiler's
   GPU kernels of three replays of each, summed by kind (GEMM, attention, Triton) and listed by name.
At large T a replay's time follows the GPU clock, which moves with power draw: the same cuBLAS kernel can
take 15% longer in one profile than in the next, so only interleaved timings are compared.
Appends to whole_model_kernels.txt in --out.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_whole_model  # noqa: E402  (the models, as the whole-model benchmark builds them)
import fx_fusion.backend  # noqa: E402,F401  (registers the backend when no entry point did)
from fx_fusion import cuda_graphs  # noqa: E402


def event_time_us(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def interleaved(calls: dict, rounds: int, per_round: int) -> dict[str, list[float]]:
    found = {name: [] for name in calls}
    names = list(calls)
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            found[name].append(event_time_us(calls[name], per_round))
    return found


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if any(word in lowered for word in ("flash", "fmha", "attention")):
        return "attention"
    if any(word in lowered for word in ("gemm", "nvjet", "cutlass", "sm90", "xmma")):
        return "gemm"
    return "triton" if "triton" in lowered else "other"


def output_layouts(T: int, device: torch.device, say, summary) -> None:
    """Q, K and V [4096, 1024, 1024 rows] x [T, 4096] as three GEMMs into separate outputs or into column slices."""
    x = torch.randn(T, 4096, device=device, dtype=torch.bfloat16)
    weights = [torch.randn(rows, 4096, device=device, dtype=torch.bfloat16) * 0.02 for rows in (4096, 1024, 1024)]
    separate = [x.new_empty(T, w.shape[0]) for w in weights]
    columns = x.new_empty(T, sum(w.shape[0] for w in weights)).split([w.shape[0] for w in weights], dim=1)

    def gemms_into(outs):
        return lambda: [torch.mm(x, w.t(), out=out) for w, out in zip(weights, outs)]

    found = interleaved({"separate outputs": gemms_into(separate), "column slices": gemms_into(columns)}, 20, 20)
    for name, times in found.items():
        say(f"[Q/K/V GEMMs, T={T}] {name}: {summary(times)}")
    say(f"[Q/K/V GEMMs, T={T}] column slices / separate outputs: "
        f"{statistics.median(found['column slices']) / statistics.median(found['separate outputs']):.4f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama3-8b,qwen3-8b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "whole_model_kernels.txt"), "a")

    def say(text: str) -> None:
        print(text, flush=True)
        log.write(text + "\n")

    def summary(values: list[float]) -> str:
        return f"median {statistics.median(values):.1f} us (min {min(values):.1f}, max {max(values):.1f})"

    device, T = torch.device("cuda"), args.seq_len
    output_layouts(T, device, say, summary)

    for model_name in args.models.split(","):
        model = bench_whole_model.build_model(model_name, args.layers, torch.bfloat16, device)
        kwargs = bench_whole_model.forward_kwargs(model)
        ids = torch.randint(3, 32000, (1, T), device=device)
        replays = {}
        with torch.no_grad():
            for column, backend in (("torch.compile", "inductor"), ("fx_fusion", "fx_fusion")):
                torch._dynamo.reset()
                compiled = torch.compile(model, backend=backend, dynamic=False)
                call = lambda compiled=compiled: compiled(ids, **kwargs).logits  # noqa: E731
                for _ in range(3):  # compile and warm up before the capture
                    call()
                replays[column] = cuda_graphs.capture(call)
            found = interleaved(replays, args.rounds, 8)
            tag = f"[{model_name}, {args.layers} layers, T={T}, graphed]"
            for name, times in found.items():
                say(f"{tag} {name}: {summary(times)}")
            per_round = [a / b for a, b in zip(found["fx_fusion"], found["torch.compile"])]
            say(f"{tag} fx_fusion / torch.compile: median per round {statistics.median(per_round):.4f}, "
                f"faster in {sum(r < 1 for r in per_round)} of {len(per_round)}")  # fmt: skip
            for column, replay in replays.items():
                replay()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        replay()
                    torch.cuda.synchronize()
                by_name, by_kind, count = collections.defaultdict(float), collections.defaultdict(float), collections.Counter()
                for event in prof.events():
                    if event.device_type == torch.autograd.DeviceType.CUDA:
                        by_name[event.name] += event.device_time / 3
                        by_kind[kernel_kind(event.name)] += event.device_time / 3
                        count[event.name] += 1
                kinds = ", ".join(f"{kind} {t:.0f}" for kind, t in sorted(by_kind.items()))
                say(f"--- {model_name} {column}: GPU kernel time per replay by kind (us): {kinds}; total {sum(by_kind.values()):.0f}")
                for name, t in sorted(by_name.items(), key=lambda item: -item[1])[:14]:
                    say(f"   {t:9.1f} us  x{count[name] // 3:3d}  {name[:110]}")
        del model, replays
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
