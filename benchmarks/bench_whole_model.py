"""Per-call time of whole Hugging Face causal LMs: torch.compile default vs Inductor freezing vs fx_fusion.

    python benchmarks/bench_whole_model.py [--quick] [--device cpu|cuda] [--models a,b] [--out DIR]

Models (random weights, batch 1, one forward over T tokens, no KV cache, logits of the last token only
as `generate`'s prefill computes them):

  CPU (the default without CUDA), float32, T = 1, 16, 128 (--quick: 1, 128); small widths, 4 layers:
    llama3-style   LlamaConfig, hidden 256, 8 heads, 4 KV heads (GQA), head_dim 32, intermediate 768
    llama2-style   the same with 8 KV heads (MHA: each layer's Q and K can form a group)
    qwen3          Qwen3Config with the llama3-style sizes (per-head q/k RMSNorm)
  CUDA (--device cuda), bfloat16, T = 1, 16, 512, 4096 (--quick: 1, 4096); 4 layers at 8B widths:
    llama3-8b      hidden 4096, 32 heads, 8 KV heads x 128, intermediate 14336
    qwen3-8b       hidden 4096, 32 heads, 8 KV heads x 128, intermediate 12288
    (llama2-7b     hidden 4096, 32 heads, 32 KV heads x 128 (MHA), intermediate 11008; only with --models)
  On CUDA the vocabulary is cut to 32000 (Llama-3 has 128256, Qwen3 151936) to save memory; with the
  logits of one token only, the lm_head is a small share of a call either way.

Columns (each compiled with dynamic=False, one compile per T; torch._dynamo.reset() before each T):

  default     torch.compile(model)
  freezing    torch.compile(model) with torch._inductor.config.freezing = True (set globally while this
              column compiles, warms up and is timed; everything runs under torch.no_grad()); its backend is
              Inductor's compile_fx under a name of its own, so dynamo keeps its code apart from default's
  fx_fusion   torch.compile(model, backend="fx_fusion") (compiled with the FX graph / autograd caches off,
              so the pass runs and reports what it fused)
  *_graph     on CUDA: the warmed-up compiled callable captured in a torch.cuda.CUDAGraph, replay timed
              (bench_module.capture_graph); --no-graph skips these

Timing: the uncaptured columns (CPU and CUDA) in --repeats rounds in which each column times one block of
back-to-back calls (at least --block-ms long, one synchronize at its end on CUDA) with perf_counter, the
order changing between rounds (every permutation in turn, `round_orders`) so that load from other work,
clock drift and cache effects of the neighbouring column hit every column alike; the
per-call time of each block is one sample (--threads 1 is steadier when other work shares the cores). This
is how a decode loop calls the model: where a call is bound by host work, its launches overlap the previous
call's kernels. The CUDA-graphed columns: triton.testing.do_bench(return_mode="all") per-call times of the
replay in --rounds rounds, each timing every graphed column for --rep / --rounds ms in turn, ordered the same way. A
block or round holds at least --min-calls calls (at T = 4096 a call takes about 15 ms). Cells are the
median with the 10th-90th percentile spread; a ratio cell is the ratio of the medians and the 10th-90th percentiles
of the ratios taken round by round (both columns timed in each round). Every column's logits are checked against eager (relative
Frobenius error < 1e-3 in float32, < 4e-2 in bfloat16: stock Inductor itself sits at 2.5e-2 from eager at T=4096) before timing; a failing column is marked FAIL,
one that cannot be built or run shows "-" and its error is printed.

Prints a markdown table and what the pass fused in each model, and writes bench_whole_model.json and
bench_whole_model.md to --out.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import inspect
import itertools
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_module import (
    capture_graph,
    collect_pass_records,
    fx_fusion_backend,
    log,
    pass_summary,
    rel_error,
    short_error,
)

CPU_SEQ_LENS, CPU_QUICK_SEQ_LENS = [1, 16, 128], [1, 128]
CUDA_SEQ_LENS, CUDA_QUICK_SEQ_LENS = [1, 16, 512, 4096], [1, 4096]
CUDA_VOCAB = 32000

SMALL = dict(
    hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=768,
    vocab_size=1024, max_position_embeddings=4096,
)
LLAMA3_8B = dict(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
    vocab_size=CUDA_VOCAB, max_position_embeddings=8192, rope_theta=500000.0,
)
QWEN3_8B = dict(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
    vocab_size=CUDA_VOCAB, max_position_embeddings=8192, rope_theta=1000000.0,
)
LLAMA2_7B = dict(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, head_dim=128, intermediate_size=11008,
    vocab_size=CUDA_VOCAB, max_position_embeddings=8192,
)

# name -> (transformers config class, causal LM class, sizes)
MODELS = {
    "llama3-style": ("LlamaConfig", "LlamaForCausalLM", SMALL),
    "llama2-style": ("LlamaConfig", "LlamaForCausalLM", {**SMALL, "num_key_value_heads": 8}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", SMALL),
    "llama3-8b": ("LlamaConfig", "LlamaForCausalLM", LLAMA3_8B),
    "qwen3-8b": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_8B),
    "llama2-7b": ("LlamaConfig", "LlamaForCausalLM", LLAMA2_7B),
}
CPU_MODELS = ["llama3-style", "llama2-style", "qwen3"]
CUDA_MODELS = ["llama3-8b", "qwen3-8b"]

BASE_COLUMNS = ["default", "freezing", "fx_fusion"]


# ----------------------------------------------------------------------------------------------------------
# Models


def build_model(name: str, layers: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    import transformers

    config_name, model_name, sizes = MODELS[name]
    sizes = dict(sizes)
    rope_theta = sizes.pop("rope_theta", None)
    config = getattr(transformers, config_name)(
        num_hidden_layers=layers, pad_token_id=0, bos_token_id=1, eos_token_id=2, **sizes
    )
    if rope_theta is not None:  # transformers >= 5 keeps it in rope_parameters, older versions as rope_theta
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict):
            params["rope_theta"] = rope_theta
        else:
            config.rope_theta = rope_theta
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_name)(config)
    model = model.to(dtype).eval()
    with torch.no_grad():  # non-trivial norm weights (the random init leaves them at 1)
        for param_name, param in model.named_parameters():
            if "norm" in param_name and param.dim() == 1:
                param.uniform_(0.5, 1.5)
    return model


def forward_kwargs(model) -> dict[str, Any]:
    """No KV cache; logits of the last token only (whatever this transformers version calls that)."""
    params = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {"use_cache": False}
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            kwargs[name] = 1
            break
    return kwargs


# ----------------------------------------------------------------------------------------------------------
# Timing


def _percentile(sorted_values: list[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def spread(times_us: list[float]) -> dict[str, float]:
    values = sorted(times_us)
    return {
        "median_us": statistics.median(values),
        "p10_us": _percentile(values, 0.1),
        "p90_us": _percentile(values, 0.9),
        "min_us": values[0],
        "max_us": values[-1],
        "samples": len(values),
    }


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The column order of each round: every permutation in turn, so that each column runs right after each
    other one equally often (a plain rotation puts one column after the same neighbour in most rounds, and
    a column that leaves the caches cold, as freezing's folded weights can on a CPU, then weighs on it)."""
    orders = [list(order) for order in itertools.permutations(names)]
    return [orders[index % len(orders)] for index in range(rounds)]


