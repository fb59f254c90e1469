"""GPU benchmark of the stacked K/V materialization op against plain PyTorch, with the copy ceiling.

    python benchmarks/bench_op.py [--tokens 1,16,128,1024,8192,32768] [--configs 16x4,32x4,64x8] [--out DIR]

Shapes (the ANCHORS draft): 5 layers, 8 KV heads x 128, bf16, K norm on (per-layer eps tensor), neox full
rotary from an fp32 cos_sin_cache + int64 positions. Columns (triton.testing.do_bench, median, which
flushes L2 before every call; inputs are also rotated through enough copies to exceed L2):

    op            fused_norm_rope_stacked(..., check_positions=False): K and V, eager call
    op_graph      the same call captured in a CUDA graph (kernel time without Python overhead)
    k_only        torch.ops.fx_fusion.materialize_k (bytes: read K + write K)
    eager         the same math as plain PyTorch, one layer at a time
    compiled      torch.compile(eager math), default mode, static shapes
    BxW           the kernel launched directly with BLOCK_ROWS=B, num_warps=W (tuning)

bytes = read kv + write K and V (k_only: read K + write K). The copy ceiling is a device-to-device copy of
a 2 GiB tensor (bytes read + written), measured in the same run; "%" is achieved / ceiling. Every
variant is checked against the eager math before timing. Writes bench_op.json and bench_op.md to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
import triton.testing

from fx_fusion.kernels.fused_kv_materialize import default_launch_config, launch_fused_kv_materialize
from fx_fusion.kernels.ops import fused_norm_rope_stacked

N_LAYERS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 5, 8, 128, torch.bfloat16
MAX_POS = 40960
L2_BYTES = 60 * 2**20


def copy_ceiling_bytes_per_s() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) of a 2 GiB tensor."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / (ms * 1e-3)


def make_shared_inputs() -> dict:
    """K-norm weight [L, D], eps [L] and an fp32 cos_sin_cache [MAX_POS, D], shared by every input set."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    angles = torch.randn(MAX_POS, HEAD_DIM // 2, device="cuda", generator=gen)
    return dict(
        k_norm_weight=(1 + 0.1 * torch.randn(N_LAYERS, HEAD_DIM, device="cuda", generator=gen)).to(DTYPE),
        eps=torch.full((N_LAYERS,), 1e-6, device="cuda"),
        cos_sin_cache=torch.cat([angles.cos(), angles.sin()], dim=-1),
    )


def make_inputs(total_ctx: int, seed: int, shared: dict) -> dict:
    """kv [T, L, 2*kv_size] and positions [T] (fresh per set) plus the shared tensors."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv_size = NUM_KV_HEADS * HEAD_DIM
    return dict(
        kv=torch.randn(total_ctx, N_LAYERS, 2 * kv_size, device="cuda", generator=gen).to(DTYPE),
        positions=torch.randint(0, MAX_POS, (total_ctx,), device="cuda", generator=gen),
        **shared,
    )


def eager_math(kv, k_norm_weight, eps, cos_sin_cache, positions):
    """The op's math in plain PyTorch, one layer at a time: (k_out, v_out) [L, T, H, D]."""
    total_ctx, n_layers, _ = kv.shape
    kv_size, half = NUM_KV_HEADS * HEAD_DIM, HEAD_DIM // 2
    cos_sin = cos_sin_cache[positions]
    cos = torch.cat([cos_sin[:, :half], cos_sin[:, :half]], dim=-1)[:, None, :]
    sin = torch.cat([cos_sin[:, half:], cos_sin[:, half:]], dim=-1)[:, None, :]
    k_out = kv.new_empty(n_layers, total_ctx, NUM_KV_HEADS, HEAD_DIM)
    v_out = kv.new_empty(n_layers, total_ctx, NUM_KV_HEADS, HEAD_DIM)
    for layer in range(n_layers):
        k = kv[:, layer, :kv_size].reshape(total_ctx, NUM_KV_HEADS, HEAD_DIM).float()
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps[layer])
        k = (k_norm_weight[layer] * k.to(kv.dtype)).float()
        rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
        k_out[layer] = (k * cos + rotated * sin).to(kv.dtype)
        v_out[layer] = kv[:, layer, kv_size:].reshape(total_ctx, NUM_KV_HEADS, HEAD_DIM)
    return k_out, v_out


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()


def check(name: str, outputs, expected) -> None:
    for actual, ref in zip(outputs, expected):
        err = rel_err(actual, ref)
        if not (err < 1e-2 and torch.isfinite(actual).all()):
            raise AssertionError(f"{name}: relative error {err:.3g} against the eager math")


