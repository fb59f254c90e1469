"""GPU benchmark of the grouped GEMV kernel against per-weight and pre-concatenated cuBLAS GEMMs.

    python benchmarks/bench_grouped_gemv.py [--workloads qwen3-8b-dflash,qwen3-1layer] [--tokens 1,16]
                                            [--peak-bw 4.8e12] [--configs 16:0:0:0] [--out bench_grouped_gemv.json]

Workloads (the K/V projections of fx_fusion.drafts.WORKLOADS, realistic preset: hidden 4096, 8 KV heads x
128; k_proj and v_proj per layer, so G = 2 * layers weights of [1024, 4096], no bias by default):

    qwen3-8b-dflash   G = 10  (5 layers)
    llama3-8b-ctx     G = 10  (5 layers; the same projection shapes as qwen3-8b-dflash)
    qwen3-1layer      G = 2   (1 layer)
    llama3-8b-qkv     G = 6   (one Llama-3-8B layer's Q, K and V: Q's 4096 rows as 4 blocks of 1024)
    qwen3-0.6b-qkv    G = 4   (with --hidden 1024: one Qwen3-0.6B layer's Q as 2 blocks, K and V)

--hidden sets every weight's input features (default 4096).

Each weight is its own allocation (as the parameters of separate modules are). Columns, microseconds per
call (x [N, 4096] -> out [N, G * 1024], one preallocated out):

    grouped      launch_grouped_gemv(x, weights, biases, out): one launch per 16 weights, weights read in place
    per_weight   torch.mm(x, w_i.t(), out=out[:, i*R:(i+1)*R]) for every i (torch.addmm with --bias)
    streamsS     (--streams) per_weight with weight i's GEMM on side stream i % S, forked from and joined
                 back to the current stream (S = 2, 3, 5; small GEMMs side by side)
    concat       torch.mm(x, w_cat.t(), out=out), w_cat pre-concatenated once (a reference: it needs a second
                 copy of the weights)
    cfg[T:N:K:W(:S(:P(:M(:A))))] launch_grouped_gemv with
                 BLOCK_T:BLOCK_N:BLOCK_K:num_warps(:split_k(:num_stages(:masked_k(:swap_ab))))
                 overrides (--configs; 0 keeps the heuristic's value; M = 1: the K loop with its masks; A = 1:
                 the weight rows as the MMA's M, A = -1: the tokens), for tuning
    floor        bytes(all weights (+ biases) + x + out) / --peak-bw (B/s; 4.8e12 = H200 HBM3e spec)

With --epilogue the weights are ordered [K_0 .. K_{L-1}, V_0 .. V_{L-1}] (as the pass groups them), every
K head is also normalised (per-layer [128] weights) and rotated (per-token cos/sin, neox) into k_out
[L, N, 8, 128], and the columns become:

    grouped      launch_grouped_gemv(..., k_epilogue=...): the norm/RoPE in the GEMM's epilogue, one launch
    separate     the grouped kernel, then the materialization kernel over its K heads (two launches; each
                 reads the per-layer norm weights where they are)
    concat       the pre-concatenated cuBLAS GEMM, then the materialization kernel
    cfg[...]     the epilogue launch with overrides (BLOCK_N is always the head dim)

and k_out is checked against `concat`'s too.

Timing: every candidate is captured once in a torch.cuda.CUDAGraph (after warm-up), the graph is replayed
--replays times between two CUDA events, and the median over --repeats such runs is reported. So that the
weights come from HBM and not from L2, the graph runs the candidate over enough distinct copies of the
inputs (weights, x, out) to exceed --rotate-bytes, and the time is divided by the number of copies.

Before timing, every candidate's output (NaN-poisoned first) is checked against `concat` (relative
Frobenius error < 1e-2, all elements written); a failing candidate is marked FAIL and not timed. N above
grouped_gemv.max_tokens(G) is still timed (the launcher takes any N) but the dispatcher would not pick
the kernel there; such rows are marked. Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton

from fx_fusion import cuda_graphs
from fx_fusion.kernels.fused_kv_materialize import launch_fused_kv_materialize
from fx_fusion.kernels.grouped_gemv import (
    KEpilogue,
    default_launch_config,
    epilogue_launch_config,
    grouped_gemv_unsupported_reason,
    launch_grouped_gemv,
)

HIDDEN, KV_HEADS, HEAD_DIM = 4096, 8, 128  # HIDDEN: the default of --hidden
KV_SIZE = KV_HEADS * HEAD_DIM
WORKLOADS = {  # name: number of weights [KV_SIZE, hidden] (k_proj and v_proj of every layer)
    "qwen3-8b-dflash": 10,
    "llama3-8b-ctx": 10,
    "qwen3-1layer": 2,
    "llama3-8b-qkv": 6,
    "qwen3-0.6b-qkv": 4,  # with --hidden 1024: one Qwen3-0.6B layer's Q (2 blocks of 1024 rows), K and V
}
DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = 1e-2


def log(msg: str) -> None:
    print(msg, flush=True)


class Inputs:
    """One copy of a call's tensors: x, the separate weights (and biases), their concatenation, out."""

    def __init__(
        self,
        n: int,
        g: int,
        hidden: int,
        dtype: torch.dtype,
        bias: bool,
        device: torch.device,
        gen: torch.Generator,
        epilogue: bool,
    ):
        def randn(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=device) * 0.05).to(dtype)

        self.x = randn(n, hidden)
        self.weights = [randn(KV_SIZE, hidden) for _ in range(g)]
        self.biases = [randn(KV_SIZE) for _ in range(g)] if bias else []
        self.w_cat = torch.cat(self.weights)
        self.b_cat = torch.cat(self.biases) if bias else None
        self.out = torch.empty(n, g * KV_SIZE, dtype=dtype, device=device)
        self.out_slices = [self.out[:, i * KV_SIZE : (i + 1) * KV_SIZE] for i in range(g)]
        self.epilogue = None
        if epilogue:  # K of layer l in columns [l * KV_SIZE, (l + 1) * KV_SIZE)
            layers = g // 2
            self.norms = [randn(HEAD_DIM) + 1 for _ in range(layers)]
            angles = torch.rand(n, HEAD_DIM // 2, generator=gen, device=device) * 6
            cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
            self.k_out = torch.empty(layers, n, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
            self.k_proj = self.out[:, : layers * KV_SIZE].view(n, layers, KV_SIZE)
            self.epilogue = KEpilogue(
                self.k_out, 0, KV_SIZE, HEAD_DIM, self.norms, None, 1e-6, cos, sin, None, HEAD_DIM, False, 0.0, False, True
            )

    def materialize(self) -> None:
        """The materialization kernel over the K heads of out into k_out (the second launch)."""
        e = self.epilogue
        launch_fused_kv_materialize(
            self.k_proj, None, self.norms, None, 1e-6, e.cos, e.sin, None, self.k_out, None, KV_HEADS, HEAD_DIM,
            HEAD_DIM, False, 0.0, False, True,
        )  # fmt: skip


def make_candidates(
    configs: list[tuple[int, int, int, int]], epilogue: bool, streams: bool = False
) -> dict[str, Callable[[Inputs], None]]:
    def grouped(t: Inputs) -> None:
        launch_grouped_gemv(t.x, t.weights, t.biases, t.out, k_epilogue=t.epilogue)

    def separate(t: Inputs) -> None:
        launch_grouped_gemv(t.x, t.weights, t.biases, t.out)
        t.materialize()

    def per_weight(t: Inputs) -> None:
        for i, (w, o) in enumerate(zip(t.weights, t.out_slices)):
            if t.biases:
                torch.addmm(t.biases[i], t.x, w.t(), out=o)
            else:
                torch.mm(t.x, w.t(), out=o)

    def on_streams(count: int) -> Callable[[Inputs], None]:
        """per_weight with weight i's GEMM on side stream i % count (forked from and joined back to the
        current stream): GEMMs too small to fill the GPU run side by side."""
        side = []

        def run(t: Inputs) -> None:
            side.extend(torch.cuda.Stream() for _ in range(count - len(side)))
            main = torch.cuda.current_stream()
            for s in side:
                s.wait_stream(main)
            for i, (w, o) in enumerate(zip(t.weights, t.out_slices)):
                with torch.cuda.stream(side[i % count]):
                    if t.biases:
                        torch.addmm(t.biases[i], t.x, w.t(), out=o)
                    else:
                        torch.mm(t.x, w.t(), out=o)
            for s in side:
                main.wait_stream(s)

        return run

    def concat(t: Inputs) -> None:
        if t.b_cat is not None:
            torch.addmm(t.b_cat, t.x, t.w_cat.t(), out=t.out)
        else:
            torch.mm(t.x, t.w_cat.t(), out=t.out)
        if epilogue:
            t.materialize()

    candidates: dict[str, Callable[[Inputs], None]] = {"grouped": grouped}
    candidates.update({"separate": separate} if epilogue else {"per_weight": per_weight})
    if streams and not epilogue:
        candidates.update({f"streams{n}": on_streams(n) for n in (2, 3, 5)})
    candidates["concat"] = concat
    for cfg in configs:
        names = ("block_t", "block_n", "block_k", "num_warps", "split_k", "num_stages", "masked_k", "swap_ab")
        overrides = {k: v for k, v in zip(names, cfg) if v}
        if "swap_ab" in overrides:  # 1: on, -1: off
            overrides["swap_ab"] = overrides["swap_ab"] > 0

        def tuned(t: Inputs, overrides=overrides) -> None:
            launch_grouped_gemv(t.x, t.weights, t.biases, t.out, k_epilogue=t.epilogue, **overrides)

        candidates["cfg[" + ":".join(map(str, cfg)) + "]"] = tuned
    return candidates


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref32 = ref.float()
    err = (out.float() - ref32).norm().item() / max(ref32.norm().item(), 1e-30)
    return err if math.isfinite(err) else float("inf")


def time_graph(replay: Callable[[], Any], calls_per_replay: int, replays: int, repeats: int) -> float:
    """Median over `repeats` runs of `replays` back-to-back graph replays: microseconds per call."""
    replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * calls_per_replay))
    return statistics.median(times)