def cuda_times_interleaved(calls: dict[str, Callable[[], Any]], args) -> dict[str, dict[str, float]]:
    """Per-call microseconds on CUDA: --rounds rounds, each running do_bench on every column in turn (the
    order changing between rounds, `round_orders`) for --rep / --rounds ms; median and spread of all per-call times."""
    from triton.testing import do_bench

    names = list(calls)
    if not names:
        return {}
    round_ms = {}
    for name in names:  # a round holds at least --min-calls calls (large T: a call can outlast --rep / --rounds)
        with freezing_on(name.startswith("freezing")):
            call_ms = do_bench(calls[name], warmup=args.warmup, rep=1)
        round_ms[name] = max(args.rep / args.rounds, args.min_calls * call_ms)
    samples: dict[str, list[float]] = {name: [] for name in names}
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for order in round_orders(names, args.rounds):
        for name in order:
            with freezing_on(name.startswith("freezing")):
                times = do_bench(calls[name], warmup=args.warmup, rep=round_ms[name], return_mode="all")
            samples[name] += [t * 1e3 for t in times]
            rounds[name].append(statistics.median(times) * 1e3)
    return {name: {**spread(samples[name]), "rounds_us": rounds[name]} for name in names}


def block_times_interleaved(calls: dict[str, Callable[[], Any]], args, sync: Callable[[], None]) -> dict[str, dict[str, float]]:
    """Per-call microseconds of back-to-back calls: --repeats rounds, each timing one block of calls of every
    column in turn (the order changing between rounds, `round_orders`), `sync()` before a block starts and when it ends."""
    if not calls:
        return {}
    per_block = {}
    for name, fn in calls.items():
        with freezing_on(name == "freezing"):
            for _ in range(3):
                fn()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            per_block[name] = max(args.min_calls, int(args.block_ms / 1e3 / max(time.perf_counter() - t0, 1e-7)))
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for order in round_orders(names, args.repeats):
        for name in order:
            fn, n = calls[name], per_block[name]
            with freezing_on(name == "freezing"):
                sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                sync()
                samples[name].append((time.perf_counter() - t0) / n * 1e6)
    return {name: {**spread(samples[name]), "rounds_us": samples[name], "calls_per_sample": per_block[name]} for name in names}


