"""Command line: `fx-fusion` / `python -m fx_fusion`.

    python -m fx_fusion demo [--layers N] [--seq-len T] [--device cpu|cuda] [--dump DIR] [--svg DIR]
    python -m fx_fusion explain path/to/file.py:make_model [--json] [--min-layers N] [--dump DIR] [--svg DIR]
    python -m fx_fusion explain package.module:make_model ...

`demo` builds a whole DFlash-style draft step from Hugging Face Qwen3 decoder layers (small and fp32 on a
CPU, Qwen3-8B-sized and bf16 on a GPU): the context K/V of every layer into its cache, then the noise
block's attention over cache + block. It compiles the step with the fx_fusion backend, prints what the
pass did (the fused context group, its cache writes absorbed), checks the output and the caches against
eager (exit status 1 when they differ or the cache writes were not absorbed) and, on a GPU, times the step
against torch.compile's default backend.

`explain` imports a factory returning `(module, args)` or `(module, args, kwargs)`, compiles the module
with the fx_fusion backend on those inputs and prints the report (`--json`: machine-readable).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import math
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

from . import cuda_graphs

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class CLIError(Exception):
    """A problem to report in one line, without a traceback."""


# ----------------------------------------------------------------------------------------------------------
# Shared output helpers


def _dump_guide(dump_dir: str) -> list[str]:
    """Which files of a dump directory to open, for what (only those that exist)."""
    entries = [
        ("fx_fusion_graph_before.txt", "the rewritten region(s) of the post-grad graph, before the pass"),
        ("fx_fusion_graph_after.txt", "the same region(s) after the pass: grouped_linear + materialize_k"),
        ("fx_fusion_full_graph*_before.py", "the whole post-grad graph right before the pass"),
        ("fx_fusion_full_graph*_after.py", "the whole post-grad graph right after the pass"),
        ("fx_fusion_report.txt", "this report (and fx_fusion_report.json)"),
        ("__compiled_fn_*.Forward_graph.*.py", "depyf: the AOTAutograd forward graph, Inductor's input"),
        ("__compiled_fn_*.AFTER_POST_GRAD.*.py", "depyf: the graph after all post-grad passes, ours included"),
        ("__compiled_fn_*.kernel_*.py", "depyf: Inductor's generated code (look for fx_fusion.materialize_k)"),
        ("full_code_for_*.py", "depyf: the decompiled bytecode of the compiled function, with its graphs"),
    ]
    lines = []
    for pattern, what in entries:
        found = sorted(glob.glob(os.path.join(dump_dir, pattern)))
        if found:
            shown = os.path.basename(found[0]) + (f" (+{len(found) - 1} more)" if len(found) > 1 else "")
            lines.append(f"  {shown:<50} {what}")
    return lines


def _print_files(report, dump_dir: Optional[str], svg_dir: Optional[str], out) -> None:
    if dump_dir is not None:
        print(f"\nDump in {dump_dir}; open:", file=out)
        for line in _dump_guide(dump_dir):
            print(line, file=out)
    if svg_dir is not None:
        svgs = [f for f in report.files if f.endswith(".svg")]
        if svgs:
            print(f"\nSVGs of the rewritten region(s) before/after the pass in {svg_dir}:", file=out)
            for path in svgs:
                print(f"  {os.path.basename(path)}", file=out)


def _max_errors(out: Any, ref: Any) -> tuple[float, float]:
    """(max abs error, max relative Frobenius error) over all output tensors."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    if len(outs) != len(refs):
        raise CLIError(f"compiled module returned {len(outs)} outputs, eager {len(refs)}")
    max_abs = max_rel = 0.0
    for o, r in zip(outs, refs):
        if tuple(o.shape) != tuple(r.shape):
            raise CLIError(f"compiled output shape {tuple(o.shape)} != eager {tuple(r.shape)}")
        diff = (o.float() - r.float())
        max_abs = max(max_abs, diff.abs().max().item() if diff.numel() else 0.0)
        max_rel = max(max_rel, diff.norm().item() / max(r.float().norm().item(), 1e-30))
    return max_abs, max_rel


# ----------------------------------------------------------------------------------------------------------
# demo


