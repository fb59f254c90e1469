"""Host cost per call of the uncaptured paths (GPU): where the time of a call without CUDA graphs goes.

    python benchmarks/host_overhead.py [--workload qwen3-8b-dflash] [--seq-len 1] [--dynamic] [--out DIR]

At small T every path here is bound by host work, so the time of `calls` back-to-back calls divided by
`calls` (one synchronize at the end) is the host cost per call. Measured, side by side in one run: the
compiled module (torch.compile default and the fx_fusion backend), the hand-fused module, the pieces of
the fused path on their own (the grouped GEMM op, the materialization op, its validation, the Triton
launch), and a cProfile of fx_fusion-compiled calls. `--dynamic` compiles with a symbolic token count.
Writes host_overhead[_dynamic]_T<seq-len>.txt to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch

import fx_fusion.backend  # noqa: F401  (registers the backend when no entry point did)
from fx_fusion.drafts import HandFusedContextKV, build_workload, example_inputs
from fx_fusion.kernels import grouped_gemm_tma, ops
from fx_fusion.kernels.fused_kv_materialize import launch_fused_kv_materialize


def per_call_us(fn, calls: int = 300, repeats: int = 7) -> float:
    """Median over `repeats` of (time of `calls` back-to-back calls + one synchronize) / calls."""
    for _ in range(20):
        fn()
    _sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    samples.sort()
    return samples[len(samples) // 2]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_table(name: str, fn, calls: int = 100) -> str:
    """torch.profiler's CPU self-time table over `calls` calls of fn."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        _sync()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return f"torch.profiler, {calls} calls of {name} (CPU self time):\n{table}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="qwen3-8b-dflash")
    parser.add_argument("--seq-len", type=int, default=1)
    parser.add_argument("--dynamic", action="store_true", help="compile with dynamic=True")
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke run only
    torch.manual_seed(0)
    lines: list[str] = []

    def report(name: str, fn) -> None:
        us = per_call_us(fn)
        lines.append(f"{name:<48} {us:8.1f} us/call")
        print(lines[-1], flush=True)

    model = build_workload(args.workload, device=device)
    x, pos = example_inputs(model, seq_len=args.seq_len)
    hand = HandFusedContextKV(model, rope="cache")
    with torch.no_grad():
        report("eager module", lambda: model(x, pos))
        report("hand-fused module (SGLang form)", lambda: hand(x, pos))
        torch._dynamo.reset()
        inductor = torch.compile(model, dynamic=args.dynamic or None)
        report("torch.compile default", lambda: inductor(x, pos))
        tables = [profile_table("torch.compile default", lambda: inductor(x, pos))]
        torch._dynamo.reset()
        fused = torch.compile(model, backend="fx_fusion", dynamic=args.dynamic or None)
        report("torch.compile backend=fx_fusion", lambda: fused(x, pos))
        tables.append(profile_table("torch.compile backend=fx_fusion", lambda: fused(x, pos)))

        # The pieces of the fused path, called directly with the hand-fused module's tensors.
        L, H, D = hand.n_layers, hand.num_kv_heads, hand.head_dim
        flat = x.reshape(-1, hand.hidden_size)
        # the pass's order (K weights, then V weights), each read where it lives
        weights = [layer.k_proj.weight for layer in model.layers] + [layer.v_proj.weight for layer in model.layers]
        report("torch.mm on pre-stacked weights", lambda: torch.mm(flat, hand.kv_weight.t()))
        report("fx_fusion::grouped_linear (2L weights)", lambda: torch.ops.fx_fusion.grouped_linear(flat, weights, []))
        out = flat.new_empty((flat.shape[0], sum(w.shape[0] for w in weights)))
        report("  grouped_gemm_tma.unsupported_reason", lambda: grouped_gemm_tma.unsupported_reason(flat, weights, [], out))
        if grouped_gemm_tma.unsupported_reason(flat, weights, [], out) is None:
            report("  grouped_gemm_tma.launch", lambda: grouped_gemm_tma.launch(flat, weights, [], out))
            n, rows = flat.shape[0], weights[0].shape[0]
            report("  grouped_gemm_tma.launch_config", lambda: grouped_gemm_tma.launch_config(n, rows, len(weights), device))

            def enter_device() -> None:
                with torch.cuda.device(device):
                    pass

            report("  an empty `with torch.cuda.device(...)`", enter_device)
            tables.append(profile_table("grouped_gemm_tma.launch", lambda: grouped_gemm_tma.launch(flat, weights, [], out)))
        kv = torch.mm(flat, hand.kv_weight.t()).view(-1, L, 2 * H * D)
        k_proj, v_proj = kv[..., : H * D], kv[..., H * D :]
        norm = [hand.k_norm_weight] if hand.k_norm_weight is not None else []
        common = (
            k_proj, norm, None, hand.eps_value, hand.cos_sin_cache, None, pos.reshape(-1), H, D, D, False, 0.0, False,
            True,
        )  # fmt: skip
        report("fx_fusion::materialize_kv", lambda: torch.ops.fx_fusion.materialize_kv(*common, v_proj))
        report("  its validation alone", lambda: ops._validate(common, v_proj))
        k_out, v_out = ops._new_output(common), ops._new_output(common)
        launch_args = (
            k_proj, v_proj, norm[0] if norm else None, None, hand.eps_value, hand.cos_sin_cache, None,
            pos.reshape(-1), k_out, v_out, H, D, D, False, 0.0, False, True,
        )  # fmt: skip
        if device.type == "cuda":
            report("  the Triton launch alone", lambda: launch_fused_kv_materialize(*launch_args))

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(300):
            fused(x, pos)
        _sync()
        profile.disable()
    stream = io.StringIO()
    pstats.Stats(profile, stream=stream).sort_stats("tottime").print_stats(35)
    text = "\n".join(lines) + "\n\n" + "\n\n".join(tables) + "\n\ncProfile of 300 fx_fusion-compiled calls (by tottime):\n" + stream.getvalue()
    os.makedirs(args.out, exist_ok=True)
    name = f"host_overhead{'_dynamic' if args.dynamic else ''}_T{args.seq_len}.txt"
    with open(os.path.join(args.out, name), "w") as f:
        where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
        f.write(f"{where}, torch {torch.__version__}, {args.workload}, T={args.seq_len}, dynamic={args.dynamic}\n")
        f.write(text)
    print(stream.getvalue()[:3000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
