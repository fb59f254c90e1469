"""Registers and local stack of the grouped GEMM's K-epilogue launch, compiled offline for sm_90 (no GPU needed).

    python benchmarks/kernel_registers.py [--tokens 1,16,32] [--configs 128:4:4,64:8:6,0:0:0:1] [--layers 5]

For a draft of --layers layers (8 KV heads x 128 over hidden 4096, bf16, each layer's K and V weights, as
the pass groups them), every variant of the launch the pass can emit: K norm or none, RoPE's cos/sin read
from per-token tables or computed in the kernel (one head-wide row per token, or a tile of frequencies).
The launch's real arguments come from `launch_grouped_gemv` itself (CPU tensors, the interpreter's entry
point intercepted; its configuration the heuristic's on a Hopper GPU, or each of --configs,
BLOCK_K:num_warps:num_stages[:swap_ab], 0 or no swap_ab keeping the heuristic's value). The kernel is
compiled for sm_90 by Triton's compiler, specialised as its JIT specialises a real launch, and cuobjdump
reads the cubin's resource usage: REG, registers per thread (255 the most), and STACK, bytes of stack per
thread (spilled registers, plus 32 for the trig functions' slow path with the angles in the kernel).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile
import unittest.mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import native_specialize_impl

from fx_fusion.kernels import grouped_gemv
from fx_fusion.kernels.grouped_gemv import KEpilogue, RotaryAngles, launch_grouped_gemv

HIDDEN, HEADS, HEAD_DIM = 4096, 8, 128
SM_90 = GPUTarget("cuda", 90, 32)


class _Recorder:
    """Stands in for the interpreted kernel: records the launch's arguments instead of running it."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append((args, meta))


@contextlib.contextmanager
def recorded_launches():
    recorder = _Recorder()
    saved = grouped_gemv.grouped_gemv_kernel_interpreted
    grouped_gemv.grouped_gemv_kernel_interpreted = recorder
    try:
        yield recorder.calls
    finally:
        grouped_gemv.grouped_gemv_kernel_interpreted = saved


def hopper_device():
    """grouped_gemv's device queries answering as an H100 / H200 (132 SMs, sm_90) without a GPU."""
    return unittest.mock.patch.multiple(grouped_gemv, _sm_count=lambda index: 132, _capability=lambda index: (9, 0))


def launch_arguments(
    tokens: int, layers: int, norm: bool, rope: str, block_k: int, warps: int, stages: int, swap_ab: bool | None = None
):
    """(args, meta) of the CUDA launch for one variant; rope is "tables", "row" or "tile". The launch
    heuristic's configuration on a Hopper GPU, where block_k / warps / stages are 0 and swap_ab None."""
    bf16 = torch.bfloat16
    x = torch.empty(tokens, HIDDEN, dtype=bf16)
    weights = [torch.empty(HEADS * HEAD_DIM, HIDDEN, dtype=bf16) for _ in range(2 * layers)]
    out = torch.empty(tokens, 2 * layers * HEADS * HEAD_DIM, dtype=bf16)
    k_out = torch.empty(layers, tokens, HEADS, HEAD_DIM, dtype=bf16)
    norms = [torch.empty(HEAD_DIM, dtype=bf16) for _ in range(layers)] if norm else []
    cos = sin = torch.empty(tokens, HEAD_DIM, dtype=bf16)
    angles = None
    if rope != "tables":
        angles = RotaryAngles(torch.empty(HEAD_DIM // 2), torch.zeros(tokens, dtype=torch.int64), 1.0, True)
    epilogue = KEpilogue(
        k_out, 0, HEADS * HEAD_DIM, HEAD_DIM, norms, None, 1e-6, cos, sin, None, HEAD_DIM, False, 0.0, False, True, angles
    )  # the weights [K_0 .. K_{L-1}, V_0 .. V_{L-1}]: K heads of layer l at columns l * 1024 + h * 128
    with hopper_device():
        config = grouped_gemv.epilogue_launch_config(
            tokens, HEADS * HEAD_DIM, HIDDEN, 2 * layers, HEAD_DIM, bf16, torch.device("cuda", 0)
        )
    swap_ab = config.get("SWAP_AB", False) if swap_ab is None else swap_ab
    with recorded_launches() as calls:
        launch_grouped_gemv(
            x, weights, [], out, k_epilogue=epilogue, block_k=block_k or config["BLOCK_K"], split_k=config["SPLIT_K"],
            num_warps=warps or config["num_warps"], num_stages=stages or config.get("num_stages"), swap_ab=swap_ab,
        )  # fmt: skip
    ((args, meta),) = calls
    # as on CUDA: 16-bit tiles straight into tl.dot; without stages (split launches), Triton's default 3
    meta = dict(meta, DOT_IN_FLOAT32=False, INPUT_PRECISION="tf32", num_stages=meta.get("num_stages") or 3)
    if rope == "row":
        meta["ANGLE_TILE"] = False
    elif rope == "tile":
        meta["ANGLE_TILE"] = True
    return args, meta


def compile_sm90(args: tuple, meta: dict):
    """The kernel compiled for sm_90 with these arguments, specialised as Triton's JIT specialises a launch
    (None and integers equal to 1 become constants; 16-byte aligned pointers and integers divisible by 16
    are marked so, which is what lets loads vectorise and the K loop pipeline)."""
    fn = grouped_gemv.grouped_gemv_kernel
    names = [name for name, param in zip(fn.arg_names, fn.params) if not param.is_constexpr]
    signature, constexprs, attrs = {}, {}, {}
    for name, value in zip(names, args):
        kind, attr = native_specialize_impl(CUDABackend, value, False, True, True)
        signature[name] = kind
        index = (fn.arg_names.index(name),)
        if kind == "constexpr":
            constexprs[index] = attr
        elif isinstance(attr, str):
            attrs[index] = CUDABackend.parse_attr(attr)
    meta = dict(meta)
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
    for name, value in meta.items():
        signature[name] = "constexpr"
        constexprs[(fn.arg_names.index(name),)] = value
    source = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=SM_90, options=options)


def resource_usage(compiled) -> str:
    """cuobjdump's REG / STACK of the compiled kernel."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+)\s+STACK:(\d+)", report)
    return f"REG {found.group(1):>3}  STACK {found.group(2):>3}" if found else report.strip()[-120:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,32")
    parser.add_argument(
        "--configs",
        default="0:0:0",
        help="BLOCK_K:num_warps:num_stages[:swap_ab], comma-separated; 0 (or no swap_ab): the heuristic's on Hopper",
    )
    parser.add_argument("--layers", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{'tokens':>6} {'BLOCK_K:warps:stages:swap':>25} {'K norm':>6} {'cos/sin':>7}  usage")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for config in args.configs.split(","):
            block_k, warps, stages, *swap = (int(v) for v in config.split(":"))
            swap_ab = bool(swap[0]) if swap else None
            for norm in (True, False):
                for rope in ("tables", "row", "tile"):
                    launch_args, meta = launch_arguments(tokens, args.layers, norm, rope, block_k, warps, stages, swap_ab)
                    usage = resource_usage(compile_sm90(launch_args, meta))
                    label = f"{meta['BLOCK_K']}:{meta['num_warps']}:{meta['num_stages']}:{int(meta['SWAP_AB'])}"
                    print(f"{tokens:>6} {label:>25} {'yes' if norm else 'no':>6} {rope:>7}  {usage}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
