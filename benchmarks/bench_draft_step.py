"""GPU benchmark of a whole DFlash-style draft step and of its context part, every column in one run.

    python benchmarks/bench_draft_step.py [--quick] [--seq-lens 1,16,128,1024,8192] [--parts context,step]
        [--caches bf16,fp8] [--out DIR]
    python benchmarks/bench_draft_step.py --fp8-ab ROUNDS [--seq-lens 1024,8192] [--out DIR]

The draft (fx_fusion.draft_step.qwen3_draft_step): 5 Hugging Face Qwen3 decoder layers, Qwen3-8B attention
sizes (hidden 4096, 32 query / 8 KV heads x 128), bf16, batch 1, a 16-token noise block, per-layer caches
[1, 8, max_len, 128] written with index_copy_ (StaticCache's spelling). T = context tokens per step.

Parts: "context" = `DraftStep.write_context` (every layer's K/V of the T context tokens into its cache),
"step" = the whole step (context, then the block's attention over cache + block and the rest of each
layer). Caches: bf16, or FP8 e4m3 with a per-tensor scale (`(k / k_scale).to(fp8)`, "fp8" rows).

FP8 rows have the inductor and fx_fusion columns only. Columns (median us of triton.testing.do_bench, plain and CUDA-graphed: the warmed-up callable captured in a
torch.cuda.CUDAGraph, replays timed):
    inductor   torch.compile(m)                       frozen   the same with Inductor freezing
    fx_fusion  torch.compile(m, backend="fx_fusion")   sglang   the context part hand-fused: K/V weights
               (its context group fused, the cache                stacked once, one GEMM, the fused op,
               writes absorbed: one GEMM + one kernel)            then each layer's index_copy_ into its
                                                                  cache (SGLang's order); in the step, the
                                                                  same block part after it; compiled with
                                                                  torch.compile
floor (context): max(bytes / copy bandwidth, flops / matmul rate), bytes = hidden states + K/V weights + the
cache rows written (each byte once), flops = 2*T*hidden*L*2*kv; ceilings measured in this run (fastest
do_bench call of a 1 GiB copy and a bf16 8192^3 matmul). Every column is checked against eager (the step's
output and the written cache rows, relative error < 2e-2, < 1e-1 with FP8 caches) before it is timed. Writes bench_draft_step.json
and .md to --out.

--fp8-ab ROUNDS compares the fx_fusion context part with FP8 and with bf16 caches only, CUDA-graphed, in
ROUNDS rounds that time both (L2 emptied by a read before each call; the order alternating between rounds),
because the difference (half the cache bytes written) is smaller than the drift between two columns timed
one after the other: per T, both medians and the median, 10th and 90th percentile of the per-round ratio
FP8 / bf16, and in how many rounds FP8 was faster. Writes bench_draft_step_fp8_ab.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_module import Timer, capture_graph, log, measure_ceilings, short_error  # noqa: E402
from bench_whole_model import _percentile  # noqa: E402

import fx_fusion  # noqa: E402,F401  (registers backend="fx_fusion")
from fx_fusion.diagnostics import RecordSink  # noqa: E402
from fx_fusion.draft_step import DraftStep, draft_step_inputs, qwen3_draft_step  # noqa: E402
from fx_fusion.drafts import ContextKV, HandFusedContextKV  # noqa: E402

LAYERS, BLOCK = 5, 16
FP8 = torch.float8_e4m3fn


class ContextPart(torch.nn.Module):
    """`DraftStep.write_context` as a module (what the context columns compile)."""

    def __init__(self, step: DraftStep) -> None:
        super().__init__()
        self.step = step

    def forward(self, target_hidden, ctx_positions, noise, block_positions):
        return self.step.write_context(target_hidden, ctx_positions)


class SGLangContext(torch.nn.Module):
    """The hand-fused context part: one GEMM over weights stacked once, the fused op, then per-layer writes."""

    def __init__(self, step: DraftStep) -> None:
        super().__init__()
        self.step = step
        self.fused = HandFusedContextKV(ContextKV([layer.self_attn for layer in step.layers], step.rotary_emb))

    def forward(self, target_hidden, ctx_positions, noise, block_positions):
        cache_position = ctx_positions[0]
        outputs = self.fused(target_hidden, ctx_positions)
        for i, cache in enumerate(self.step.caches):
            cache.k.index_copy_(2, cache_position, outputs[2 * i])
            cache.v.index_copy_(2, cache_position, outputs[2 * i + 1])
        return cache_position


class SGLangStep(torch.nn.Module):
    """The whole step with the hand-fused context part (`SGLangContext`), then the same block part."""

    def __init__(self, step: DraftStep) -> None:
        super().__init__()
        self.step = step
        self.context = SGLangContext(step)

    def forward(self, target_hidden, ctx_positions, noise, block_positions):
        cache_position = self.context(target_hidden, ctx_positions, noise, block_positions)
        return self.step.attend_block(noise, block_positions, cache_position)


def floor_us(step: DraftStep, seq_len: int, ceilings: dict) -> dict[str, float]:
    attn = step.layers[0].self_attn
    hidden, elt = step.hidden_size, attn.k_proj.weight.element_size()
    kv = attn.k_proj.weight.shape[0]
    cache_elt = step.caches[0].k.element_size()
    nbytes = seq_len * hidden * elt + LAYERS * 2 * kv * hidden * elt + LAYERS * 2 * seq_len * kv * cache_elt
    flops = 2 * seq_len * hidden * LAYERS * 2 * kv
    t_mem, t_flop = nbytes / ceilings["copy_bytes_per_s"] * 1e6, flops / ceilings["matmul_flops_per_s"] * 1e6
    return {"us": max(t_mem, t_flop), "mem_us": t_mem, "flop_us": t_flop, "bytes": nbytes, "flops": flops}


def snapshot(step: DraftStep, out: Any, seq_len: int) -> list[torch.Tensor]:
    """What a column must reproduce: the step's output (if any) and the cache rows written this step."""
    rows = [t[:, :, :seq_len].float() for c in step.caches for t in (c.k, c.v)]
    return ([out.float()] if out.dim() == 3 else []) + rows


