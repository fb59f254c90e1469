"""GPU benchmark of the draft context K/V under tensor parallelism (plain local head shards, NCCL).

    torchrun --nproc-per-node 2 benchmarks/bench_tensor_parallel.py --out DIR [--seq-lens 1,16,128,1024,8192]

Workload: "qwen3-8b-dflash" (fx_fusion.drafts.WORKLOADS: 5 Qwen3 layers, hidden 4096, 8 KV heads x 128,
k_norm), bf16, batch 1. Every rank builds the full draft (same seed, so the same weights on every rank) and
its own shard: a draft built with 8 / world_size KV heads whose K/V projection rows are the full draft's
rows for heads [r * 8 / world, (r + 1) * 8 / world) (contiguous blocks, as ColwiseParallel would cut them).
All ranks get the same replicated hidden states.

For each T, compiled afresh (torch._dynamo.reset(), dynamic=False) with backend="fx_fusion" (column fxf) and
with torch.compile's default Inductor (column inductor), each warmed up, captured in a CUDA graph
(bench_module.capture_graph) and timed as the median graph replay (bench_module.Timer: triton do_bench,
return_mode="median"):

    tp      every rank times its shard at the same time (after a barrier; nothing is communicated inside
            the timed region); the cell is the slowest rank, the JSON has each rank
    single  rank 0 alone times the full draft (all 8 heads) on its GPU, while the other ranks wait

Before timing, the outputs are checked against the full draft in eager: the shards' outputs are gathered
(all_gather over heads) and compared on every rank; relative Frobenius error (max over outputs) < 2e-2, or
the cell is marked FAIL. For fxf, what the fx_fusion pass fused on each rank is recorded ("nf": nothing).
A cell that cannot be built or run shows "-" and its error. Writes bench_tensor_parallel.json and
bench_tensor_parallel.md to --out (rewritten after every T). Without torchrun it runs as a world of 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_module, from any working directory

from bench_module import (
    TOLERANCE,
    Timer,
    capture_graph,
    collect_pass_records,
    fx_fusion_backend,
    log,
    rel_error,
    short_error,
)

from fx_fusion import drafts

WORKLOAD = "qwen3-8b-dflash"
DEFAULT_SEQ_LENS = [1, 16, 128, 1024, 8192]
BACKENDS = ["fxf", "inductor"]


def local_shard(full: drafts.ContextKV, start: int, stop: int, workload: str) -> drafts.ContextKV:
    """A draft of `workload` built with KV heads [start, stop) only: its K/V projection rows (and biases)
    and K-norm weights copied from `full`'s."""
    family, preset, n_layers, extra = drafts.WORKLOADS[workload]
    factory = drafts.qwen3_context_kv if family == "qwen3" else drafts.llama_context_kv
    weight = full.layers[0].k_proj.weight
    local = factory(
        n_layers, num_kv_heads=stop - start, dtype=weight.dtype, device=weight.device, preset=preset, **extra
    )
    rows = slice(start * full.head_dim, stop * full.head_dim)
    with torch.no_grad():
        for src, dst in zip(full.layers, local.layers):
            for name in ("k_proj", "v_proj"):
                getattr(dst, name).weight.copy_(getattr(src, name).weight[rows])
                if getattr(src, name).bias is not None:
                    getattr(dst, name).bias.copy_(getattr(src, name).bias[rows])
            if getattr(src, "k_norm", None) is not None:
                dst.k_norm.weight.copy_(src.k_norm.weight)
    return local


