"""Uncaptured whole models (GPU): host cost, GPU time and back-to-back time per call, torch.compile vs fx_fusion.

    python benchmarks/host_whole_model.py [--models llama3-8b,qwen3-8b] [--seq-lens 512] [--layers 4]
                                          [--static-launch] [--out DIR]

Per model and T, the columns compiled in one process and measured alternately (--static-launch adds fx_fusion
with Inductor's static launcher for its kernels, `static_launch_user_defined_triton_kernels`):
- host enqueue: one call with the GPU idle (synchronize, then time the call alone), median of 200;
- GPU kernels: profiler device time of 5 calls / 5 (kernel and op rows both counted: a ratio only);
- back-to-back: rounds of 100 calls and one synchronize, the column order rotating, median per call;
and a profiler table of each column's host time by op. Appends to host_whole_model.txt in --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_whole_model  # noqa: E402  (the models, as the whole-model benchmark builds them)
import fx_fusion.backend  # noqa: E402,F401  (registers the backend when no entry point did)


def _quantile(values: list[float], q: float) -> float:
    return sorted(values)[int(q * (len(values) - 1))]


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} us (p10 {_quantile(values, 0.1):.0f}, p90 {_quantile(values, 0.9):.0f})"


def measure(calls: dict, rounds: int, say) -> dict:
    enqueue = {name: [] for name in calls}
    for _ in range(200):
        for name, call in calls.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            enqueue[name].append((time.perf_counter() - start) * 1e6)
    gpu = {}
    for name, call in calls.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        table = prof.key_averages()
        gpu[name] = sum(e.self_device_time_total for e in table) / 5
        say(f"--- {name}: host time by op (5 calls)")
        say(table.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=70))
    back_to_back = {name: [] for name in calls}
    names = list(calls)
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(100):
                calls[name]()
            torch.cuda.synchronize()
            back_to_back[name].append((time.perf_counter() - start) / 100 * 1e6)
    return {"enqueue": enqueue, "gpu": gpu, "back_to_back": back_to_back}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama3-8b,qwen3-8b")
    parser.add_argument("--seq-lens", default="512")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--static-launch", action="store_true", help="add fx_fusion with Inductor's static launcher")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "host_whole_model.txt"), "a")

    def say(text: str) -> None:
        print(text, flush=True)
        log.write(text + "\n")

    device = torch.device("cuda")
    for model_name in args.models.split(","):
        model = bench_whole_model.build_model(model_name, args.layers, torch.bfloat16, device)
        kwargs = bench_whole_model.forward_kwargs(model)
        for seq_len in (int(t) for t in args.seq_lens.split(",")):
            ids = torch.randint(3, 32000, (1, seq_len), device=device)
            calls = {}
            columns = [("torch.compile", "inductor", None), ("fx_fusion", "fx_fusion", None)]
            if args.static_launch:
                columns.append(("fx_fusion static launch", "fx_fusion", {"static_launch_user_defined_triton_kernels": True}))
            for column, backend, options in columns:
                torch._dynamo.reset()
                compiled = torch.compile(model, backend=backend, dynamic=False, options=options)
                calls[column] = lambda compiled=compiled: compiled(ids, **kwargs).logits
            with torch.no_grad():
                for call in calls.values():
                    for _ in range(3):
                        call()
                say(f"=== {model_name}, {args.layers} layers, T = {seq_len}")
                if args.static_launch:
                    fx_outputs = [calls[name]() for name in calls if name != "torch.compile"]
                    say(f"fx_fusion's logits bitwise equal with either launcher: {torch.equal(*fx_outputs)}")
                found = measure(calls, args.rounds, say)
            for name in calls:
                say(
                    f"RESULT {model_name} T={seq_len} {name}: host enqueue {_summary(found['enqueue'][name])}; "
                    f"GPU kernels {found['gpu'][name]:.0f} us; back-to-back {_summary(found['back_to_back'][name])}"
                )
            stock = "torch.compile"
            for fx in [name for name in calls if name != stock]:
                per_round = [a / b for a, b in zip(found["back_to_back"][fx], found["back_to_back"][stock])]
                say(
                    f"RATIO {model_name} T={seq_len} {fx}: enqueue "
                    f"{statistics.median(found['enqueue'][fx]) / statistics.median(found['enqueue'][stock]):.3f} "
                    f"gpu {found['gpu'][fx] / found['gpu'][stock]:.3f} back-to-back "
                    f"{statistics.median(found['back_to_back'][fx]) / statistics.median(found['back_to_back'][stock]):.3f}; "
                    f"per round: median {statistics.median(per_round):.3f}, faster in {sum(r < 1 for r in per_round)} "
                    f"of {len(per_round)} ({' '.join(f'{r:.3f}' for r in per_round)})"
                )
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