def rel_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max((g - r).norm().item() / max(r.norm().item(), 1e-30) for g, r in zip(got, ref))


def run_column(timer: Timer, step: DraftStep, module, backend: str | None, freezing: bool, inputs, ref, seq_len):
    """{"plain": us, "graph": us, "err": rel, "tol": allowed, "absorbed": bool} for one compiled variant."""
    torch._dynamo.reset()
    records: list = []
    with torch._inductor.config.patch(freezing=freezing, fx_graph_cache=False), RecordSink.collect(records):
        fn = torch.compile(module, backend=backend, dynamic=False) if backend else module
        step.reset_caches()
        out = fn(*inputs)
        err = rel_error(snapshot(step, out, seq_len), ref)
        call = lambda: fn(*inputs)  # noqa: E731
        for _ in range(2):
            call()
        # one FP8 step is 6-12% of a value: FP8 caches that round a value the other way differ that much
        cell = {"err": err, "tol": 1e-1 if step.k_scale is not None else 2e-2, "plain": timer(call)}
        try:
            cell["graph"] = timer(capture_graph(call, inputs[0].device))
        except Exception as exc:  # noqa: BLE001
            cell["graph_error"] = short_error(exc)
    notes = [g.cache_writes for r in records for g in r.fused_groups if g.cache_writes]
    cell["absorbed"] = any(n.startswith("K and V of") for n in notes)
    return cell


