"""Grouped GEMM for a few hundred to a thousand tokens: several linears over one input, one persistent launch
whose tiles move through the Hopper tensor memory accelerator (TMA), no weight copies.

    x:    [N, K]             16-bit, K contiguous
    W_i:  [R, K]             i = 0 .. G-1; one shape, dtype and strides, K contiguous, each where it lives
    b_i:  [R]                optional: all or none, same dtype and stride
    out:  [N, G * R]         K-contiguous rows (e.g. a column slice of a wider buffer), allocated by the caller

    out[n, i * R + r] = sum_k x[n, k] * W_i[r, k]  (+ b_i[r]), float32 accumulation, one rounding to out's dtype

When it is used: past the token count where `grouped_gemv` (tiles of 16-64 tokens) stops paying, up to where
one cuBLAS GEMM per weight is as fast (`token_range`). There each per-weight GEMM is too small to fill the
GPU (10 weights [1024, 4096] at 1024 tokens: ten GEMMs of 64 tiles of 128 x 128 on 132 SMs), while this
launch schedules the tiles of every weight over all SMs.

Each program walks tiles (tile, tile + programs, ...). A tile is BLOCK_M tokens x BLOCK_N rows of one weight
(GROUP_M token blocks side by side, so the weight tiles they share stay in L2). Per tile it builds TMA
descriptors on the device for that weight and for the weight's column range of out (a weight is picked
among the pointer arguments with `tl.where`, as in `grouped_gemv`), so loads past N, R or K read zeros and
stores past N or R are dropped by the hardware: no masks, and no tile writes into another weight's columns.
Device-side descriptors need a global scratch buffer per program, which Triton's launcher asks of the
allocator set with `triton.set_allocator` (`ensure_allocator`; Inductor's launcher sets its own).

Requirements of TMA (checked by `unsupported_reason`): a CUDA device of compute capability 9.0 or newer,
16-bit dtypes, 16-byte aligned base addresses and row strides, rows of out per weight 16-byte multiples.
CPU tensors run through Triton's interpreter (tests only; admitted only when TRITON_INTERPRET=1 at call time).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from triton.runtime.interpreter import InterpretedFunction

from .grouped_gemv import (
    MANY_WEIGHTS,
    MAX_TOKENS,
    MAX_TOKENS_MANY_WEIGHTS,
    MAX_WEIGHTS_PER_LAUNCH,
    _interpretable_helpers,
    cuda_device_index,
    sm_count,
    uniform_weights_reason,
)
from .launch_math import ceil_div

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
TMA_ALIGNMENT = 16  # bytes: base addresses and row strides of TMA tensors
MAX_TOKENS_TMA = 1024  # above this one cuBLAS GEMM per weight is as fast (measured on an H200)
MIN_INTERPRETER_VERSION = (3, 9)  # Triton 3.6's interpreter fails on the kernel's per-program tile loop
MIN_TOKENS_FEW_WEIGHTS = 640  # below this (and past grouped_gemv) a GEMM per weight wins for < MANY_WEIGHTS


def _grouped_gemm_tma_kernel(
    x_ptr,
    out_ptr,
    w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15,
    b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15,
    N,
    K,
    R,
    token_tiles,
    row_tiles,
    steps,
    stride_xn,
    stride_wr,
    stride_b,
    stride_on,
    NUM_WEIGHTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,
    DOT_IN_FLOAT32: tl.constexpr,
):  # fmt: skip
    """One program: the tiles program_id, program_id + PROGRAMS, ... of out, each [BLOCK_M, BLOCK_N] of one
    weight (token blocks in groups of GROUP_M, column tiles weight by weight). Computed on the host:
    token_tiles = cdiv(N, BLOCK_M), row_tiles = cdiv(R, BLOCK_N), steps = cdiv(all tiles, PROGRAMS)."""
    column_tiles = NUM_WEIGHTS * row_tiles
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[N, K], strides=[stride_xn, 1], block_shape=[BLOCK_M, BLOCK_K])
    ws = (w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15)
    bs = (b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15)
    tiles = token_tiles * column_tiles
    for step in range(0, steps):  # steps = cdiv(tiles, PROGRAMS); a plain count: the interpreter's too
        tile = tl.program_id(0) + step * PROGRAMS
        if tile < tiles:
            per_group = GROUP_M * column_tiles
            first_m = (tile // per_group) * GROUP_M
            group_m = tl.minimum(token_tiles - first_m, GROUP_M)
            pid_m = first_m + (tile % per_group) % group_m
            pid_n = (tile % per_group) // group_m
            idx = pid_n // row_tiles  # which weight
            row_start = (pid_n % row_tiles) * BLOCK_N
            w_ptr = w0
            b_ptr = b0
            for i in tl.static_range(1, NUM_WEIGHTS):
                w_ptr = tl.where(idx == i, ws[i], w_ptr)
                if HAS_BIAS:
                    b_ptr = tl.where(idx == i, bs[i], b_ptr)
            w_desc = tl.make_tensor_descriptor(
                w_ptr, shape=[R, K], strides=[stride_wr, 1], block_shape=[BLOCK_N, BLOCK_K]
            )
            out_desc = tl.make_tensor_descriptor(
                out_ptr + idx * R, shape=[N, R], strides=[stride_on, 1], block_shape=[BLOCK_M, BLOCK_N]
            )
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                a = x_desc.load([pid_m * BLOCK_M, k])
                w = w_desc.load([row_start, k])
                if DOT_IN_FLOAT32:  # exact products of 16-bit values, float32 sums: the same math
                    acc = tl.dot(a.to(tl.float32), w.T.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, w.T, acc)
            if HAS_BIAS:
                rows = row_start + tl.arange(0, BLOCK_N)
                bias = tl.load(b_ptr + rows.to(tl.int64) * stride_b, mask=rows < R, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            out_desc.store([pid_m * BLOCK_M, row_start], acc.to(out_desc.dtype))


grouped_gemm_tma_kernel = triton.jit(_grouped_gemm_tma_kernel)
grouped_gemm_tma_kernel_interpreted = InterpretedFunction(_grouped_gemm_tma_kernel)


def token_range(gemms: int) -> tuple[int, int]:
    """(lo, hi]: the token counts this kernel serves for `gemms` linears of one shape. On an H200 with
    [1024, 4096] bf16 weights (benchmarks/RESULTS.md), against one cuBLAS GEMM per weight: 10 weights
    49.7 / 83.2 / 91.8 / 128.8 us at 384 / 512 / 768 / 1024 tokens against 98 / 105 / 169 / 155-162,
    level at 2048 (234.6 against 236.0) and slower at 8192; 6 weights 46.1 / 75.6 / 77.8 against 63 / 101 /
    94 at 384 / 768 / 1024, slower at 1536; 2 weights 25.7 / 26.9 against 34.8 / 32.6 at 768 / 1024, but
    25.1 / 25.4 against 19.6 / 22.5 at 384 / 512 tokens."""
    if gemms >= MANY_WEIGHTS:
        return MAX_TOKENS_MANY_WEIGHTS, MAX_TOKENS_TMA
    return max(MAX_TOKENS, MIN_TOKENS_FEW_WEIGHTS), MAX_TOKENS_TMA


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)  # real data, read by address


def _aligned(t: torch.Tensor) -> bool:
    """Whether t's first element sits on a TMA_ALIGNMENT boundary. Tensors without data (fake, functional or
    meta tensors while tracing): by their storage offset, storages being allocated aligned."""
    if type(t) in _PLAIN_TENSOR_TYPES and not t.is_meta:  # real data: its address (fast, per call)
        return t.data_ptr() % TMA_ALIGNMENT == 0
    offset = t.storage_offset()
    if not isinstance(offset, int) or offset * t.element_size() % TMA_ALIGNMENT:
        return False
    if is_fake(t) or t.device.type == "meta":
        return True
    try:
        return t.data_ptr() % TMA_ALIGNMENT == 0
    except (RuntimeError, NotImplementedError):  # no data to point at (a functional wrapper)
        return True


def _tma_rows(t: torch.Tensor) -> bool:
    """Rows of a 2-D tensor TMA can address: unit stride along the last axis, an aligned row stride."""
    row_stride, column_stride = t.stride()
    return column_stride == 1 and row_stride * t.element_size() % TMA_ALIGNMENT == 0


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def unsupported_reason(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    out: torch.Tensor,
    gemms: int | None = None,
) -> str | None:
    """None when `launch(x, weights, biases, out)` applies, else why not (one line). `gemms`: how many
    GEMMs the launch replaces (default one per weight), which sets the token range (`token_range`).
    Cheapest checks first: an uncaptured op call runs this on every call."""
    if not weights:
        return "no weights"
    w = weights[0]
    if x.dim() != 2 or out.dim() != 2:
        return "x and out must be 2-D"
    n = x.shape[0]
    lo, hi = token_range(len(weights) if gemms is None else gemms)
    if not lo < n <= hi:
        return f"N = {n} tokens outside ({lo}, {hi}], the kernel's range for these weights"
    reason = uniform_weights_reason(weights)
    if reason is not None:
        return reason
    if w.dtype not in SUPPORTED_DTYPES or x.dtype != w.dtype or out.dtype != w.dtype:
        return f"x, weights and out must share one of {SUPPORTED_DTYPES}"
    if x.device != w.device or out.device != w.device or any(b.device != w.device for b in biases):
        return "x, weights, biases and out must be on one device"
    if w.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "CPU tensors need TRITON_INTERPRET=1 (Triton interpreter)"
        if _triton_version() < MIN_INTERPRETER_VERSION:
            return f"Triton {triton.__version__}'s interpreter does not run this kernel (3.6's fails; 3.9's runs it)"
    elif w.device.type != "cuda" or _capability(cuda_device_index(w.device)) < (9, 0):
        return "TMA needs a CUDA device of compute capability 9.0 or newer"
    if not hasattr(tl, "make_tensor_descriptor"):
        return "this Triton has no tl.make_tensor_descriptor"
    rows, k = w.shape
    if rows < 1 or k < 1 or x.shape[1] != k:
        return f"x [{n}, {x.shape[1]}] and weights [{rows}, {k}] do not fit"
    if tuple(out.shape) != (n, len(weights) * rows):
        return f"out is {tuple(out.shape)}, expected {(n, len(weights) * rows)}"
    rows_fit = _tma_rows(x) and _tma_rows(out) and _tma_rows(w) and rows * w.element_size() % TMA_ALIGNMENT == 0
    if not rows_fit or not all(_aligned(t) for t in (x, out, *weights)):  # weights share w's strides
        return "x, weights or out not laid out for TMA (unit last stride, 16-byte aligned rows and bases)"
    if biases:
        if len(biases) != len(weights) or any(b.shape != (rows,) or b.dtype != w.dtype for b in biases):
            return "biases must be one [R] tensor of the weights' dtype per weight"
        if len({b.stride() for b in biases}) > 1:
            return "biases differ in stride"
    return None


def launch_config(n: int, rows: int, n_weights: int, device: torch.device) -> dict[str, int]:
    """Tiles of 128 tokens x 128 or 256 rows, K step 64, 8 warps, over at most one program per SM. Of the
    two tile widths the one with fewer waves of tiles (a 256-wide tile counting as two 128-wide ones):
    10 weights at 384 / 768 / 1536 tokens 128 x 256 with 3 stages (49.7 / 91.8 / 181.6 us), at 512 / 1024
    128 x 128 with 4-5 stages (83.2 / 128.8 us; the other width 93.9 / 139.3). CPU: small tiles, so that
    small tests reach every tail."""
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2, "PROGRAMS": 3}
    sms = sm_count(device)
    token_tiles = ceil_div(n, 128)
    waves = lambda width: ceil_div(token_tiles * n_weights * ceil_div(rows, width), sms)  # noqa: E731
    block_n, stages = (128, 5) if waves(128) < 2 * waves(256) else (256, 3)
    tiles = token_tiles * n_weights * ceil_div(rows, block_n)
    return {
        "BLOCK_M": 128, "BLOCK_N": block_n, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": stages,
        "PROGRAMS": min(tiles, sms),
    }  # fmt: skip


def ensure_allocator() -> None:
    """Give Triton an allocator for the kernel's descriptor scratch (torch's caching allocator, so graph
    capture works) unless one is set in this thread already (Inductor's launcher sets its own). Triton
    keeps the allocator in a private context variable: this is the one place that reads it."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.empty(size, dtype=torch.int8, device=device)


def launch(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    out: torch.Tensor,
    *,
    traceable: bool = False,
    **overrides: int,
) -> None:
    """out[:, i*R:(i+1)*R] = x @ weights[i].T (+ biases[i]) for every i, one launch per 16 weights. Call
    `unsupported_reason` first (not re-checked here). `overrides` replace `launch_config`'s entries
    (tuning only). `traceable` launches through `torch.library.wrap_triton` (Inductor launches it)."""
    n, k = x.shape
    rows = weights[0].shape[0]
    if n == 0:
        return
    interpret = x.device.type != "cuda"
    if not interpret:
        ensure_allocator()
    for start in range(0, len(weights), MAX_WEIGHTS_PER_LAUNCH):
        chunk_w = list(weights[start : start + MAX_WEIGHTS_PER_LAUNCH])
        chunk_b = list(biases[start : start + MAX_WEIGHTS_PER_LAUNCH]) if biases else []
        g = len(chunk_w)
        chunk_out = out if g == len(weights) else out[:, start * rows : (start + g) * rows]
        config = launch_config(n, rows, g, x.device)
        config.update(overrides)
        token_tiles, row_tiles = ceil_div(n, config["BLOCK_M"]), ceil_div(rows, config["BLOCK_N"])
        pad = [None] * (MAX_WEIGHTS_PER_LAUNCH - g)
        args = (
            x, chunk_out, *chunk_w, *pad, *(chunk_b + pad if chunk_b else [None] * MAX_WEIGHTS_PER_LAUNCH),
            n, k, rows, token_tiles, row_tiles, ceil_div(token_tiles * g * row_tiles, config["PROGRAMS"]), x.stride(0), chunk_w[0].stride(0), chunk_b[0].stride(0) if chunk_b else 0, chunk_out.stride(0),
        )  # fmt: skip
        grid = (config["PROGRAMS"],)
        # The interpreter's tl.dot multiplies bfloat16's raw storage: there, tiles are widened to float32 first.
        meta = dict(NUM_WEIGHTS=g, HAS_BIAS=bool(chunk_b), DOT_IN_FLOAT32=interpret and x.dtype == torch.bfloat16, **config)
        if interpret:
            with _interpretable_helpers():  # tl.zeros
                grouped_gemm_tma_kernel_interpreted[grid](*args, **meta)
        elif traceable:
            torch.library.wrap_triton(grouped_gemm_tma_kernel)[grid](*args, **meta)
        elif x.device.index == torch.cuda.current_device():
            grouped_gemm_tma_kernel[grid](*args, **meta)
        else:  # Triton launches on the current device
            with torch.cuda.device(x.device):
                grouped_gemm_tma_kernel[grid](*args, **meta)