def compile_graphed(model, x, pos, backend: str, device: torch.device) -> tuple[Callable[[], Any], dict | None]:
    """`model` compiled afresh with `backend`, warmed up and captured in a CUDA graph: (replay, pass info)."""
    torch._dynamo.reset()
    is_fxf = backend == "fxf"
    compiled = torch.compile(model, backend=fx_fusion_backend() if is_fxf else "inductor", dynamic=False)
    with contextlib.ExitStack() as stack:
        if is_fxf:  # compile for real, so that the pass runs here and reports what it fused
            stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
            stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        records = stack.enter_context(collect_pass_records(is_fxf))
        for _ in range(3):
            compiled(x, pos)
    torch.cuda.synchronize(device)
    info = None
    if is_fxf:
        info = {
            "groups": [(g.n_layers, g.num_kv_heads) for r in records for g in r.fused_groups],
            "rejected": [j.reason for r in records for j in r.rejected],
            "summaries": [r.summary() for r in records],
        }
    return capture_graph(lambda: compiled(x, pos), device), info


def build_cell(model, x, pos, backend: str, device: torch.device) -> tuple[dict, Callable[[], Any] | None, Any]:
    """(cell, replay or None, outputs of one replay or None); a failure is recorded in the cell."""
    cell: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        replay, info = compile_graphed(model, x, pos, backend, device)
        outputs = replay()
        cell["build_s"] = time.perf_counter() - t0
        if info is not None:
            cell["pass"] = info
        return cell, replay, outputs
    except Exception as exc:  # noqa: BLE001  (one cell's failure must not end the run)
        cell["error"] = short_error(exc)
        return cell, None, None


def gather_heads(outputs, like: torch.Tensor, n_outputs: int, world: int) -> list[torch.Tensor]:
    """all_gather each rank's [B, h, T, D] outputs along the heads (zeros from a rank whose cell failed;
    `like` is a tensor of that shape, dtype and device)."""
    gathered = []
    for i in range(n_outputs):
        local = outputs[i].contiguous() if outputs is not None else torch.zeros_like(like)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        gathered.append(torch.cat(parts, dim=1))
    return gathered


def time_cell(cell: dict, replay, timer: Timer) -> None:
    if replay is None:
        return
    try:
        cell["us"] = timer(replay)
    except Exception as exc:  # noqa: BLE001
        cell["error"] = short_error(exc)


def check_cell(cell: dict, outputs, ref) -> None:
    if "error" in cell:
        return
    cell["rel_err"] = rel_error(outputs, ref)
    cell["ok"] = cell["rel_err"] < TOLERANCE


def run_seq_len(args, seq_len: int, full, local, rank: int, world: int, device: torch.device, timer: Timer) -> dict:
    x, pos = drafts.example_inputs(full, seq_len=seq_len)  # the same on every rank (CPU generator)
    ref = full(x, pos)
    like = ref[0].new_empty(1, local.num_kv_heads, seq_len, local.head_dim)
    row: dict[str, Any] = {"tp": {}, "single": {}}
    for backend in args.backends:
        cell, replay, outputs = build_cell(local, x, pos, backend, device)
        check_cell(cell, gather_heads(outputs, like, len(ref), world) if world > 1 else outputs, ref)
        del outputs
        torch.cuda.synchronize(device)
        dist.barrier()  # the ranks time side by side
        time_cell(cell, replay, timer)
        cells: list[Any] = [None] * world
        dist.all_gather_object(cells, cell)
        row["tp"][backend] = cells
        del replay
        gc.collect()
        torch.cuda.empty_cache()
        tag = " ".join(f"r{r}={format_cell(c)}" for r, c in enumerate(cells))
        if rank == 0:
            log(f"[T={seq_len}] tp     {backend:>8}: {tag}")
    dist.barrier()
    if rank == 0 and world > 1 and not args.no_single:
        for backend in args.backends:
            cell, replay, outputs = build_cell(full, x, pos, backend, device)
            check_cell(cell, outputs, ref)
            del outputs
            time_cell(cell, replay, timer)
            row["single"][backend] = cell
            del replay
            gc.collect()
            torch.cuda.empty_cache()
            log(f"[T={seq_len}] single {backend:>8}: {format_cell(cell)}")
    elif world == 1:
        row["single"] = {backend: cells[0] for backend, cells in row["tp"].items()}
    dist.barrier()
    torch._dynamo.reset()
    return row