def fp8_against_bf16(seq_lens: list[int], rounds: int, device: torch.device) -> list[dict]:
    """Per T: the fx_fusion context part with bf16 and with FP8 caches, CUDA-graphed, timed in alternating
    order in each of `rounds` rounds (each cell checked against eager first). On a CPU (a check of the
    script: small preset, wall-clock times, no graphs) the calls are timed as they are."""
    timer = Timer(device, warmup=5, rep=25, l2_flush="read")
    preset = "realistic" if device.type == "cuda" else "small"
    rows = []
    for seq_len in seq_lens:
        # one reset for both compiles (a reset frees what a captured graph reads); each replay keeps its
        # callable, and with it its step, module and inputs, alive (cuda_graphs.capture)
        torch._dynamo.reset()
        replays = {}
        for name, cache_dtype in (("bf16", None), ("fp8", FP8)):
            step = qwen3_draft_step(LAYERS, preset=preset, max_len=seq_len + 2 * BLOCK, dtype=torch.bfloat16,
                                    device=device, cache_dtype=cache_dtype, cache_scale=0.05)  # fmt: skip
            inputs = draft_step_inputs(step, ctx_tokens=seq_len, block_size=BLOCK)
            module = ContextPart(step)
            step.reset_caches()
            ref = snapshot(step, module(*inputs), seq_len)
            with torch._inductor.config.patch(fx_graph_cache=False):
                fn = torch.compile(module, backend="fx_fusion", dynamic=False)
                step.reset_caches()
                err = rel_error(snapshot(step, fn(*inputs), seq_len), ref)
                tol = 2e-2 if cache_dtype is None else 1e-1
                if not err < tol:
                    raise RuntimeError(f"{name} caches, T={seq_len}: relative error {err:.3g} against eager")
                call = lambda fn=fn, inputs=inputs: fn(*inputs)  # noqa: E731
                replays[name] = capture_graph(call, device) if device.type == "cuda" else call
        times = {"bf16": [], "fp8": []}
        for r in range(rounds):
            for name in ("bf16", "fp8") if r % 2 == 0 else ("fp8", "bf16"):
                times[name].append(timer(replays[name]))
        ratios = sorted(f / b for f, b in zip(times["fp8"], times["bf16"]))
        median = {name: _percentile(sorted(t), 0.5) for name, t in times.items()}
        row = {"T": seq_len, "rounds": rounds, **{f"{n}_us": m for n, m in median.items()},
               "ratio_median": _percentile(ratios, 0.5), "ratio_p10": _percentile(ratios, 0.1),
               "ratio_p90": _percentile(ratios, 0.9), "fp8_faster_rounds": sum(x < 1 for x in ratios), "times_us": times}  # fmt: skip
        log(f"fp8 vs bf16 T={seq_len}: {row['bf16_us']:.1f} / {row['fp8_us']:.1f} us, ratio {row['ratio_median']:.3f} "
            f"[{row['ratio_p10']:.3f}-{row['ratio_p90']:.3f}], fp8 faster in {row['fp8_faster_rounds']}/{rounds}")  # fmt: skip
        rows.append(row)
        del replays
    return rows