# ----------------------------------------------------------------------------------------------------------
# What the pass did


def _short(location: str) -> str:
    """'[0].model.layers.3.self_attn.k_proj ("file", line 5, ...)' -> 'layers.3.self_attn.k_proj'."""
    path = re.sub(r"^(\[\d+\]\.)+", "", location.split(" ", 1)[0])
    return re.sub(r"^model\.", "", path)


def describe_pass(records: list) -> dict[str, Any]:
    """What the pass fused (groups with their member projections) and why it left the rest alone
    (reasons with the projection kinds they were given for and how often)."""
    info = pass_summary(records)
    groups = []
    reasons: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for record in records:
        for group in record.fused_groups:
            groups.append(
                {
                    "n_layers": group.n_layers,
                    "heads_x_dim": f"{group.num_kv_heads}x{group.head_dim}",
                    "k_norm": group.k_norm,
                    "v_as_view": group.v_as_view,
                    "members": [_short(loc) for loc in group.layers],
                }
            )
        for rejection in record.rejected:
            kind = _short(rejection.location).rsplit(".", 1)[-1]
            reasons[rejection.reason][kind] += 1
    info["groups"] = groups
    info["left_alone"] = {reason: dict(kinds) for reason, kinds in reasons.items()}
    info.pop("summaries", None)
    info["graphs"] = len(records)
    return info


def pass_text(info: dict[str, Any] | None) -> list[str]:
    if not info:
        return ["  (the pass reported nothing)"]
    lines = [
        f"  {info['graphs']} graph(s); fused {info['fused_groups']} group(s), {info['fused_layers']} projection(s) "
        f"as K; {info['rejected']} left alone"
    ]
    for group in info["groups"]:
        lines.append(
            f"  - group of {group['n_layers']} ({group['heads_x_dim']}, k_norm={group['k_norm']}, "
            f"V as view {group['v_as_view']}): {', '.join(group['members'])}"
        )
    for reason, kinds in info["left_alone"].items():
        kinds_text = ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items()))
        lines.append(f"  - left alone ({kinds_text}): {reason}")
    return lines


# ----------------------------------------------------------------------------------------------------------
# Columns


@contextlib.contextmanager
def freezing_on(enabled: bool):
    """torch._inductor.config.freezing = True for the block (set globally, restored after)."""
    import torch._inductor.config as inductor_config

    previous = inductor_config.freezing
    inductor_config.freezing = enabled or previous
    try:
        yield
    finally:
        inductor_config.freezing = previous


