"""GPU benchmark of the whole draft context-K/V module, compiled every way, side by side in one run.

    python benchmarks/bench_module.py [--quick] [--workloads qwen3-8b-dflash,llama3-8b-ctx] [--out DIR]

Workloads (fx_fusion.drafts.WORKLOADS; bf16, batch 1, realistic sizes): "qwen3-8b-dflash" (5 Qwen3 layers,
hidden 4096, 8 KV heads x 128, k_norm), "llama3-8b-ctx" (5 Llama layers, no K norm), "qwen3-1layer".

Columns (all timed with triton.testing.do_bench(return_mode="median") under torch.no_grad(), or with
--l2-flush read its loop with L2 emptied by reading instead of zeroing (`Timer`), static shapes (symbolic
token counts with --dynamic), one compile per T; torch._dynamo.reset() between compiled variants):

    eager          the HF-module ContextKV as written
    inductor       torch.compile(m)                               (default mode, dynamic=False)
    ind_graph      the same, CUDA-graphed
    frz            torch.compile(m) with torch._inductor.config.freezing=True
    frz_graph      the same, CUDA-graphed
    hand           HandFusedContextKV (one stacked GEMM + the fused op, per-token cos/sin), eager
    hand_graph     the same, CUDA-graphed
    sglang_graph   HandFusedContextKV(rope="cache"): SGLang's exact form (one fp32 cos_sin_cache + positions
                   instead of per-token cos/sin computed per call), CUDA-graphed
    fxf            torch.compile(m, backend="fx_fusion")  (options min_layers=--fxf-min-layers when given;
                   the pass's fused-layer count is recorded, and "nf" marks a compile where it fused nothing)
    fxf_graph      the same, CUDA-graphed
    fxf_sep        the same with options gemm_epilogue=False (the K norm/RoPE a kernel of its own after the
                   grouped GEMM, as before the epilogue; only when named in --columns)
    fxf_sep_graph  the same, CUDA-graphed
    fxf_tab        fx_fusion with options rotary_angles_in_kernel=False (the K epilogue reads the cos/sin
                   tables that the graph computes; only when named in --columns)
    fxf_tab_graph  the same, CUDA-graphed
    fxf_mma_t      fx_fusion with the K-epilogue launch's tokens as the MMA's M (the launch off Hopper:
                   grouped_gemv's device capability answered as sm_80 while compiling; only when named)
    fxf_mma_t_graph  the same, CUDA-graphed
    fxf_frz        torch.compile(m, backend="fx_fusion") with freezing
    fxf_frz_graph  the same, CUDA-graphed
    floor          max(bytes / copy bandwidth, flops / matmul rate); bytes = x + all K/V weights (+biases)
                   + K and V outputs, flops = 2*T*hidden*L*2*kv; both ceilings measured in this run
                   (fastest do_bench call of a 1 GiB device-to-device copy, read+write bytes, and of a
                   bf16 8192^3 matmul on random data; the JSON also has the floor from the median calls)

"CUDA-graphed" is --graph manual (default): after warm-up the compiled (or eager) callable is captured
once into a torch.cuda.CUDAGraph with static inputs and only graph.replay() is timed; --graph
reduce-overhead instead compiles the *_graph columns with mode="reduce-overhead" (CUDA graph trees;
includes their per-call bookkeeping; hand_graph / sglang_graph are always captured by hand).

Every column's outputs are checked against eager before timing (relative Frobenius error of each output,
max over outputs, < 2e-2); a column that fails is marked FAIL. A column that cannot be built or run shows
"-" and its error is printed. Writes bench_module.json and bench_module.md to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
import unittest.mock
from typing import Any, Callable

import torch

from fx_fusion import cuda_graphs
from fx_fusion.drafts import HandFusedContextKV, build_workload, example_inputs
from fx_fusion.kernels import grouped_gemv

DEFAULT_WORKLOADS = ["qwen3-8b-dflash", "llama3-8b-ctx", "qwen3-1layer"]
DEFAULT_SEQ_LENS = [1, 16, 128, 1024, 8192]
QUICK_SEQ_LENS = [1, 1024, 8192]
TOLERANCE = 2e-2

COLUMNS = [
    "eager",
    "inductor",
    "ind_graph",
    "frz",
    "frz_graph",
    "hand",
    "hand_graph",
    "sglang_graph",
    "fxf",
    "fxf_graph",
    "fxf_sep",
    "fxf_sep_graph",
    "fxf_tab",
    "fxf_tab_graph",
    "fxf_mma_t",
    "fxf_mma_t_graph",
    "fxf_frz",
    "fxf_frz_graph",
]
DEFAULT_COLUMNS = [c for c in COLUMNS if not c.startswith(("fxf_sep", "fxf_tab", "fxf_mma_t"))]  # ablations on request


def log(msg: str) -> None:
    print(msg, flush=True)


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


# ----------------------------------------------------------------------------------------------------------
# Timing, graphs, checks


class Timer:
    """Per-call GPU time. `l2_flush` says how L2 is emptied before each timed call: "zero" (Triton's
    `do_bench`: a 256 MB buffer zeroed, which leaves L2 full of dirty lines that the timed call then writes
    back to memory as it streams its own data in) or "read" (the same buffer read, leaving clean lines that
    are dropped for free)."""

    FLUSH_BYTES = 256 * 1024 * 1024

    def __init__(self, device: torch.device, warmup: int, rep: int, l2_flush: str = "zero") -> None:
        if l2_flush not in ("zero", "read"):
            raise ValueError(f"l2_flush must be 'zero' or 'read', got {l2_flush!r}")
        self.device = device
        self.warmup = warmup
        self.rep = rep
        self.l2_flush = l2_flush
        self._flush_buffer = None
        self._flush_sink = None

    def flush(self) -> None:
        """Empty L2 by reading FLUSH_BYTES (one torch.sum; the "read" flush)."""
        if self._flush_buffer is None:
            self._flush_buffer = torch.ones(self.FLUSH_BYTES // 4, dtype=torch.float32, device=self.device)
            self._flush_sink = torch.empty((), dtype=torch.float32, device=self.device)
        torch.sum(self._flush_buffer, dim=0, out=self._flush_sink)

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Median microseconds per call."""
        if self.device.type == "cuda" and self.l2_flush == "zero":
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="median")) * 1e3
        if self.device.type == "cuda":
            return self._read_flushed(fn)
        # CPU fallback (smoke runs only): median of wall-clock calls within ~rep ms.
        for _ in range(2):
            fn()
        times = []
        deadline = time.perf_counter() + self.rep / 1e3
        while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 1000):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2] * 1e6

    def _read_flushed(self, fn: Callable[[], Any]) -> float:
        """do_bench's loop (calls for about `rep` ms, each between two events) with a reading flush."""
        flush = self.flush
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            flush()
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
        for _ in range(max(1, int(self.warmup / estimate_ms))):
            fn()
        n = max(1, int(self.rep / estimate_ms))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            flush()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
        return times[len(times) // 2]


def capture_graph(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """A replaying callable of `fn` captured in a CUDA graph (after warm-up on a side stream)."""
    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    return cuda_graphs.capture(fn)


def rel_error(out: Any, ref: tuple[torch.Tensor, ...]) -> float:
    if not isinstance(out, (tuple, list)) or len(out) != len(ref):
        raise RuntimeError(f"expected a tuple of {len(ref)} tensors, got {type(out).__name__}")
    worst = 0.0
    for o, r in zip(out, ref):
        if tuple(o.shape) != tuple(r.shape):
            raise RuntimeError(f"shape {tuple(o.shape)} != reference {tuple(r.shape)}")
        r32 = r.float()
        err = (o.float() - r32).norm().item() / max(r32.norm().item(), 1e-30)
        if not math.isfinite(err):
            return float("inf")
        worst = max(worst, err)
    return worst


# ----------------------------------------------------------------------------------------------------------
# Ceilings and floor


def _best_and_median(timer: Timer, fn: Callable[[], Any]) -> tuple[float, float]:
    """(fastest, median) microseconds per call over one do_bench run."""
    if timer.device.type == "cuda":
        from triton.testing import do_bench

        times = sorted(do_bench(fn, warmup=timer.warmup, rep=timer.rep, return_mode="all"))  # ms per call
        return times[0] * 1e3, times[len(times) // 2] * 1e3
    t = timer(fn)
    return t, t


def measure_ceilings(timer: Timer, device: torch.device) -> dict[str, float]:
    """Copy bandwidth (read+write bytes) and bf16 matmul rate from the fastest call (the ceiling); the
    rates from the median call are recorded too (sustained clocks run lower under a long matmul)."""
    big = (1 << 30) if device.type == "cuda" else (1 << 26)  # bytes per buffer
    src = torch.empty(big // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t_copy, t_copy_med = _best_and_median(timer, lambda: dst.copy_(src))
    del src, dst
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    t_mm, t_mm_med = _best_and_median(timer, lambda: torch.mm(a, b))
    del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "copy_bytes_per_s": 2 * big / (t_copy * 1e-6),
        "matmul_flops_per_s": 2 * n**3 / (t_mm * 1e-6),
        "copy_bytes_per_s_median": 2 * big / (t_copy_med * 1e-6),
        "matmul_flops_per_s_median": 2 * n**3 / (t_mm_med * 1e-6),
        "copy_us": t_copy,
        "mm_us": t_mm,
    }


def floor_us(model, seq_len: int, batch: int, ceilings: dict[str, float]) -> dict[str, float]:
    elt = model.layers[0].k_proj.weight.element_size()
    hidden, n_layers = model.hidden_size, model.n_layers
    kv = model.num_kv_heads * model.head_dim
    tokens = batch * seq_len
    has_bias = model.layers[0].k_proj.bias is not None
    weight_bytes = n_layers * 2 * kv * (hidden + (1 if has_bias else 0)) * elt
    norm_bytes = n_layers * model.head_dim * elt if model.has_k_norm else 0
    nbytes = tokens * hidden * elt + weight_bytes + norm_bytes + 2 * n_layers * tokens * kv * elt
    flops = 2 * tokens * hidden * n_layers * 2 * kv
    t_mem = nbytes / ceilings["copy_bytes_per_s"] * 1e6
    t_flop = flops / ceilings["matmul_flops_per_s"] * 1e6
    floor_median = max(
        nbytes / ceilings["copy_bytes_per_s_median"], flops / ceilings["matmul_flops_per_s_median"]
    ) * 1e6
    return {
        "floor_us": max(t_mem, t_flop),
        "floor_median_ceilings_us": floor_median,
        "bytes": nbytes,
        "flops": flops,
        "mem_us": t_mem,
        "flop_us": t_flop,
    }


# ----------------------------------------------------------------------------------------------------------
# Column families


def fx_fusion_backend(min_layers: int | None = None, gemm_epilogue: bool = True, angles_in_kernel: bool = True):
    """The fx_fusion backend: its registered name, or (with options) the callable with options bound."""
    import functools

    import fx_fusion.backend as backend_module  # registers "fx_fusion" when no entry point did

    options = {} if min_layers is None else {"min_layers": min_layers}
    if not gemm_epilogue:
        options["gemm_epilogue"] = False
    if not angles_in_kernel:
        options["rotary_angles_in_kernel"] = False
    if options:
        return functools.partial(backend_module.fx_fusion_backend, options=options)
    from torch._dynamo.backends.registry import lookup_backend

    try:
        lookup_backend("fx_fusion")
        return "fx_fusion"
    except Exception:
        return backend_module.fx_fusion_backend


@contextlib.contextmanager
def collect_pass_records(enabled: bool):
    """Collect the fx_fusion pass's PassRecords emitted inside the block (empty list if unavailable)."""
    records: list = []
    if not enabled:
        yield records
        return
    try:
        from fx_fusion.diagnostics import RecordSink
    except Exception:
        yield records
        return
    with RecordSink.collect(records):
        yield records


def pass_summary(records: list) -> dict[str, Any]:
    fused = 0
    groups = 0
    for record in records:
        for group in getattr(record, "fused_groups", []):
            groups += 1
            fused += int(getattr(group, "n_layers", 0))
    rejected = sum(len(getattr(r, "rejected", [])) for r in records)
    return {
        "fused_layers": fused if records else None,  # None: the pass reported nothing (did not run)
        "fused_groups": groups,
        "rejected": rejected,
        "summaries": [r.summary() for r in records if hasattr(r, "summary")],
    }


class Bench:
    def __init__(self, args, device: torch.device) -> None:
        self.args = args
        self.device = device
        self.timer = Timer(device, args.warmup, args.rep, args.l2_flush)
        self.columns = args.columns

    def _record(self, cell: dict, tag: str, name: str, fn: Callable[[], Any], ref, t_build: float) -> None:
        err = rel_error(fn(), ref)
        cell["rel_err"] = err
        cell["ok"] = err < TOLERANCE
        us = self.timer(fn)
        cell["us"] = us
        status = "ok" if cell["ok"] else "FAIL"
        log(f"{tag} {name:>13}: {us:10.1f} us  err {err:.2e} {status}  (build {t_build:.1f}s)")

    def _run_column(self, row: dict, tag: str, name: str, make: Callable[[], Callable[[], Any]], ref) -> None:
        cell = row.setdefault(name, {})
        try:
            base = self._memory_baseline()
            t0 = time.perf_counter()
            fn = make()
            self._record(cell, tag, name, fn, ref, time.perf_counter() - t0)
            if base is not None:  # what this column holds beyond the model and inputs (MiB)
                torch.cuda.synchronize()
                cell["steady_mib"] = (torch.cuda.memory_allocated() - base) / 2**20
                cell["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        except Exception as exc:  # one column's failure must not end the run
            cell["error"] = short_error(exc)
            log(f"{tag} {name:>13}: -  ERROR {cell['error']}")
            if self.args.verbose:
                traceback.print_exc()
                sys.stdout.flush()

    def _memory_baseline(self) -> int | None:
        """CUDA bytes allocated before a column is built (the peak counter reset), or None off CUDA."""
        if self.device.type != "cuda":
            return None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def _compiled_family(
        self, row, tag, model, x, pos, ref, backend_fn, freezing: bool, plain: str, graphed: str,
        compile_ctx=contextlib.nullcontext,
    ):  # fmt: skip
        want_plain, want_graph = plain in self.columns, graphed in self.columns
        if not (want_plain or want_graph):
            return
        freeze_ctx = (
            (lambda: torch._inductor.config.patch(freezing=True)) if freezing else contextlib.nullcontext
        )

        is_fxf = plain.startswith("fxf")

        def compile_and_warm(mode: str | None):
            torch._dynamo.reset()
            backend = backend_fn()
            kwargs: dict[str, Any] = dict(backend=backend, dynamic=self.args.dynamic)
            if mode is not None:
                kwargs["mode"] = mode
            compiled = torch.compile(model, **kwargs)
            with contextlib.ExitStack() as stack:
                stack.enter_context(freeze_ctx())
                stack.enter_context(compile_ctx())
                if is_fxf:  # compile afresh so the pass runs here and reports what it fused
                    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
                    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
                records = stack.enter_context(collect_pass_records(is_fxf))
                for _ in range(3):
                    if mode == "reduce-overhead":
                        torch.compiler.cudagraph_mark_step_begin()
                    compiled(x, pos)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            if is_fxf:
                info = pass_summary(records)
                holder["pass"] = info
                log(f"{tag} {'':>13}  fx_fusion pass: fused {info['fused_layers']} layers in "
                    f"{info['fused_groups']} group(s), {info['rejected']} rejected")
            return compiled

        holder: dict[str, Any] = {}

        def make_plain():
            holder["compiled"] = compile_and_warm(None)
            compiled = holder["compiled"]
            return lambda: compiled(x, pos)

        if want_plain:
            self._run_column(row, tag, plain, make_plain, ref)
            if "pass" in holder:
                row[plain]["pass"] = holder["pass"]
        if want_graph:
            if self.args.graph == "manual":

                def make_graphed():
                    if holder.get("compiled") is None:
                        holder["compiled"] = compile_and_warm(None)
                    compiled = holder["compiled"]
                    return capture_graph(lambda: compiled(x, pos), self.device)

            else:

                def make_graphed():
                    if self.device.type != "cuda":
                        raise RuntimeError("CUDA graphs need a CUDA device")
                    holder.pop("compiled", None)
                    compiled = compile_and_warm("reduce-overhead")

                    def call():
                        torch.compiler.cudagraph_mark_step_begin()
                        return compiled(x, pos)

                    return call

            self._run_column(row, tag, graphed, make_graphed, ref)
            if "pass" in holder:
                row[graphed]["pass"] = holder["pass"]
        holder.clear()
        torch._dynamo.reset()
        gc.collect()

    def run_config(self, workload: str, model, hand, hand_cache, seq_len: int, results: dict, ceilings) -> None:
        tag = f"[{workload} T={seq_len}]"
        dtype = model.layers[0].k_proj.weight.dtype
        x, pos = example_inputs(model, batch=self.args.batch, seq_len=seq_len, device=self.device, dtype=dtype)
        row: dict[str, Any] = {}
        results[str(seq_len)] = row
        fl = floor_us(model, seq_len, self.args.batch, ceilings)
        row["floor"] = {"us": fl["floor_us"], **fl}
        log(f"{tag} {'floor':>13}: {fl['floor_us']:10.1f} us  (mem {fl['mem_us']:.1f}, flop {fl['flop_us']:.1f})")

        ref = model(x, pos)
        if "eager" in self.columns:
            self._run_column(row, tag, "eager", lambda: (lambda: model(x, pos)), ref)

        self._compiled_family(row, tag, model, x, pos, ref, lambda: "inductor", False, "inductor", "ind_graph")
        self._compiled_family(row, tag, model, x, pos, ref, lambda: "inductor", True, "frz", "frz_graph")

        def hand_column(name: str, module, graphed: bool) -> None:
            if name not in self.columns:
                return

            def make():
                if isinstance(module, Exception):
                    raise module
                if graphed:
                    return capture_graph(lambda: module(x, pos), self.device)
                return lambda: module(x, pos)

            self._run_column(row, tag, name, make, ref)

        hand_column("hand", hand, graphed=False)
        hand_column("hand_graph", hand, graphed=True)
        hand_column("sglang_graph", hand_cache, graphed=True)

        fxf = lambda: fx_fusion_backend(self.args.fxf_min_layers)  # noqa: E731
        self._compiled_family(row, tag, model, x, pos, ref, fxf, False, "fxf", "fxf_graph")
        fxf_sep = lambda: fx_fusion_backend(self.args.fxf_min_layers, gemm_epilogue=False)  # noqa: E731
        self._compiled_family(row, tag, model, x, pos, ref, fxf_sep, False, "fxf_sep", "fxf_sep_graph")
        fxf_tab = lambda: fx_fusion_backend(self.args.fxf_min_layers, angles_in_kernel=False)  # noqa: E731
        self._compiled_family(row, tag, model, x, pos, ref, fxf_tab, False, "fxf_tab", "fxf_tab_graph")
        off_hopper = lambda: unittest.mock.patch.object(grouped_gemv, "_capability", lambda index: (8, 0))  # noqa: E731
        self._compiled_family(row, tag, model, x, pos, ref, fxf, False, "fxf_mma_t", "fxf_mma_t_graph", off_hopper)
        self._compiled_family(row, tag, model, x, pos, ref, fxf, True, "fxf_frz", "fxf_frz_graph")
        del ref, x, pos
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------
# Report


def format_cell(cell: dict | None, floor: float | None) -> str:
    if not cell or cell.get("us") is None:
        return "-"
    us = cell["us"]
    text = f"{us:.1f}"
    if floor:
        text += f" ({us / floor:.1f}x)"
    if not cell.get("ok", True):
        text = f"FAIL {text}"
    if cell.get("pass") is not None and cell["pass"].get("fused_layers") == 0:
        text += " nf"
    return text


def markdown(results: dict, meta: dict, columns: list[str]) -> str:
    lines = []
    lines.append("# fx-fusion module benchmark: draft context K/V")
    lines.append("")
    lines.append(
        f"{meta['device_name']}; torch {meta['torch']}, triton {meta['triton']}, transformers "
        f"{meta['transformers']}; {meta['dtype']}, batch {meta['batch']}; do_bench(warmup={meta['warmup']}, "
        f"rep={meta['rep']}, median; L2 emptied by {'reading' if meta.get('l2_flush') == 'read' else 'zeroing'} "
        f"256 MB before each call); CUDA graphs: {meta['graph_method']}"
        f"{'; compiled with dynamic=True' if meta.get('dynamic') else ''}."
    )
    c = meta.get("ceilings") or {}
    if c:
        lines.append(
            f"Ceilings measured in this run (fastest call): copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s "
            f"(read+write), bf16 8192^3 matmul {c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s (median call: "
            f"{c['copy_bytes_per_s_median'] / 1e12:.2f} TB/s, {c['matmul_flops_per_s_median'] / 1e12:.0f} "
            "TFLOP/s; the JSON has the floor from those too)."
        )
    lines.append(
        "Cells: median us (ratio to the floor). FAIL: outputs differ from eager (rel. error >= 2e-2). "
        "nf: the fx_fusion pass fused nothing in that compile (plain Inductor)."
    )
    lines.append("")
    header = ["workload", "T", *columns, "floor"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|")
    for workload, per_t in results.items():
        for seq_len, row in per_t.items():
            floor = (row.get("floor") or {}).get("us")
            cells = [format_cell(row.get(col), floor) for col in columns]
            floor_text = f"{floor:.1f}" if floor else "-"
            lines.append("| " + " | ".join([workload, seq_len, *cells, floor_text]) + " |")
    errors = [
        f"- {workload} T={seq_len} {col}: {cell['error']}"
        for workload, per_t in results.items()
        for seq_len, row in per_t.items()
        for col, cell in row.items()
        if isinstance(cell, dict) and cell.get("error")
    ]
    errors = [f"- {e}" for e in meta.get("errors", [])] + errors
    if meta.get("skipped"):
        lines.append("")
        lines.append("Skipped (--max-minutes): " + ", ".join(meta["skipped"]))
    if errors:
        lines.append("")
        lines.append("Errors:")
        lines.extend(errors)
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: str, results: dict, meta: dict, columns: list[str], elapsed_s: float) -> str:
    """(Re)write bench_module.json and bench_module.md; returns the markdown."""
    meta["elapsed_s"] = elapsed_s
    text = markdown(results, meta, columns)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_module.json"), "w") as f:
        json.dump({"meta": meta, "columns": columns, "results": results}, f, indent=1, default=str)
    with open(os.path.join(out_dir, "bench_module.md"), "w") as f:
        f.write(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help="comma-separated names")
    parser.add_argument("--seq-lens", default=None, help="comma-separated T values (default 1,16,128,1024,8192)")
    parser.add_argument("--quick", action="store_true", help=f"T in {QUICK_SEQ_LENS} only")
    parser.add_argument(
        "--columns", default=",".join(DEFAULT_COLUMNS), help="comma-separated subset of the columns (default: all but fxf_sep*, fxf_tab* and fxf_mma_t*)"
    )
    parser.add_argument("--graph", choices=["manual", "reduce-overhead"], default="manual")
    parser.add_argument(
        "--dynamic", action="store_true",
        help="compile with dynamic=True (symbolic token count; dynamo still specializes T = 1)",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    parser.add_argument(
        "--l2-flush", choices=["zero", "read"], default="zero",
        help="how L2 is emptied before each timed call (see Timer; zero: triton's do_bench)",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only for smoke runs")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="bench_out", help="folder for bench_module.json / bench_module.md")
    parser.add_argument(
        "--fxf-min-layers", type=int, default=None,
        help="the pass's min_layers option for the fxf columns (default: the backend's, 1)",
    )
    parser.add_argument("--verbose", action="store_true", help="print full tracebacks of failing columns")
    parser.add_argument(
        "--max-minutes", type=float, default=None,
        help="start no new (workload, T) once this much time has passed (results so far are still written)",
    )
    args = parser.parse_args(argv)

    if args.seq_lens:
        seq_lens = [int(t) for t in args.seq_lens.split(",") if t]
    else:
        seq_lens = QUICK_SEQ_LENS if args.quick else DEFAULT_SEQ_LENS
    workloads = [w for w in args.workloads.split(",") if w]
    args.columns = [c for c in args.columns.split(",") if c]
    unknown = [c for c in args.columns if c not in COLUMNS]
    if unknown:
        parser.error(f"unknown columns {unknown}; known: {COLUMNS}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device (use --device cpu for a smoke run)")
    dtype = getattr(torch, args.dtype)

    import transformers
    import triton

    meta: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "batch": args.batch,
        "dtype": args.dtype,
        "warmup": args.warmup,
        "rep": args.rep,
        "l2_flush": args.l2_flush,
        "dynamic": args.dynamic,
        "graph_method": (
            "manual torch.cuda.CUDAGraph capture of the warmed-up callable, replay timed"
            if args.graph == "manual"
            else 'torch.compile mode="reduce-overhead" for compiled *_graph columns; hand-captured for hand_*'
        ),
        "tolerance": TOLERANCE,
        "seq_lens": seq_lens,
        "workloads": workloads,
    }
    log(f"bench_module: {meta['device_name']} torch {meta['torch']} triton {meta['triton']} "
        f"transformers {meta['transformers']}; workloads {workloads}; T {seq_lens}; graphs: {args.graph}")
    try:
        import fx_fusion.backend  # noqa: F401
    except Exception as exc:
        log(f"note: fx_fusion.backend not importable ({short_error(exc)}); fxf columns will show '-'")
    try:
        import fx_fusion.kernels.ops  # noqa: F401
    except Exception as exc:
        log(f"note: fx_fusion.kernels.ops not importable ({short_error(exc)}); hand columns will show '-'")

    t_start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    bench = Bench(args, device)
    with torch.no_grad():
        ceilings = measure_ceilings(bench.timer, device)
        meta["ceilings"] = ceilings
        log(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"matmul {ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
        for workload in workloads:
            t0 = time.perf_counter()
            try:
                model = build_workload(workload, dtype=dtype, device=device)
            except Exception as exc:
                log(f"[{workload}] could not be built: {short_error(exc)}")
                meta.setdefault("errors", []).append(f"{workload}: {short_error(exc)}")
                continue
            try:
                hand = HandFusedContextKV(model)
            except Exception as exc:
                hand = exc
                log(f"[{workload}] HandFusedContextKV: {short_error(exc)}")
            try:
                hand_cache = HandFusedContextKV(model, rope="cache")
            except Exception as exc:
                hand_cache = exc
            log(f"[{workload}] built in {time.perf_counter() - t0:.1f}s: {model.n_layers} layers, hidden "
                f"{model.hidden_size}, {model.num_kv_heads} KV heads x {model.head_dim}, k_norm={model.has_k_norm}")
            per_t: dict[str, Any] = {}
            results[workload] = per_t
            for seq_len in seq_lens:
                elapsed = time.perf_counter() - t_start
                if args.max_minutes is not None and elapsed > 60 * args.max_minutes:
                    log(f"[{workload} T={seq_len}] skipped: --max-minutes {args.max_minutes} reached")
                    meta.setdefault("skipped", []).append(f"{workload} T={seq_len}")
                    continue
                bench.run_config(workload, model, hand, hand_cache, seq_len, per_t, ceilings)
                log(f"  elapsed {time.perf_counter() - t_start:.0f}s")
                write_outputs(args.out, results, meta, args.columns, time.perf_counter() - t_start)
            del model, hand, hand_cache
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    text = write_outputs(args.out, results, meta, args.columns, time.perf_counter() - t_start)
    print()
    print(text, flush=True)
    log(f"wrote {args.out}/bench_module.json and bench_module.md ({meta['elapsed_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