def bench_row(name: str, g: int, n: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    elt = torch.finfo(dtype).bits // 8
    hidden = args.hidden
    weight_bytes = g * KV_SIZE * (hidden + (1 if args.bias else 0)) * elt
    nbytes = weight_bytes + n * hidden * elt + n * g * KV_SIZE * elt
    if args.epilogue:  # and k_out
        nbytes += n * (g // 2) * KV_SIZE * elt
    copies = max(1, math.ceil(args.rotate_bytes / nbytes))
    gen = torch.Generator(device=device).manual_seed(0)
    sets = [Inputs(n, g, hidden, dtype, args.bias, device, gen, args.epilogue) for _ in range(copies)]
    first = sets[0]
    row: dict[str, Any] = {
        "workload": name,
        "N": n,
        "G": g,
        "R": KV_SIZE,
        "K": hidden,
        "dtype": args.dtype,
        "bias": args.bias,
        "bytes": nbytes,
        "copies": copies,
        "floor_us": nbytes / args.peak_bw * 1e6,
        "grouped_supported": grouped_gemv_unsupported_reason(first.x, first.weights, first.biases, first.out) is None,
        "grouped_config": (
            epilogue_launch_config(n, KV_SIZE, hidden, min(g, 16), HEAD_DIM, dtype, device)
            if args.epilogue
            else default_launch_config(n, KV_SIZE, hidden, min(g, 16), dtype, device)
        ),
        "times_us": {},
        "errors": {},
    }
    candidates = make_candidates(args.configs, args.epilogue, args.streams)
    # Reference: the concatenated GEMM (then the materialization kernel).
    candidates["concat"](first)
    ref = first.out.clone()
    ref_k = first.k_out.clone() if args.epilogue else None
    for cname, fn in candidates.items():
        try:
            first.out.fill_(float("nan"))
            if args.epilogue:
                first.k_out.fill_(float("nan"))
            fn(first)
            torch.cuda.synchronize()
            err = rel_error(first.out, ref)
            if args.epilogue:
                err = max(err, rel_error(first.k_out, ref_k))
            row["errors"][cname] = err
            if not err < TOLERANCE:
                log(f"  {name} N={n} {cname}: FAIL (relative error {err:.3g})")
                row["times_us"][cname] = "FAIL"
                continue

            def run_all(fn=fn) -> None:
                for t in sets:
                    fn(t)

            replay = cuda_graphs.capture(run_all)
            row["times_us"][cname] = time_graph(replay, copies, args.replays, args.repeats)
            del replay
        except Exception as exc:  # noqa: BLE001  a candidate that cannot run shows "-"
            # (Triton compile errors, out-of-resources for large --configs tiles, CUDA errors, bad --configs)
            text = str(exc).splitlines()
            log(f"  {name} N={n} {cname}: {type(exc).__name__}: {text[0][:200] if text else ''}")
            row["times_us"][cname] = None
    return row


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    return "-" if value is None else str(value)


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    baseline = "separate" if "separate" in columns else "per_weight"
    header = ["workload", "N", *columns, "floor", "grouped/floor", f"{baseline}/grouped", "config"]
    log("| " + " | ".join(header) + " |")
    log("|" + "---|" * len(header))
    for row in rows:
        times = row["times_us"]
        grouped = times.get("grouped")
        ratio = f"{grouped / row['floor_us']:.2f}" if isinstance(grouped, float) else "-"
        base = times.get(baseline)
        speedup = f"{base / grouped:.2f}" if isinstance(grouped, float) and isinstance(base, float) else "-"
        cfg = row["grouped_config"]
        config = f"T{cfg['BLOCK_T']} N{cfg['BLOCK_N']} K{cfg['BLOCK_K']} W{cfg['num_warps']} S{cfg['SPLIT_K']}"
        config += " swapped" if cfg.get("SWAP_AB") else ""
        n = f"{row['N']}" + ("" if row["grouped_supported"] else "*")
        cells = [
            row["workload"],
            n,
            *(fmt(times.get(c)) for c in columns),
            f"{row['floor_us']:.1f}",
            ratio,
            speedup,
            config,
        ]
        log("| " + " | ".join(cells) + " |")
    log("(* N > grouped_gemv.max_tokens(G): grouped_gemv_supported refuses it; timed anyway)")


def parse_configs(text: str) -> list[tuple[int, ...]]:
    configs = []
    for item in filter(None, text.split(",")):
        parts = [int(p) for p in item.split(":")]
        if len(parts) not in (4, 5, 6, 7, 8):
            raise argparse.ArgumentTypeError(
                f"config {item!r}: expected BLOCK_T:BLOCK_N:BLOCK_K:num_warps[:split_k[:num_stages[:masked_k[:swap_ab]]]]"
            )
        configs.append(tuple(parts))
    return configs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS))
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma-separated N values")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=f"input features of every weight (default {HIDDEN})")
    parser.add_argument("--bias", action="store_true", help="give every weight a bias")
    parser.add_argument("--peak-bw", type=float, default=4.8e12, help="bytes/s for the floor (default: H200, 4.8e12)")
    parser.add_argument("--replays", type=int, default=50, help="graph replays per timed run")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs; the median is reported")
    parser.add_argument(
        "--rotate-bytes", type=float, default=256 * 2**20, help="inputs rotated through per replay (beyond L2)"
    )
    parser.add_argument(
        "--configs",
        type=parse_configs,
        default=[],
        help="extra grouped columns, BLOCK_T:BLOCK_N:BLOCK_K:num_warps[:split_k[:num_stages[:masked_k]]] "
        "(0 = heuristic), comma-separated, e.g. 16:0:0:0,0:64:0:8,16:64:128:4:4",
    )
    parser.add_argument("--epilogue", action="store_true", help="K norm/RoPE in the epilogue (see above)")
    parser.add_argument("--streams", action="store_true", help="also the per-weight GEMMs on side streams")
    parser.add_argument("--out", default="bench_grouped_gemv.json", help="JSON output path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_grouped_gemv.py needs a CUDA device", file=sys.stderr)
        return 2
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {list(WORKLOADS)}")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    device = torch.device("cuda", torch.cuda.current_device())
    meta = {
        "device": torch.cuda.get_device_name(device),
        "sm_count": torch.cuda.get_device_properties(device).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "args": dict(vars(args)),
    }
    log(f"{meta['device']} ({meta['sm_count']} SMs), torch {meta['torch']}, triton {meta['triton']}")
    rows = []
    with torch.no_grad():
        for name in workloads:
            for n in tokens:
                row = bench_row(name, WORKLOADS[name], n, args, device)
                rows.append(row)
                times = ", ".join(f"{k} {fmt(v)}" for k, v in row["times_us"].items())
                log(f"[{name} N={n}] {times}; floor {row['floor_us']:.1f} us ({row['copies']} copies)")
                torch.cuda.empty_cache()
    columns = list(make_candidates(args.configs, args.epilogue, args.streams))
    log("")
    print_table(rows, columns)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