@contextlib.contextmanager
def caches_off():
    import torch._functorch.config
    import torch._inductor.config

    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(
        enable_autograd_cache=False
    ):
        yield


def _inductor_with_freezing(gm, example_inputs):
    """Inductor, as a backend callable of its own: dynamo keeps one cache entry per backend, so this
    column's compiled code (built while freezing is on) never serves the default column, or the reverse."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def compile_column(column: str, model, ids, kwargs, device, tag: str, args) -> tuple[dict, Callable | None]:
    """Compile `model` one way and run it three times; returns (cell, call) or (cell with error, None)."""
    cell: dict[str, Any] = {}
    is_fxf = column == "fx_fusion"
    backend = {"default": "inductor", "freezing": _inductor_with_freezing}.get(column)
    log(f"{tag} {column:>16}: compiling ...")
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(freezing_on(column == "freezing"))
            if is_fxf:  # compile afresh, so that the pass runs and reports
                stack.enter_context(caches_off())
                backend = fx_fusion_backend()
            records = stack.enter_context(collect_pass_records(is_fxf))
            t0 = time.perf_counter()
            compiled = torch.compile(model, backend=backend, dynamic=False)
            call = lambda: compiled(ids, **kwargs).logits
            for _ in range(3):
                out = call()
            if device.type == "cuda":
                torch.cuda.synchronize()
            cell["compile_s"] = time.perf_counter() - t0
        if is_fxf:
            cell["pass"] = describe_pass(records)
        cell["out"] = out
        return cell, call
    except Exception as exc:  # one column's failure must not end the run
        cell["error"] = short_error(exc)
        log(f"{tag} {column:>16}: -  ERROR {cell['error']}")
        if args.verbose:
            traceback.print_exc()
        return cell, None


def _check(cell: dict, out, ref, tol: float) -> None:
    cell["rel_err"] = rel_error((out,), (ref,))
    cell["ok"] = cell["rel_err"] < tol


def _log_cell(tag: str, name: str, cell: dict) -> None:
    if cell.get("median_us") is None:
        return
    extra = f"  (compile {cell['compile_s']:.1f}s)" if "compile_s" in cell else ""
    log(
        f"{tag} {name:>16}: {cell['median_us']:10.1f} us  (p10 {cell['p10_us']:.1f}, p90 {cell['p90_us']:.1f})  "
        f"err {cell['rel_err']:.1e} {'ok' if cell['ok'] else 'FAIL'}{extra}"
    )


def run_config(model, ids, kwargs, ref, device, args, tol: float, tag: str) -> dict[str, Any]:
    """All columns for one (model, T): compile each, check each against eager, then time them."""
    torch._dynamo.reset()
    row: dict[str, Any] = {}
    calls: dict[str, Callable[[], Any]] = {}
    for column in BASE_COLUMNS:
        cell, call = compile_column(column, model, ids, kwargs, device, tag, args)
        row[column] = cell
        if call is not None:
            _check(cell, cell.pop("out"), ref, tol)
            calls[column] = call
    if device.type == "cuda":
        for column, times in block_times_interleaved(calls, args, torch.cuda.synchronize).items():
            row[column].update(times)
            _log_cell(tag, column, row[column])
        replays = {}
        if not args.no_graph:
            for column, call in calls.items():
                name = column + "_graph"
                cell = row[name] = {}
                try:
                    with freezing_on(column == "freezing"):
                        replay = capture_graph(call, device)
                        _check(cell, replay(), ref, tol)
                    replays[name] = replay
                except Exception as exc:
                    cell["error"] = short_error(exc)
                    log(f"{tag} {name:>16}: -  ERROR {cell['error']}")
                    if args.verbose:
                        traceback.print_exc()
        for name, times in cuda_times_interleaved(replays, args).items():
            row[name].update(times)
            _log_cell(tag, name, row[name])
        replays.clear()
    else:
        for column, times in block_times_interleaved(calls, args, lambda: None).items():
            row[column].update(times)
            _log_cell(tag, column, row[column])
    calls.clear()
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------------------------------------
# Report


def fmt(cell: dict | None) -> str:
    if not cell or cell.get("median_us") is None:
        return "-"
    text = f"{cell['median_us']:.1f} ({cell['p10_us']:.1f}-{cell['p90_us']:.1f})"
    return text if cell.get("ok", True) else f"FAIL {text}"


def ratio(row: dict, num: str, den: str) -> str:
    """The ratio of the medians, then [p10-p90] of the per-round ratios (each round times both columns
    back to back, so drift between rounds cancels in them)."""
    a, b = row.get(num) or {}, row.get(den) or {}
    if a.get("median_us") is None or b.get("median_us") is None:
        return "-"
    text = f"{a['median_us'] / b['median_us']:.3f}"
    if len(a.get("rounds_us", [])) == len(b.get("rounds_us", [])) > 1:
        per_round = sorted(x / y for x, y in zip(a["rounds_us"], b["rounds_us"]))
        text += f" [{_percentile(per_round, 0.1):.2f}-{_percentile(per_round, 0.9):.2f}]"
    return text


def markdown(rows: list[dict], meta: dict, graphed: bool) -> str:
    lines = ["# Whole-model benchmark: torch.compile default vs freezing vs fx_fusion", ""]
    lines.append(
        f"{meta['device_name']}; torch {meta['torch']}, transformers {meta['transformers']}; {meta['dtype']}, "
        f"batch 1, {meta['layers']} layers, no KV cache, logits of the last token; {meta['timing']}."
    )
    if meta.get("note"):
        lines.append(meta["note"])
    lines.append(
        "Cells: median us per call (p10-p90). fx_fusion/default < 1: fx_fusion faster (ratio of the medians, "
        "[p10-p90] of the per-round ratios). FAIL: logits differ from eager."
    )
    lines.append("")
    header = ["model", "T", "default", "freezing", "fx_fusion", "fx_fusion/default"]
    if graphed:
        header += ["default graphed", "freezing graphed", "fx_fusion graphed", "fx_fusion/default graphed"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    for row in rows:
        cells = [row["model"], str(row["T"])]
        cells += [fmt(row.get(c)) for c in BASE_COLUMNS] + [ratio(row, "fx_fusion", "default")]
        if graphed:
            cells += [fmt(row.get(c + "_graph")) for c in BASE_COLUMNS]
            cells += [ratio(row, "fx_fusion_graph", "default_graph")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("What the fx_fusion pass did (per model, first T; any T where it differs is listed too):")
    lines.append("")
    by_model: dict[str, list[dict]] = collections.defaultdict(list)
    for row in rows:
        by_model[row["model"]].append(row)
    for model, model_rows in by_model.items():
        infos = [(r["T"], (r.get("fx_fusion") or {}).get("pass")) for r in model_rows]
        infos = [(t, i) for t, i in infos if i is not None]
        if not infos:
            lines.append(f"- {model}: no record (the fx_fusion column failed)")
            continue
        first_t, first = infos[0]
        lines.append(f"- {model} (T={first_t}):")
        lines += pass_text(first)
        for t, info in infos[1:]:
            if info != first:
                lines.append(f"- {model} (T={t}) differs:")
                lines += pass_text(info)
    errors = [
        f"- {row['model']} T={row['T']} {col}: {cell['error']}"
        for row in rows
        for col, cell in row.items()
        if isinstance(cell, dict) and cell.get("error")
    ]
    if errors:
        lines += ["", "Errors:", *errors]
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: str, rows: list[dict], meta: dict, graphed: bool) -> str:
    text = markdown(rows, meta, graphed)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_whole_model.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    with open(os.path.join(out_dir, "bench_whole_model.md"), "w") as f:
        f.write(text)
    return text


# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default=None, help=f"comma-separated, from {list(MODELS)}")
    parser.add_argument("--seq-lens", default=None, help="comma-separated T values")
    parser.add_argument("--quick", action="store_true", help="fewer T values")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--no-graph", action="store_true", help="CUDA: skip the CUDA-graphed columns")
    parser.add_argument("--repeats", type=int, default=None, help="uncaptured columns: timed blocks (default 24, --quick 12)")
    parser.add_argument("--block-ms", type=float, default=20.0, help="uncaptured columns: minimum length of one timed block")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="CPU: torch.set_num_threads (default: torch's own); 1 is steadier on a machine shared with other work",
    )
    parser.add_argument("--warmup", type=int, default=25, help="CUDA: do_bench warmup (ms)")
    parser.add_argument("--rep", type=int, default=200, help="CUDA-graphed: do_bench time per column (ms), over all rounds")
    parser.add_argument("--rounds", type=int, default=6, help="CUDA-graphed: interleaved do_bench rounds")
    parser.add_argument(
        "--min-calls", type=int, default=10,
        help="calls in every timed block (uncaptured) and do_bench round (graphed) at least, however long a call is",
    )
    parser.add_argument("--out", default="bench_out", help="folder for bench_whole_model.json / .md")
    parser.add_argument("--verbose", action="store_true", help="print full tracebacks of failing columns")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    on_cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if on_cuda else torch.float32)
    if args.seq_lens:
        seq_lens = [int(t) for t in args.seq_lens.split(",") if t]
    elif on_cuda:
        seq_lens = CUDA_QUICK_SEQ_LENS if args.quick else CUDA_SEQ_LENS
    else:
        seq_lens = CPU_QUICK_SEQ_LENS if args.quick else CPU_SEQ_LENS
    models = [m for m in args.models.split(",") if m] if args.models else (CUDA_MODELS if on_cuda else CPU_MODELS)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {list(MODELS)}")
    if args.repeats is None:
        args.repeats = 12 if args.quick else 24
    tol = 1e-3 if dtype == torch.float32 else 4e-2
    graphed = on_cuda and not args.no_graph

    import transformers

    meta: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(device) if on_cuda else (platform.processor() or "cpu"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "layers": args.layers,
        "seq_lens": seq_lens,
        "models": {m: MODELS[m][2] for m in models},
        "tolerance": tol,
        "timing": (
            f"uncaptured: {args.repeats} blocks of >= {args.block_ms:g} ms and >= {args.min_calls} back-to-back calls, "
            f"synchronized; graphed: triton do_bench(warmup={args.warmup} ms, rep={args.rep} ms in {args.rounds} rounds, "
            f">= {args.min_calls} calls a round), all calls"
            if on_cuda
            else f"{args.repeats} blocks of >= {args.block_ms:g} ms, {torch.get_num_threads()} threads"
        ),
    }
    if on_cuda:
        meta["note"] = f"Vocabulary cut to {CUDA_VOCAB} (Llama-3: 128256, Qwen3: 151936) to save memory."
    log(f"bench_whole_model: {meta['device_name']}, torch {meta['torch']}, transformers {meta['transformers']}; "
        f"{meta['dtype']}, {args.layers} layers; models {models}; T {seq_lens}")

    t_start = time.perf_counter()
    rows: list[dict] = []
    with torch.no_grad():
        for name in models:
            try:
                model = build_model(name, args.layers, dtype, device)
            except Exception as exc:
                log(f"[{name}] could not be built: {short_error(exc)}")
                rows.append({"model": name, "T": "-", "default": {"error": short_error(exc)}})
                continue
            kwargs = forward_kwargs(model)
            generator = torch.Generator().manual_seed(0)
            for seq_len in seq_lens:
                tag = f"[{name} T={seq_len}]"
                ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=generator).to(device)
                ref = model(ids, **kwargs).logits
                row: dict[str, Any] = {"model": name, "T": seq_len}
                row.update(run_config(model, ids, kwargs, ref, device, args, tol, tag))
                rows.append(row)
                write_outputs(args.out, rows, meta, graphed)  # partial results survive an interrupted run
            del model
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
    meta["elapsed_s"] = time.perf_counter() - t_start
    text = write_outputs(args.out, rows, meta, graphed)
    print()
    print(text)
    log(f"wrote {os.path.join(args.out, 'bench_whole_model.json')} and bench_whole_model.md "
        f"({meta['elapsed_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
