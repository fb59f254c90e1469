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

import contextlib
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
    KEpilogue,
    _epilogue_arguments,
    k_epilogue_unsupported_reason,
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


def _k_head_epilogue(
    x, tokens, n_tokens, block, norm_ptr, stride_nd, eps,
    cos_ptr, sin_ptr, positions_ptr, cache_rows, stride_cos_block, stride_cos_row, stride_cos_dim,
    stride_sin_block, stride_sin_row, stride_sin_dim, stride_positions, angle_scale,
    KV_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_NORM: tl.constexpr, USE_POSITIONS: tl.constexpr, ANGLES: tl.constexpr, ROUND_ANGLES: tl.constexpr,
    NORM_WEIGHT_OFFSET: tl.constexpr, NORM_WEIGHT_IN_FLOAT32: tl.constexpr, NORM_ROUND_BEFORE_ROPE: tl.constexpr,
):  # fmt: skip
    """K norm + RoPE of one head tile x [BLOCK_T, HEAD_DIM] (float32 holding the projection as rounded to
    KV_DTYPE), RoPE over the whole head; returns the tile in float32. The math and roundings of
    `grouped_gemv`'s epilogue (and of the materialization kernel), computed on the head's two halves of pairs:
    `first` holds dim a and `second` dim b of pair j (rotate-half: a = j, b = j + HEAD_DIM / 2; interleaved:
    a = 2j, b = 2j + 1), so each dim's rotation partner is in registers and pair j's cos / sin are
    one [BLOCK_T, HEAD_DIM / 2] tile. cos / sin: computed from inv_freq (cos_ptr) at positions (ANGLES),
    read from a cos/sin cache at positions (USE_POSITIONS: cos of pair j at column j, its sin at
    HEAD_DIM / 2 + j), or per-token tables [tokens, HEAD_DIM] (per block with stride_cos_block)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pairs = tl.arange(0, HALF)
    if INTERLEAVED:
        first_dims = 2 * pairs
        second_dims = first_dims + 1
        first, second = tl.split(tl.reshape(x, (BLOCK_T, HALF, 2)))
    else:
        first_dims = pairs
        second_dims = pairs + HALF
        first, second = tl.split(tl.permute(tl.reshape(x, (BLOCK_T, 2, HALF)), (0, 2, 1)))
    if HAS_NORM:
        inv_rms = tl.rsqrt((tl.sum(first * first, axis=1) + tl.sum(second * second, axis=1)) / HEAD_DIM + eps)[:, None]
        w_first = tl.load(norm_ptr + first_dims * stride_nd).to(tl.float32) + NORM_WEIGHT_OFFSET
        w_second = tl.load(norm_ptr + second_dims * stride_nd).to(tl.float32) + NORM_WEIGHT_OFFSET
        # round(round(x * inv_rms) * w), or once (NORM_WEIGHT_IN_FLOAT32), or not before RoPE.
        normed_dtype: tl.constexpr = tl.float32 if NORM_WEIGHT_IN_FLOAT32 else KV_DTYPE
        weighted_dtype: tl.constexpr = KV_DTYPE if NORM_ROUND_BEFORE_ROPE else tl.float32
        first = ((first * inv_rms).to(normed_dtype).to(tl.float32) * w_first[None, :]).to(weighted_dtype).to(tl.float32)
        second = ((second * inv_rms).to(normed_dtype).to(tl.float32) * w_second[None, :]).to(weighted_dtype).to(tl.float32)
    tok_mask = (tokens < n_tokens)[:, None]
    if ANGLES:
        positions = tl.load(positions_ptr + tokens.to(tl.int64) * stride_positions, mask=tokens < n_tokens, other=0)
        inv_freq = tl.load(cos_ptr + pairs * stride_cos_dim).to(tl.float32)
        angle = positions.to(tl.float32)[:, None] * inv_freq[None, :]
        cos_first = tl.cos(angle) * angle_scale
        sin_first = tl.sin(angle) * angle_scale
        if ROUND_ANGLES:
            cos_first = cos_first.to(KV_DTYPE).to(tl.float32)
            sin_first = sin_first.to(KV_DTYPE).to(tl.float32)
        cos_second = cos_first
        sin_second = sin_first
    elif USE_POSITIONS:
        positions = tl.load(positions_ptr + tokens.to(tl.int64) * stride_positions, mask=tokens < n_tokens, other=0)
        rows = cos_ptr + tl.minimum(tl.maximum(positions.to(tl.int64), 0), cache_rows - 1)[:, None] * stride_cos_row
        cos_first = tl.load(rows + pairs[None, :] * stride_cos_dim, mask=tok_mask, other=1.0).to(tl.float32)
        sin_first = tl.load(rows + (pairs + HALF)[None, :] * stride_cos_dim, mask=tok_mask, other=0.0).to(tl.float32)
        cos_second = cos_first
        sin_second = sin_first
    else:
        token_rows = tokens.to(tl.int64)[:, None]
        cos_rows = cos_ptr + block.to(tl.int64) * stride_cos_block + token_rows * stride_cos_row
        sin_rows = sin_ptr + block.to(tl.int64) * stride_sin_block + token_rows * stride_sin_row
        cos_first = tl.load(cos_rows + first_dims[None, :] * stride_cos_dim, mask=tok_mask, other=1.0).to(tl.float32)
        cos_second = tl.load(cos_rows + second_dims[None, :] * stride_cos_dim, mask=tok_mask, other=1.0).to(tl.float32)
        sin_first = tl.load(sin_rows + first_dims[None, :] * stride_sin_dim, mask=tok_mask, other=0.0).to(tl.float32)
        sin_second = tl.load(sin_rows + second_dims[None, :] * stride_sin_dim, mask=tok_mask, other=0.0).to(tl.float32)
    k_first = first * cos_first + (-second) * sin_first
    k_second = second * cos_second + first * sin_second
    if INTERLEAVED:  # [BLOCK_T, HALF, 2] -> dims 2j, 2j + 1
        return tl.reshape(tl.join(k_first, k_second), (BLOCK_T, HEAD_DIM))
    return tl.reshape(tl.permute(tl.join(k_first, k_second), (0, 2, 1)), (BLOCK_T, HEAD_DIM))


k_head_epilogue = triton.jit(_k_head_epilogue)


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
    stride_xn,
    stride_wr,
    stride_b,
    stride_on,
    k_out_ptr, k_column, k_block_stride, k_head_stride, k_blocks, k_heads,
    stride_kob, stride_kot, stride_koh, stride_kod,
    n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15,
    stride_nb, stride_nd, eps_ptr, stride_eps, eps_value,
    cos_ptr, sin_ptr, positions_ptr, cache_rows,
    stride_cos_block, stride_cos_row, stride_cos_dim, stride_sin_block, stride_sin_row, stride_sin_dim,
    stride_positions, angle_scale,
    NUM_WEIGHTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,
    DOT_IN_FLOAT32: tl.constexpr,
    K_EPILOGUE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_NORM: tl.constexpr,
    NUM_NORM_WEIGHTS: tl.constexpr,
    HAS_EPS_TENSOR: tl.constexpr,
    USE_POSITIONS: tl.constexpr,
    ANGLES: tl.constexpr,
    ROUND_ANGLES: tl.constexpr,
    NORM_WEIGHT_OFFSET: tl.constexpr,
    NORM_WEIGHT_IN_FLOAT32: tl.constexpr,
    NORM_ROUND_BEFORE_ROPE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
):  # fmt: skip
    """One program: the tiles program_id, program_id + PROGRAMS, ... of out, each [BLOCK_M, BLOCK_N] of one
    weight (token blocks in groups of GROUP_M, column tiles weight by weight). Computed on the host:
    token_tiles = cdiv(N, BLOCK_M), row_tiles = cdiv(R, BLOCK_N).
    K_EPILOGUE (BLOCK_N = head_dim = ROTARY_DIM): a tile that is one K head also goes through the K norm and
    RoPE into k_out (`_k_head_epilogue`; the arguments and constexprs are `grouped_gemv`'s K epilogue's but
    ANGLE_TILE: computed angles are always a tile of frequencies here).
    WARP_SPECIALIZE: Triton splits the tile loop between a producer warp group that loads tiles through TMA
    and consumer warp groups that multiply them (Hopper; num_warps per consumer group)."""
    column_tiles = NUM_WEIGHTS * row_tiles
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[N, K], strides=[stride_xn, 1], block_shape=[BLOCK_M, BLOCK_K])
    ws = (w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15)
    bs = (b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15)
    tiles = token_tiles * column_tiles
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, warp_specialize=WARP_SPECIALIZE):
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
        if K_EPILOGUE:
            # Which K head this tile is, if any: column = k_column + block * k_block_stride + head * k_head_stride.
            rel = idx * R + row_start - k_column
            block = tl.maximum(rel, 0) // k_block_stride
            head = (rel - block * k_block_stride) // k_head_stride
            is_head = (rel >= 0) & (block < k_blocks) & (head < k_heads)
            if is_head & (rel == block * k_block_stride + head * k_head_stride):
                norm_ptr = n0
                if HAS_NORM and NUM_NORM_WEIGHTS == 1:  # one [blocks, head_dim] table
                    norm_ptr = n0 + block.to(tl.int64) * stride_nb
                elif HAS_NORM:  # one [head_dim] weight per block
                    norms = (n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15)
                    for i in tl.static_range(1, NUM_NORM_WEIGHTS):
                        norm_ptr = tl.where(block == i, norms[i], norm_ptr)
                eps = eps_value
                if HAS_EPS_TENSOR:
                    eps = tl.load(eps_ptr + block * stride_eps).to(tl.float32)
                tokens = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                rotated = k_head_epilogue(
                    acc.to(out_desc.dtype).to(tl.float32), tokens, N, block, norm_ptr, stride_nd, eps,
                    cos_ptr, sin_ptr, positions_ptr, cache_rows, stride_cos_block, stride_cos_row, stride_cos_dim,
                    stride_sin_block, stride_sin_row, stride_sin_dim, stride_positions, angle_scale,
                    out_desc.dtype, BLOCK_M, BLOCK_N, INTERLEAVED, HAS_NORM, USE_POSITIONS, ANGLES, ROUND_ANGLES,
                    NORM_WEIGHT_OFFSET, NORM_WEIGHT_IN_FLOAT32, NORM_ROUND_BEFORE_ROPE,
                )  # fmt: skip
                dims = tl.arange(0, BLOCK_N)
                k_ptrs = (
                    k_out_ptr + block.to(tl.int64) * stride_kob + tokens.to(tl.int64)[:, None] * stride_kot
                    + head.to(tl.int64) * stride_koh + dims[None, :] * stride_kod
                )
                tl.store(k_ptrs, rotated.to(k_out_ptr.dtype.element_ty), mask=(tokens < N)[:, None])


grouped_gemm_tma_kernel = triton.jit(_grouped_gemm_tma_kernel)
grouped_gemm_tma_kernel_interpreted = InterpretedFunction(_grouped_gemm_tma_kernel)
k_head_epilogue_interpreted = InterpretedFunction(_k_head_epilogue)


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


def epilogue_unsupported_reason(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    out: torch.Tensor,
    epilogue: KEpilogue,
) -> str | None:
    """None when `launch(x, weights, biases, out, k_epilogue=epilogue)` applies, else why not: the launch
    applies (`unsupported_reason`), its tiles can be whole K heads (`k_epilogue_unsupported_reason`), and
    RoPE covers the whole head (so each dim's rotation partner lies in its tile's other half)."""
    reason = unsupported_reason(x, weights, biases, out)
    if reason is not None:
        return reason
    head_dim = epilogue.k_out.shape[-1]
    if epilogue.rotary_dim != head_dim:
        return f"RoPE over {epilogue.rotary_dim} of {head_dim} dims (the TMA epilogue rotates whole heads)"
    return k_epilogue_unsupported_reason(weights[0].shape[0], out.shape[1], epilogue, out)


def launch_config(n: int, rows: int, n_weights: int, device: torch.device, block_n: int | None = None) -> dict[str, int]:
    """Tiles of 128 tokens x 128 or 256 rows, K step 64, 8 warps, over at most one program per SM. Of the
    two tile widths the one with fewer waves of tiles (a 256-wide tile counting as two 128-wide ones):
    10 weights at 384 / 768 / 1536 tokens 128 x 256 with 3 stages (49.7 / 91.8 / 181.6 us), at 512 / 1024
    128 x 128 with 4-5 stages (83.2 / 128.8 us; the other width 93.9 / 139.3). `block_n` (a K epilogue's
    head width) fixes the width: 5 stages up to 128, 3 above (shared memory). CPU: small tiles (a given
    width kept), so that small tests reach every tail."""
    if device.type != "cuda":
        config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2, "PROGRAMS": 3}
        return config if block_n is None else dict(config, BLOCK_N=block_n)
    sms = sm_count(device)
    token_tiles = ceil_div(n, 128)
    waves = lambda width: ceil_div(token_tiles * n_weights * ceil_div(rows, width), sms)  # noqa: E731
    if block_n is None:
        block_n = 128 if waves(128) < 2 * waves(256) else 256
    stages = 5 if block_n <= 128 else 3
    tiles = token_tiles * n_weights * ceil_div(rows, block_n)
    return {
        "BLOCK_M": 128, "BLOCK_N": block_n, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": stages,
        "PROGRAMS": min(tiles, sms),
    }  # fmt: skip


@contextlib.contextmanager
def _interpreted_epilogue():
    """The kernel calls its epilogue helper by this module's global name: the interpreted kernel needs the
    interpreted twin there for the duration of the launch."""
    global k_head_epilogue
    compiled, k_head_epilogue = k_head_epilogue, k_head_epilogue_interpreted
    try:
        yield
    finally:
        k_head_epilogue = compiled


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
    k_epilogue: KEpilogue | None = None,
    traceable: bool = False,
    **overrides: int,
) -> None:
    """out[:, i*R:(i+1)*R] = x @ weights[i].T (+ biases[i]) for every i, one launch per 16 weights; with
    `k_epilogue`, the K heads among those columns also normalised and rotated into its k_out (tiles one
    head wide). Call `unsupported_reason` (or `epilogue_unsupported_reason`) first (not re-checked here).
    `overrides` replace `launch_config`'s entries (tuning only). `traceable` launches through
    `torch.library.wrap_triton` (Inductor launches it)."""
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
        head_dim = None if k_epilogue is None else k_epilogue.k_out.shape[-1]
        config = launch_config(n, rows, g, x.device, block_n=head_dim)
        config.update(overrides)
        token_tiles, row_tiles = ceil_div(n, config["BLOCK_M"]), ceil_div(rows, config["BLOCK_N"])
        pad = [None] * (MAX_WEIGHTS_PER_LAUNCH - g)
        args = (
            x, chunk_out, *chunk_w, *pad, *(chunk_b + pad if chunk_b else [None] * MAX_WEIGHTS_PER_LAUNCH),
            n, k, rows, token_tiles, row_tiles, x.stride(0), chunk_w[0].stride(0), chunk_b[0].stride(0) if chunk_b else 0, chunk_out.stride(0),
        )  # fmt: skip
        epilogue_args, epilogue_meta = _epilogue_arguments(k_epilogue, start * rows)
        del epilogue_meta["ANGLE_TILE"]  # computed angles are always a tile here
        args += epilogue_args
        grid = (config["PROGRAMS"],)
        # The interpreter's tl.dot multiplies bfloat16's raw storage: there, tiles are widened to float32 first.
        meta = dict(
            NUM_WEIGHTS=g, HAS_BIAS=bool(chunk_b), DOT_IN_FLOAT32=interpret and x.dtype == torch.bfloat16,
            **config, **epilogue_meta,
        )  # fmt: skip
        if interpret:
            with _interpretable_helpers(), _interpreted_epilogue():  # tl.zeros, the epilogue's helper
                grouped_gemm_tma_kernel_interpreted[grid](*args, **meta)
        elif traceable:
            torch.library.wrap_triton(grouped_gemm_tma_kernel)[grid](*args, **meta)
        elif x.device.index == torch.cuda.current_device():
            grouped_gemm_tma_kernel[grid](*args, **meta)
        else:  # Triton launches on the current device
            with torch.cuda.device(x.device):
                grouped_gemm_tma_kernel[grid](*args, **meta)