def input_sets(total_ctx: int, shared: dict) -> list[dict]:
    """Enough independent kv copies that cycling through them touches more than 4x L2 (kv + outputs)."""
    per_set = 2 * total_ctx * N_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    count = max(1, min(64, -(-4 * L2_BYTES // per_set)))
    return [make_inputs(total_ctx, seed, shared) for seed in range(count)]


def rotating(call, sets):
    """A zero-argument function that runs `call(**inputs)` on the next input set each time."""
    cycle = itertools.cycle(sets)
    return lambda: call(**next(cycle))


def bench_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, return_mode="median")


def graph_ms(fn) -> float:
    """Median time of `fn` replayed from a CUDA graph (static inputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, return_mode="median")


def direct_launch(block_rows: int, num_warps: int):
    def call(kv, k_norm_weight, eps, cos_sin_cache, positions):
        kv_size = NUM_KV_HEADS * HEAD_DIM
        total_ctx = kv.shape[0]
        k_out = kv.new_empty(N_LAYERS, total_ctx, NUM_KV_HEADS, HEAD_DIM)
        v_out = torch.empty_like(k_out)
        launch_fused_kv_materialize(
            kv[..., :kv_size], kv[..., kv_size:], k_norm_weight, eps, 0.0, cos_sin_cache, None, positions,
            k_out, v_out, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM, False, 0.0, False, True, block_rows=block_rows,
            num_warps=num_warps,
        )
        return k_out, v_out

    return call


def op_call(kv, k_norm_weight, eps, cos_sin_cache, positions):
    return fused_norm_rope_stacked(
        kv, k_norm_weight, eps, cos_sin_cache, positions, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM, check_positions=False
    )


def k_only_call(kv, k_norm_weight, eps, cos_sin_cache, positions):
    k_proj = kv[..., : NUM_KV_HEADS * HEAD_DIM]
    return torch.ops.fx_fusion.materialize_k(
        k_proj, [k_norm_weight], eps, 0.0, cos_sin_cache, None, positions, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM, False,
        0.0, False, True,
    )


def bench_tokens(total_ctx: int, configs: list[tuple[int, int]], ceiling: float, compiled_math, shared: dict) -> dict:
    sets = input_sets(total_ctx, shared)
    first = sets[0]
    expected = eager_math(**first)
    kv_bytes = total_ctx * N_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    kv_moved, k_moved = 2 * kv_bytes, kv_bytes  # read + write
    row = {"total_ctx": total_ctx, "rows": total_ctx * N_LAYERS, "bytes": kv_moved, "sets": len(sets)}
    row["default_config"] = "{}x{}".format(*default_launch_config(total_ctx * NUM_KV_HEADS, HEAD_DIM))

    variants = {
        "op": (op_call, kv_moved),
        "eager": (eager_math, kv_moved),
        "compiled": (compiled_math, kv_moved),
        **{f"{b}x{w}": (direct_launch(b, w), kv_moved) for b, w in configs},
    }
    def record(name: str, ms: float, moved: int) -> None:
        bytes_per_s = moved / (ms * 1e-3)
        row[name] = {"us": ms * 1e3, "tb_s": bytes_per_s / 1e12, "pct": 100 * bytes_per_s / ceiling}

    for name, (call, moved) in variants.items():
        check(name, call(**first), expected)
        record(name, bench_ms(rotating(call, sets)), moved)
    record("op_graph", graph_ms(lambda: op_call(**first)), kv_moved)
    check("k_only", (k_only_call(**first),), expected[:1])
    record("k_only", bench_ms(rotating(k_only_call, sets)), k_moved)
    return row


def markdown(rows: list[dict], ceiling: float, configs: list[tuple[int, int]]) -> str:
    names = ["op", "op_graph", "k_only", "eager", "compiled", *[f"{b}x{w}" for b, w in configs]]
    lines = [
        f"Copy ceiling: {ceiling / 1e12:.2f} TB/s (bytes read + written). "
        f"{N_LAYERS} layers, {NUM_KV_HEADS} KV heads x {HEAD_DIM}, {str(DTYPE).removeprefix('torch.')}, "
        "K norm, neox full rotary, cache + positions. Cells: us / TB/s / % of ceiling.",
        "",
        "| T | rows T*L | MB moved | default BxW | " + " | ".join(names) + " |",
        "|" + "---|" * (4 + len(names)),
    ]
    for row in rows:
        cells = [f"{row[n]['us']:.1f} / {row[n]['tb_s']:.2f} / {row[n]['pct']:.0f}%" for n in names]
        lines.append(
            f"| {row['total_ctx']} | {row['rows']} | {row['bytes'] / 1e6:.1f} | {row['default_config']} | "
            + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,128,1024,8192,32768")
    parser.add_argument("--configs", default="16x4,32x4,64x8", help="BLOCK_ROWSxnum_warps launch overrides")
    parser.add_argument("--out", default=".", help="directory for bench_op.json and bench_op.md")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",") if c]

    torch.manual_seed(0)
    ceiling = copy_ceiling_bytes_per_s()
    compiled_math = torch.compile(eager_math, dynamic=False)
    shared = make_shared_inputs()
    rows = []
    with torch.no_grad():
        for total_ctx in tokens:
            rows.append(bench_tokens(total_ctx, configs, ceiling, compiled_math, shared))
            print(f"T={total_ctx}: op {rows[-1]['op']['us']:.1f} us ({rows[-1]['op']['pct']:.0f}% of copy)", flush=True)
    table = markdown(rows, ceiling, configs)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    with open(os.path.join(args.out, "bench_op.json"), "w") as f:
        json.dump({**meta, "copy_ceiling_bytes_per_s": ceiling, "rows": rows}, f, indent=2)
    with open(os.path.join(args.out, "bench_op.md"), "w") as f:
        f.write(table)


if __name__ == "__main__":
    main()