def fp8_ab_markdown(rows: list[dict], device_name: str) -> str:
    lines = [f"# fx_fusion's context part: FP8 against bf16 caches on {device_name} (torch {torch.__version__})", "",
             ("CUDA-graphed, L2 emptied by a read before each call" if device_name != "cpu" else "A check of the script: wall-clock, small preset")
             + "; both columns timed in every round, order alternating.", "",
             "| T | bf16 us | FP8 us | FP8 / bf16, median of rounds [p10-p90] | FP8 faster in |", "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['T']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | {r['ratio_median']:.3f} "
                     f"[{r['ratio_p10']:.3f}-{r['ratio_p90']:.3f}] | {r['fp8_faster_rounds']}/{r['rounds']} rounds |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="T = 1, 1024, 8192 only; no frozen column for the step")
    parser.add_argument("--seq-lens", default=None)
    parser.add_argument("--parts", default="context,step", help="context, step or both")
    parser.add_argument("--caches", default="bf16,fp8", help="bf16, fp8 or both")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda", help="cuda (a cpu run only checks the script: small preset)")
    parser.add_argument("--fp8-ab", type=int, default=0, metavar="ROUNDS",
                        help="only compare fx_fusion's context part with FP8 and bf16 caches, in ROUNDS interleaved rounds")
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="only plot these results into --out/bench_draft_step.png")
    args = parser.parse_args(argv)
    if args.plot:
        rows = [row for path in args.plot for row in json.load(open(path))["rows"]]
        print(plot(rows, os.path.join(args.out, "bench_draft_step.png")))
        return 0
    device = torch.device(args.device)
    if args.fp8_ab:
        torch.set_grad_enabled(False)
        rows = fp8_against_bf16([int(t) for t in (args.seq_lens or "1024,8192").split(",")], args.fp8_ab, device)
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_draft_step_fp8_ab.json"), "w") as f:
            json.dump({"meta": {"device": name, "torch": torch.__version__}, "rows": rows}, f, indent=1)
        text = fp8_ab_markdown(rows, name)
        with open(os.path.join(args.out, "bench_draft_step_fp8_ab.md"), "w") as f:
            f.write(text)
        print(text)
        return 0
    preset = "realistic" if device.type == "cuda" else "small"
    seq_lens = [int(t) for t in (args.seq_lens or ("1,1024,8192" if args.quick else "1,16,128,1024,8192")).split(",")]
    timer = Timer(device, warmup=10, rep=100)
    ceilings = measure_ceilings(timer, device)
    log(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    start, rows = time.time(), []
    torch.set_grad_enabled(False)
    for cache_name, cache_dtype in (("bf16", None), ("fp8", FP8)):
        if cache_name not in args.caches.split(","):
            continue
        step = qwen3_draft_step(LAYERS, preset=preset, max_len=max(seq_lens) + 2 * BLOCK, dtype=torch.bfloat16,
                                device=device, cache_dtype=cache_dtype, cache_scale=0.05)  # fmt: skip
        for seq_len in seq_lens:
            inputs = draft_step_inputs(step, ctx_tokens=seq_len, block_size=BLOCK)
            parts = {"context": ContextPart(step), "step": step}
            for part, module in parts.items():
                if part not in args.parts.split(","):
                    continue
                step.reset_caches()
                ref = snapshot(step, module(*inputs), seq_len)
                row = {"cache": cache_name, "part": part, "T": seq_len}
                columns = {"inductor": (module, "inductor", False)}
                if cache_dtype is None and not (args.quick and part == "step"):
                    columns["frozen"] = (module, "inductor", True)
                if cache_dtype is None:
                    hand_fused = SGLangContext(step) if part == "context" else SGLangStep(step)
                    columns["sglang"] = (hand_fused, "inductor", False)
                columns["fx_fusion"] = (module, "fx_fusion", False)
                for name, (mod, backend, freezing) in columns.items():
                    try:
                        row[name] = run_column(timer, step, mod, backend, freezing, inputs, ref, seq_len)
                    except Exception as exc:  # noqa: BLE001  (report what ran)
                        row[name] = {"error": short_error(exc)}
                    log(f"{cache_name} {part:<7} T={seq_len:<5} {name:<9} {row[name]}")
                if part == "context":
                    row["floor"] = floor_us(step, seq_len, ceilings)
                rows.append(row)
        del step
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__, "ceilings": ceilings,
            "elapsed_s": time.time() - start}  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_draft_step.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    text = markdown(rows, meta)
    with open(os.path.join(args.out, "bench_draft_step.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def _cell(cell: dict | None, key: str) -> str:
    if not cell:
        return "-"
    if "error" in cell:
        return "error"
    value = cell.get(key)
    text = f"{value:.1f}" if value is not None else "-"
    return text + (" FAIL" if cell.get("err", 0) >= cell.get("tol", 2e-2) else "")


def markdown(rows: list[dict], meta: dict) -> str:
    columns = ["inductor", "frozen", "sglang", "fx_fusion"]
    lines = [f"# Draft step on {meta['device']} (torch {meta['torch']}), median us", ""]
    for key, title in (("graph", "CUDA-graphed"), ("plain", "plain (launched from Python)")):
        lines += [f"## {title}", ""]
        lines.append("| cache | part | T | " + " | ".join(columns) + " | floor | fx_fusion / floor | vs inductor | absorbed |")
        lines.append("|---|---|---:|" + "---:|" * (len(columns) + 4))
        for row in rows:
            fx = (row.get("fx_fusion") or {}).get(key)
            ind = (row.get("inductor") or {}).get(key)
            floor = (row.get("floor") or {}).get("us")
            ratio = f"{fx / floor:.2f}x" if fx and floor else "-"
            speedup = f"{ind / fx:.2f}x" if fx and ind else "-"
            absorbed = "yes" if (row.get("fx_fusion") or {}).get("absorbed") else "no"
            cells = [_cell(row.get(c), key) for c in columns]
            floor_text = f"{floor:.1f}" if floor else "-"
            lines.append(f"| {row['cache']} | {row['part']} | {row['T']} | " + " | ".join(cells)
                         + f" | {floor_text} | {ratio} | {speedup} | {absorbed} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> str:
    """Time per call against T, log-log, one panel per (cache, part): solid CUDA-graphed, dashed plain,
    black the floor (context). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["cache"], r["part"]) for r in rows}, key=lambda p: (p[1], p[0]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    colors = {"inductor": "tab:blue", "frozen": "tab:orange", "sglang": "tab:green", "fx_fusion": "tab:red"}
    for ax, (cache, part) in zip(axes[0], panels):
        mine = sorted((r for r in rows if (r["cache"], r["part"]) == (cache, part)), key=lambda r: r["T"])
        for column, color in colors.items():
            for key, style in (("graph", "-"), ("plain", "--")):
                points = [(r["T"], r[column][key]) for r in mine if key in r.get(column, {})]
                if points:
                    label = column + ("" if key == "graph" else ", no graph")
                    ax.plot(*zip(*points), style, color=color, marker="o", label=label)
        floor = [(r["T"], r["floor"]["us"]) for r in mine if "floor" in r]
        if floor:
            ax.plot(*zip(*floor), "k-", label="floor")
        ax.set(xscale="log", yscale="log", xlabel="context tokens T", ylabel="us per call", title=f"{part}, {cache} caches")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    sys.exit(main())