# ----------------------------------------------------------------------------------------------------------
# Report


def format_cell(cell: dict | None) -> str:
    if not cell:
        return "-"
    if cell.get("us") is None:
        return f"- ({cell['error']})" if cell.get("error") else "-"
    text = f"{cell['us']:.1f}"
    if not cell.get("ok", False):
        text = f"FAIL {text}"
    info = cell.get("pass")
    if info is not None and not info["groups"]:
        text += " nf"
    return text


def slowest(cells: list[dict] | None) -> float | None:
    times = [c.get("us") for c in cells or []]
    return None if not times or any(t is None for t in times) else max(times)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def markdown(results: dict, meta: dict) -> str:
    world = meta["world_size"]
    lines = [
        "# fx-fusion tensor-parallel benchmark: draft context K/V",
        "",
        (
            f"{meta['device_name']} x {world}; torch {meta['torch']}, transformers {meta['transformers']}; "
            f"{meta['workload']}, {meta['dtype']}, batch 1; TP={world}: plain local shards of "
            f"{meta['heads_per_rank']} KV heads per rank (of {meta['num_kv_heads']}); CUDA-graphed replays, "
            f"do_bench median (warmup {meta['warmup']} ms, rep {meta['rep']} ms), us."
        ),
        (
            f"tp: slowest rank (each rank in the JSON); single: rank 0 alone with all {meta['num_kv_heads']} "
            "heads. FAIL: outputs differ from the full eager draft (rel. error >= 2e-2); nf: fx_fusion fused "
            "nothing."
        ),
        "",
    ]
    header = ["T"]
    for backend in meta["backends"]:
        header += [f"tp {backend}"]
    header += ["tp inductor/fxf"] if set(BACKENDS) <= set(meta["backends"]) else []
    for backend in meta["backends"]:
        header += [f"single {backend}"]
    header += ["single inductor/fxf", "single fxf / tp fxf"] if set(BACKENDS) <= set(meta["backends"]) else []
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---:"] * len(header)) + "|")
    for seq_len, row in results.items():
        tp, single = row["tp"], row["single"]
        cells = [seq_len]
        for backend in meta["backends"]:
            worst = slowest(tp.get(backend))
            text = f"{worst:.1f}" if worst is not None else "-"
            if worst is not None and any(not c.get("ok", False) for c in tp.get(backend) or []):
                text = f"FAIL {text}"
            if any(c.get("pass") is not None and not c["pass"]["groups"] for c in tp.get(backend) or []):
                text += " nf"
            cells.append(text)
        if set(BACKENDS) <= set(meta["backends"]):
            cells.append(ratio(slowest(tp.get("inductor")), slowest(tp.get("fxf"))))
        for backend in meta["backends"]:
            cells.append(format_cell(single.get(backend)))
        if set(BACKENDS) <= set(meta["backends"]):
            s_fxf, s_ind = (single.get(b, {}).get("us") for b in ("fxf", "inductor"))
            cells += [ratio(s_ind, s_fxf), ratio(s_fxf, slowest(tp.get("fxf")))]
        lines.append("| " + " | ".join(cells) + " |")
    fused = []
    for seq_len, row in results.items():
        for where, cells in (("tp", row["tp"].get("fxf") or []), ("single", [row["single"].get("fxf") or {}])):
            for r, cell in enumerate(cells):
                info = cell.get("pass")
                if info is not None:
                    groups = ", ".join(f"{n} layers x {h} heads" for n, h in info["groups"]) or "nothing"
                    rejected = f"; rejected: {'; '.join(info['rejected'])}" if info["rejected"] else ""
                    fused.append(f"- T={seq_len} {where} rank {r if where == 'tp' else 0}: fused {groups}{rejected}")
    if fused:
        lines += ["", "What fx_fusion fused:", *fused]
    errors = [
        f"- T={seq_len} {where} {backend} rank {r}: {cell['error']}"
        for seq_len, row in results.items()
        for where in ("tp", "single")
        for backend, cells in row[where].items()
        for r, cell in enumerate(cells if isinstance(cells, list) else [cells])
        if cell.get("error")
    ]
    if errors:
        lines += ["", "Errors:", *errors]
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: str, results: dict, meta: dict) -> str:
    text = markdown(results, meta)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_tensor_parallel.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    with open(os.path.join(out_dir, "bench_tensor_parallel.md"), "w") as f:
        f.write(text)
    return text


# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out", help="folder for bench_tensor_parallel.json / .md")
    parser.add_argument("--seq-lens", default=",".join(map(str, DEFAULT_SEQ_LENS)), help="comma-separated T")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of fxf,inductor")
    parser.add_argument("--workload", default=WORKLOAD, help="a name from fx_fusion.drafts.WORKLOADS")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    parser.add_argument("--no-single", action="store_true", help="skip the single-GPU (all heads) runs")
    parser.add_argument("--timeout-min", type=float, default=60, help="process-group timeout (minutes)")
    parser.add_argument(
        "--dist-backend", default="nccl", choices=["nccl", "gloo"],
        help="gloo (with ranks sharing GPUs, device = LOCAL_RANK %% GPU count) only checks the code paths on "
        "fewer GPUs than ranks; its timings are meaningless",
    )
    args = parser.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    if not set(args.backends) <= set(BACKENDS) or not args.backends:
        parser.error(f"--backends must be a subset of {BACKENDS}")
    seq_lens = [int(t) for t in args.seq_lens.split(",") if t]
    if not torch.cuda.is_available():
        parser.error("needs CUDA GPUs: torchrun --nproc-per-node 2 benchmarks/bench_tensor_parallel.py --out DIR")

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29517")
    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    timeout = datetime.timedelta(minutes=args.timeout_min)
    if args.dist_backend == "nccl":
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    try:
        return run(args, seq_lens, rank, world, device)
    finally:
        dist.destroy_process_group()


def run(args, seq_lens: list[int], rank: int, world: int, device: torch.device) -> int:
    import transformers

    t_start = time.perf_counter()
    full = drafts.build_workload(args.workload, dtype=torch.bfloat16, device=device)
    if full.num_kv_heads % world:
        raise SystemExit(f"{full.num_kv_heads} KV heads do not split evenly over {world} ranks")
    per_rank = full.num_kv_heads // world
    local = local_shard(full, rank * per_rank, (rank + 1) * per_rank, args.workload)
    meta: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "workload": args.workload,
        "dtype": "bfloat16",
        "world_size": world,
        "num_kv_heads": full.num_kv_heads,
        "heads_per_rank": per_rank,
        "n_layers": full.n_layers,
        "hidden_size": full.hidden_size,
        "head_dim": full.head_dim,
        "backends": args.backends,
        "seq_lens": seq_lens,
        "warmup": args.warmup,
        "rep": args.rep,
        "tolerance": TOLERANCE,
    }
    if rank == 0:
        log(f"bench_tensor_parallel: {meta['device_name']} x {world}, torch {meta['torch']}; {args.workload}: "
            f"{full.n_layers} layers, hidden {full.hidden_size}, {full.num_kv_heads} KV heads x {full.head_dim}, "
            f"{per_rank} per rank; T {seq_lens}")
    timer = Timer(device, args.warmup, args.rep)
    results: dict[str, Any] = {}
    with torch.no_grad():
        for seq_len in seq_lens:
            results[str(seq_len)] = run_seq_len(args, seq_len, full, local, rank, world, device, timer)
            meta["elapsed_s"] = time.perf_counter() - t_start
            if rank == 0:
                write_outputs(args.out, results, meta)
                log(f"  elapsed {meta['elapsed_s']:.0f}s")
    if rank == 0:
        text = write_outputs(args.out, results, meta)
        print()
        print(text, flush=True)
        log(f"wrote {args.out}/bench_tensor_parallel.json and .md ({meta['elapsed_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