def _bench_us(fn: Callable[[], Any]) -> float:
    """Median microseconds per call (triton.testing.do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median")) * 1e3


def _speed(model, inputs: tuple, seq_len: int, dtype: torch.dtype) -> None:
    """Plain and CUDA-graphed median time of one draft step, torch.compile default vs the fx_fusion backend."""
    name = torch.cuda.get_device_name(inputs[0].device)
    print(f"\nSpeed on {name} (median of triton.testing.do_bench; one step, batch 1, T={seq_len}, {str(dtype)[6:]}):")
    rows = {}
    with torch.no_grad():
        for label, backend in (("torch.compile (default)", "inductor"), ("torch.compile fx_fusion", "fx_fusion")):
            compiled = torch.compile(model, backend=backend, dynamic=False)
            for _ in range(3):
                compiled(*inputs)
            torch.cuda.synchronize()
            plain = _bench_us(lambda: compiled(*inputs))
            try:
                graphed = _bench_us(cuda_graphs.capture(lambda: compiled(*inputs)))
            except Exception as exc:  # report what ran; a capture problem is not the demo's verdict
                print(f"  ({label}: CUDA graph capture failed: {type(exc).__name__}: {exc})")
                graphed = math.nan
            rows[label] = (plain, graphed)
    print(f"  {'':<26}{'plain':>12}{'CUDA graph':>14}")
    for label, (plain, graphed) in rows.items():
        print(f"  {label:<26}{plain:>9.1f} us{graphed:>11.1f} us")
    (p0, g0), (p1, g1) = rows.values()
    print(f"  {'speedup (fx_fusion)':<26}{p0 / p1:>11.2f}x{g0 / g1:>13.2f}x")
    print("  (plain: every call launched from Python, host overhead included; CUDA graph: replays only)")


BLOCK_SIZE = 16  # tokens of the drafted (noise) block per step


def demo(args: argparse.Namespace) -> int:
    from .draft_step import draft_step_inputs, qwen3_draft_step
    from .explain import explain

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda, but torch.cuda.is_available() is False")
    gpu = device.type == "cuda"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        args.dtype or ("bf16" if gpu else "fp32")
    ]
    seq_len = args.seq_len or (1024 if gpu else 16)
    preset = "realistic" if gpu else "small"
    start = time.perf_counter()
    max_len = seq_len + 2 * BLOCK_SIZE
    model = qwen3_draft_step(args.layers, preset=preset, max_len=max_len, dtype=dtype, device=device)
    inputs = draft_step_inputs(model, ctx_tokens=seq_len, block_size=BLOCK_SIZE)
    attn = model.layers[0].self_attn
    print(
        f"DFlash-style draft step: {len(model.layers)} Hugging Face Qwen3 decoder layers. Each writes the context "
        f"K/V of the target's hidden states\ninto its own cache (index_copy_, as StaticCache does), then the "
        f"{BLOCK_SIZE}-token noise block attends over cache + block.\n  hidden {model.hidden_size}, "
        f"{attn.config.num_key_value_heads} KV heads x {attn.head_dim}, K RMSNorm + RoPE; {str(dtype)[6:]} on "
        f"{device}; batch 1, T={seq_len} context tokens ({'Qwen3-8B-sized' if gpu else 'small random config'})\n"
    )

    def caches() -> list[torch.Tensor]:
        return [t.clone() for c in model.caches for t in (c.k, c.v)]

    with torch.no_grad():
        reference = model(*inputs)
    reference_caches = caches()
    model.reset_caches()
    report = explain(model, *inputs, dump_dir=args.dump, svg_dir=args.svg)
    print(report)
    _print_files(report, args.dump, args.svg, sys.stdout)

    max_abs, max_rel = _max_errors((report.output, *caches()), (reference, *reference_caches))
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    ok = max_rel <= tolerance and math.isfinite(max_abs)
    print(
        f"\nNumerics vs eager (the drafted block's hidden states and {len(reference_caches)} caches): max abs error "
        f"{max_abs:.3e}, max relative error {max_rel:.3e} (tolerance {tolerance:g}): {'PASS' if ok else 'FAIL'}"
    )
    absorbed = [g for g in report.fused_groups if g.cache_writes.startswith("K and V of")]
    if not absorbed:
        print("FAIL: the context K/V were not fused straight into the caches")
        ok = False
    if gpu:
        _speed(model, inputs, seq_len, dtype)
    else:
        print("(speed: run on a CUDA machine to compare with torch.compile's default backend)")
    print(f"\ndemo took {time.perf_counter() - start:.1f}s")
    return EXIT_OK if ok else EXIT_FAIL


# ----------------------------------------------------------------------------------------------------------
# explain


def load_factory(target: str) -> Callable:
    """'path/to/file.py:name' or 'package.module:name' -> the named callable."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise CLIError(f"expected PATH.py:FACTORY or package.module:FACTORY, got {target!r}")
    if where.endswith(".py") or os.sep in where or os.path.exists(where):
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise CLIError(f"no such file: {where}")
        module_name = "_fx_fusion_factory_" + "".join(c if c.isalnum() else "_" for c in path)
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise CLIError(f"cannot import {where}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        directory = os.path.dirname(path)
        if directory not in sys.path:
            sys.path.insert(0, directory)  # so the file can import its neighbours
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise CLIError(f"cannot import {where!r}: {exc}") from None
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise CLIError(f"{where} has no attribute {name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CLIError(f"{target} is not callable")
    return obj


def call_factory(factory: Callable) -> tuple[Any, tuple, dict]:
    """(module, args, kwargs) from a factory returning (module, args) or (module, args, kwargs)."""
    result = factory()
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise CLIError(
            "the factory must return (module, example_args) or (module, example_args, example_kwargs), "
            f"got {type(result).__name__}"
        )
    module, args = result[0], result[1]
    kwargs = result[2] if len(result) == 3 else {}
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise CLIError("example_args must be a tuple (or one tensor) and example_kwargs a dict")
    if not callable(module):
        raise CLIError(f"the factory's module is not callable ({type(module).__name__})")
    return module, tuple(args), kwargs


def explain_command(args: argparse.Namespace) -> int:
    from .explain import explain

    module, call_args, call_kwargs = call_factory(load_factory(args.target))
    options: dict[str, Any] = {}
    if args.min_layers is not None:
        options["min_layers"] = args.min_layers
    report = explain(
        module,
        *call_args,
        backend_options=options,
        dump_dir=args.dump,
        svg_dir=args.svg,
        no_grad=not args.grad,
        **call_kwargs,
    )
    if args.json:
        print(report.to_json())
        _print_files(report, args.dump, args.svg, sys.stderr)
    else:
        print(report)
        if args.graphs:
            print("\nRegion before the pass:\n" + (report.graph_before or "(none)\n"))
            print("Region after the pass:\n" + (report.graph_after or "(none)\n"))
        _print_files(report, args.dump, args.svg, sys.stdout)
    return EXIT_OK


# ----------------------------------------------------------------------------------------------------------
# main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fx-fusion",
        description="Fuse multi-layer draft K/V materialization under torch.compile, and show what was fused.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,explain}")
    sub.required = True

    d = sub.add_parser("demo", help="compile a DFlash-style Qwen3 draft step, report, check, time")
    d.add_argument("--layers", type=int, default=5, help="draft layers (default 5)")
    d.add_argument("--seq-len", type=int, default=None, help="context tokens (default 16 on CPU, 1024 on GPU)")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    d.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="default fp32 on CPU, bf16 on GPU")
    d.add_argument("--dump", metavar="DIR", default=None, help="write depyf's dumps and the pass's graphs to DIR")
    d.add_argument("--svg", metavar="DIR", default=None, help="draw the rewritten regions as SVG into DIR")
    d.set_defaults(run=demo)

    e = sub.add_parser("explain", help="report what the pass does to your module")
    e.add_argument("target", metavar="PATH_OR_MODULE:FACTORY", help="file.py:make or package.module:make")
    e.add_argument("--json", action="store_true", help="print the report as JSON")
    e.add_argument("--min-layers", type=int, default=None, help="fuse groups of at least N layers (default 1)")
    e.add_argument("--graphs", action="store_true", help="also print the rewritten region before/after")
    e.add_argument("--grad", action="store_true", help="run with autograd enabled (default: torch.no_grad)")
    e.add_argument("--dump", metavar="DIR", default=None, help="write depyf's dumps and the pass's graphs to DIR")
    e.add_argument("--svg", metavar="DIR", default=None, help="draw the rewritten regions as SVG into DIR")
    e.set_defaults(run=explain_command)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except CLIError as exc:
        print(f"fx-fusion {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stdout = open(os.devnull, "w")
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
