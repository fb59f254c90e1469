"""Grouped GEMV / skinny GEMM: several linears over the same input in one launch, no weight copies.

    x:    [N, K]             any strides
    W_i:  [R, K]             i = 0 .. G-1; same shape, dtype, device and strides (any), each where it lives
    b_i:  [R]                optional: all or none, same dtype and stride
    out:  [N, G * R]         any strides, allocated by the caller (e.g. a column slice of a wider buffer);
                             must not overlap the inputs

    out[n, i * R + r] = sum_k x[n, k] * W_i[r, k]  (+ b_i[r])

accumulated in float32 and rounded once to out's dtype (bias added in float32 before that rounding).

When it is used: few tokens (N <= `max_tokens(G)`), e.g. the K/V projections of every layer of a multi-layer
draft over the same context hidden states at decode time. There the work is bound by reading the weights
once, and one launch over weights that stay where they are beats G separate GEMMs (G launches) without
paying for a stacked copy of the weights (memory) or a per-call concatenation (bandwidth).
`grouped_gemv_supported` says whether a call fits; larger N belongs to a real GEMM.

The weights travel as separate pointer arguments w0 .. w{MAX_WEIGHTS_PER_LAUNCH-1}; each program picks its
own with a chain of `tl.where` on the (uniform) weight index. More weights are launched in chunks of
MAX_WEIGHTS_PER_LAUNCH, each writing its own column range of `out`.

Grid: (cdiv(N, BLOCK_T), column blocks of BLOCK_N over the chunk's weights). One program computes a
[BLOCK_T, BLOCK_N] tile of out for one weight with `tl.dot`, stepping over K by BLOCK_K, float32
accumulation (float32 inputs use input_precision="ieee": no TF32). Token blocks vary fastest, so programs
that run together share a weight tile. Even one token takes a 16-row tile (rows past N masked): on an
H200 that streams the weights faster than a broadcast-and-sum GEMV (benchmarks/RESULTS.md). When too few
tiles would keep the SMs busy, K is split too (the grid's first axis is then token blocks x SPLIT_K): each
split stores a float32 partial tile in a scratch buffer, and the last split to finish a tile (an atomic
counter per tile) sums the partials in split order and writes it.

With a `KEpilogue` the tiles are one head wide (BLOCK_N = head_dim) and a tile that is a K head (of a
layer, or of a block of heads) is also normalised (per-head RMSNorm) and rotated (RoPE) as it is written,
into its own output `k_out`, with the math and roundings of `fused_kv_materialize`: the K projection never
makes a second trip through memory, and each layer's norm weight is read by pointer. The partner element
of each dim (RoPE's pair) is read back from the tile just stored.

CPU tensors run through Triton's interpreter (tests only; `grouped_gemv_supported` admits them only when
TRITON_INTERPRET=1 at call time).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .launch_math import ceil_div, next_power_of_2

MAX_WEIGHTS_PER_LAUNCH = 16
MAX_TOKENS = 128  # above this, one cuBLAS GEMM per weight is faster for a few weights (measured on an H200)
MAX_TOKENS_MANY_WEIGHTS = 256  # ... and above this even for MANY_WEIGHTS or more (measured on an H200)
MANY_WEIGHTS = 6
MAX_EPILOGUE_TOKENS = 32  # above this, the K norm/RoPE as a kernel of its own is faster (measured on an H200)
# The epilogue computes RoPE's cos/sin itself up to MAX_ANGLE_TOKENS tokens where it takes one head-wide row
# per token, up to MAX_ANGLE_TILE_TOKENS where a tile of frequencies serves (`angle_tile_serves`); past
# them reading the graph's tables measured faster. A tile from ANGLE_TILE_MIN_TOKENS tokens (level with rows
# at 2 and 4 tokens, 0.7-1.3 us faster than the tables at 16 and 32: benchmarks/RESULTS.md).
MAX_ANGLE_TOKENS = 4  # a partial rotate-half: cos/sin computed one row per token up to here, tables above
MAX_ANGLE_TILE_TOKENS = MAX_EPILOGUE_TOKENS
ANGLE_TILE_MIN_TOKENS = 2
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_GRID_COLUMN_BLOCKS = 65535  # CUDA's limit on a grid's second axis, which counts column blocks

# Launch heuristic (see `default_launch_config`).
BLOCK_N_CHOICES = (64, 32, 16)
MIN_PROGRAMS_PER_SM = 2
MIN_BLOCK_T = 16  # tl.dot's smallest tile
BLOCK_K_BYTES = 512  # per weight row and K step: BLOCK_K = 256 for 16-bit weights, 128 for float32
SPLIT_K_FEW_TOKENS, SPLIT_K_MORE_TOKENS = 8, 4  # K splits when even 16-row tiles leave SMs idle
SPLIT_BLOCK_K_BYTES = 256
SPLIT_MIN_ROW_BYTES = 8192  # past 16 tokens, split K only over weight rows this long (4096 bf16 features)
EPILOGUE_TILE_BYTES = 32 * 1024  # a head-wide weight tile per pipeline stage, at most
UNSPLIT_EPILOGUE_STAGES = 4  # pipeline stages of an unsplit K-epilogue launch of up to 32 tokens
SWAPPED_EPILOGUE_WARPS = 8  # K-epilogue launches with the weight rows as the MMA's M (Hopper) ...
SWAPPED_HEAD_DIM = 128  # ... for heads this wide: the one width measured on a GPU


def _grouped_gemv_kernel(
    x_ptr,
    out_ptr,
    w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15,
    b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15,
    N,
    K,
    R,
    stride_xn,
    stride_xk,
    stride_wr,
    stride_wk,
    step_xk,
    step_wk,
    stride_b,
    stride_on,
    stride_oc,
    partial_ptr,
    arrivals_ptr,
    k_per_split,
    stride_ps,
    stride_pn,
    k_out_ptr,
    k_column,
    k_block_stride,
    k_head_stride,
    k_blocks,
    k_heads,
    stride_kob,
    stride_kot,
    stride_koh,
    stride_kod,
    n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15,
    stride_nb,
    stride_nd,
    eps_ptr,
    stride_eps,
    eps_value,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    cache_rows,
    stride_cos_block,
    stride_cos_row,
    stride_cos_dim,
    stride_sin_block,
    stride_sin_row,
    stride_sin_dim,
    stride_positions,
    angle_scale,
    NUM_WEIGHTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FLOAT32: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    K_EPILOGUE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_NORM: tl.constexpr,
    NUM_NORM_WEIGHTS: tl.constexpr,
    HAS_EPS_TENSOR: tl.constexpr,
    USE_POSITIONS: tl.constexpr,
    ANGLES: tl.constexpr,
    ANGLE_TILE: tl.constexpr,
    ROUND_ANGLES: tl.constexpr,
    NORM_WEIGHT_OFFSET: tl.constexpr,
    NORM_WEIGHT_IN_FLOAT32: tl.constexpr,
    NORM_ROUND_BEFORE_ROPE: tl.constexpr,
    SWAP_AB: tl.constexpr,
):  # fmt: skip
    """One program: out[tokens, idx * R + rows] for one weight idx, a BLOCK_T x BLOCK_N tile, over the
    features [split * k_per_split, (split + 1) * k_per_split) of its split (all of K when SPLIT_K is 1).

    step_xk, step_wk = BLOCK_K * stride_xk, BLOCK_K * stride_wk, computed on the host (so an int64 argument
    when past 2**31). Pointers the launch does not read (weight, bias and norm slots past the count, the
    split-K scratch without splits, the epilogue's without an epilogue) are None: constexprs, which Triton's
    launcher does not pass on (a cheaper launch; Inductor's generated code still lists them).
    SPLIT_K > 1: each split stores its float32 partial tile in partial [SPLIT_K, N, columns] (strides
    stride_ps, stride_pn, 1) and counts itself in arrivals[tile] (int32, zero before the launch);
    the last split to arrive sums the partials in split order (the same sum whatever the arrival order)
    and writes the tile.
    EVEN_K: K is a multiple of BLOCK_K (so every split is too): the K loop loads without a K mask.
    K_EPILOGUE (BLOCK_N = head_dim): a tile that is one K head also goes through the K norm and RoPE into
    k_out (`KEpilogue`); the partner element of each dim is re-read from the tile just stored.
    ANGLES: cos and sin are computed, not read: cos_ptr holds inv_freq [ROTARY_DIM // 2] (stride
    stride_cos_dim), positions_ptr the tokens' positions; cos = cos(float32(position) * inv_freq[j]) *
    angle_scale, rounded to k's dtype when ROUND_ANGLES (sin alike), as the graph's own tables are.
    ANGLE_TILE (with ANGLES; interleaved pairs, or rotate-half over the whole head): one trig per token
    and frequency over the tile, rather than one head-wide row per token in turn.
    SWAP_AB: each K step multiplies the transposed tiles, weight rows [BLOCK_N, BLOCK_K] by tokens
    [BLOCK_K, BLOCK_T], so the rows are the MMA's M (Hopper's warp-group MMA needs M >= 64, and BLOCK_T is
    16 or 32); the float32 accumulator is transposed back to [BLOCK_T, BLOCK_N] before the stores (the
    same tiles and K steps; the order of the sums inside one step is the MMA instruction's).
    """
    pid_tok = tl.program_id(0) // SPLIT_K  # token blocks (then splits) vary fastest: programs running
    split = tl.program_id(0) % SPLIT_K  # together share a weight tile
    pid_col = tl.program_id(1)
    col_blocks = tl.cdiv(R, BLOCK_N)
    idx = pid_col // col_blocks  # which weight (uniform over the program)
    row_start = (pid_col % col_blocks) * BLOCK_N

    # Select this program's weight (and bias) among the pointer arguments.
    ws = (w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15)
    bs = (b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, b15)
    w_ptr = w0
    b_ptr = b0
    for i in tl.static_range(1, NUM_WEIGHTS):
        w_ptr = tl.where(idx == i, ws[i], w_ptr)
        if HAS_BIAS:
            b_ptr = tl.where(idx == i, bs[i], b_ptr)

    # int64 row offsets: row * stride can pass 2**31 (large strided views, sliced parameters).
    tokens = pid_tok * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = row_start + tl.arange(0, BLOCK_N)
    tok_mask = tokens < N
    row_mask = rows < R
    # x tile [BLOCK_T, BLOCK_K]; weight tile [BLOCK_K, BLOCK_N], tl.dot's B operand as loaded (staged
    # through shared memory, so the loop is software-pipelined).
    k_begin = split * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    ks = tl.arange(0, BLOCK_K)
    k_offsets = k_begin.to(tl.int64) + ks.to(tl.int64)
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_xn + k_offsets[None, :] * stride_xk
    w_ptrs = w_ptr + rows.to(tl.int64)[None, :] * stride_wr + k_offsets[:, None] * stride_wk
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    acc_t = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:  # whole K steps: only the tile's token and row tails are masked
            x = tl.load(x_ptrs, mask=tok_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=row_mask[None, :], other=0.0)
        else:
            k_mask = (k_start + ks) < k_end
            x = tl.load(x_ptrs, mask=tok_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & row_mask[None, :], other=0.0)
        if DOT_IN_FLOAT32:  # exact products of 16-bit values, float32 sums: the same math
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if SWAP_AB:  # weight rows as the MMA's M, tokens as its N: Hopper's warp-group MMA needs M >= 64
            acc_t = tl.dot(tl.trans(w), tl.trans(x), acc_t, input_precision=INPUT_PRECISION)
        else:
            acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        x_ptrs += step_xk
        w_ptrs += step_wk

    if SWAP_AB:
        acc = tl.trans(acc_t)
    cols = (idx * R + rows).to(tl.int64)
    tile_mask = tok_mask[:, None] & row_mask[None, :]
    last = True
    if SPLIT_K > 1:
        partial_ptrs = partial_ptr + tokens.to(tl.int64)[:, None] * stride_pn + cols[None, :]
        tl.store(partial_ptrs + split * stride_ps, acc, mask=tile_mask)
        tl.debug_barrier()  # every thread's partial stored before the counter says so
        tile = pid_tok * tl.num_programs(1) + pid_col
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        if last:
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # L2, not this SM's L1: other SMs wrote them
                acc += tl.load(partial_ptrs + s * stride_ps, mask=tile_mask, other=0.0, cache_modifier=".cg")

    if last:
        if HAS_BIAS:
            bias = tl.load(b_ptr + rows.to(tl.int64) * stride_b, mask=row_mask, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        out_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_on + cols[None, :] * stride_oc
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)
        if K_EPILOGUE:
            # Which K head this tile is, if any: column = k_column + block * k_block_stride + head * k_head_stride.
            rel = idx * R + row_start - k_column
            block = tl.maximum(rel, 0) // k_block_stride
            head = (rel - block * k_block_stride) // k_head_stride
            is_head = (rel >= 0) & (block < k_blocks) & (head < k_heads)
            if is_head & (rel == block * k_block_stride + head * k_head_stride):
                tl.debug_barrier()  # the raw tile stored by every thread before partners are re-read
                dims = tl.arange(0, BLOCK_N)
                rotary = dims < ROTARY_DIM
                if INTERLEAVED:  # pairs (2j, 2j+1), frequency j
                    partner = dims ^ 1
                    first = dims % 2 == 0
                    freq = dims // 2
                else:  # rotate half: pairs (j, j + r/2), frequency j
                    first = dims < ROTARY_DIM // 2
                    partner = tl.where(first, dims + ROTARY_DIM // 2, dims - ROTARY_DIM // 2)
                    freq = tl.where(first, dims, dims - ROTARY_DIM // 2)
                partner = tl.where(rotary, partner, dims)
                kv_dtype = out_ptr.dtype.element_ty
                x = acc.to(kv_dtype).to(tl.float32)  # the projection as the graph would read it back
                partner_cols = (idx * R + row_start).to(tl.int64) + partner
                partner_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_on + partner_cols[None, :] * stride_oc
                x_partner = tl.load(partner_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
                if HAS_NORM:
                    if HAS_EPS_TENSOR:
                        eps = tl.load(eps_ptr + block * stride_eps).to(tl.float32)
                    else:
                        eps = eps_value
                    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / BLOCK_N + eps)[:, None]
                    if NUM_NORM_WEIGHTS == 1:  # one [blocks, head_dim] table
                        norm_ptr = n0 + block.to(tl.int64) * stride_nb
                    else:  # one [head_dim] weight per block
                        norm_ptr = n0
                        norms = (n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15)
                        for i in tl.static_range(1, NUM_NORM_WEIGHTS):
                            norm_ptr = tl.where(block == i, norms[i], norm_ptr)
                    w = tl.load(norm_ptr + dims * stride_nd).to(tl.float32) + NORM_WEIGHT_OFFSET
                    w_partner = tl.load(norm_ptr + partner * stride_nd).to(tl.float32) + NORM_WEIGHT_OFFSET
                    # round(round(x * inv_rms) * w), or once (NORM_WEIGHT_IN_FLOAT32), or not before RoPE.
                    normed_dtype = tl.float32 if NORM_WEIGHT_IN_FLOAT32 else kv_dtype
                    weighted_dtype = kv_dtype if NORM_ROUND_BEFORE_ROPE else tl.float32
                    x = ((x * inv_rms).to(normed_dtype).to(tl.float32) * w[None, :]).to(weighted_dtype).to(tl.float32)
                    x_partner = (x_partner * inv_rms).to(normed_dtype).to(tl.float32) * w_partner[None, :]
                    x_partner = x_partner.to(weighted_dtype).to(tl.float32)
                rot_mask = tok_mask[:, None] & rotary[None, :]
                if ANGLES and ANGLE_TILE:  # the tables' math once per frequency: a [BLOCK_T, BLOCK_N / 2] tile,
                    # each frequency's column then given to both dims of its pair (rows past N are masked)
                    half = tl.arange(0, BLOCK_N // 2)
                    half_freq = tl.load(cos_ptr + half * stride_cos_dim, mask=half < ROTARY_DIM // 2, other=0.0)
                    token_pos = tl.load(
                        positions_ptr + tokens.to(tl.int64) * stride_positions, mask=tok_mask, other=0
                    ).to(tl.float32)
                    angle = token_pos[:, None] * half_freq.to(tl.float32)[None, :]
                    half_cos = tl.cos(angle) * angle_scale
                    half_sin = tl.sin(angle) * angle_scale
                    if ROUND_ANGLES:
                        half_cos = half_cos.to(kv_dtype).to(tl.float32)
                        half_sin = half_sin.to(kv_dtype).to(tl.float32)
                    if INTERLEAVED:  # [BLOCK_T, BLOCK_N / 2, 2] -> dims 2j and 2j + 1 hold frequency j
                        cos = tl.reshape(tl.join(half_cos, half_cos), (BLOCK_T, BLOCK_N))
                        sin = tl.reshape(tl.join(half_sin, half_sin), (BLOCK_T, BLOCK_N))
                    else:  # [BLOCK_T, 2, BLOCK_N / 2] -> dims j and BLOCK_N / 2 + j hold frequency j
                        cos = tl.reshape(tl.permute(tl.join(half_cos, half_cos), (0, 2, 1)), (BLOCK_T, BLOCK_N))
                        sin = tl.reshape(tl.permute(tl.join(half_sin, half_sin), (0, 2, 1)), (BLOCK_T, BLOCK_N))
                elif ANGLES:  # the tables' math, one row per token of the tile (rows past N keep cos 1, sin 0);
                    # tl.cos / tl.sin are what Inductor's code calls for aten.cos / aten.sin
                    inv_freq = tl.load(cos_ptr + freq * stride_cos_dim, mask=rotary, other=0.0).to(tl.float32)
                    cos = tl.full((BLOCK_T, BLOCK_N), 1.0, tl.float32)
                    sin = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
                    first_token = pid_tok * BLOCK_T
                    for t in range(first_token, tl.minimum(N, first_token + BLOCK_T)):
                        position = tl.load(positions_ptr + t * stride_positions).to(tl.float32)
                        row_cos = tl.cos(position * inv_freq) * angle_scale
                        row_sin = tl.sin(position * inv_freq) * angle_scale
                        if ROUND_ANGLES:
                            row_cos = row_cos.to(kv_dtype).to(tl.float32)
                            row_sin = row_sin.to(kv_dtype).to(tl.float32)
                        row = (tokens == t)[:, None]
                        cos = tl.where(row, row_cos[None, :], cos)
                        sin = tl.where(row, row_sin[None, :], sin)
                elif USE_POSITIONS:  # a cos/sin cache row per token: cos of frequency j at j, its sin at r/2 + j
                    positions = tl.load(positions_ptr + tokens.to(tl.int64) * stride_positions, mask=tok_mask, other=0)
                    positions = tl.minimum(tl.maximum(positions.to(tl.int64), 0), cache_rows - 1)
                    cos_ptrs = cos_ptr + positions[:, None] * stride_cos_row + freq[None, :] * stride_cos_dim
                    sin_ptrs = cos_ptrs + (ROTARY_DIM // 2) * stride_cos_dim
                else:  # per-token tables (one per block, or shared: block stride 0)
                    token_rows = tokens.to(tl.int64)[:, None]
                    cos_ptrs = cos_ptr + block.to(tl.int64) * stride_cos_block + token_rows * stride_cos_row
                    cos_ptrs += dims[None, :] * stride_cos_dim
                    sin_ptrs = sin_ptr + block.to(tl.int64) * stride_sin_block + token_rows * stride_sin_row
                    sin_ptrs += dims[None, :] * stride_sin_dim
                if not ANGLES:
                    cos = tl.load(cos_ptrs, mask=rot_mask, other=1.0).to(tl.float32)
                    sin = tl.load(sin_ptrs, mask=rot_mask, other=0.0).to(tl.float32)
                signed_partner = tl.where(first, -x_partner, x_partner)
                k = tl.where(rotary[None, :], x * cos + signed_partner * sin, x)
                k_ptrs = (
                    k_out_ptr + block.to(tl.int64) * stride_kob + tokens.to(tl.int64)[:, None] * stride_kot
                    + head.to(tl.int64) * stride_koh + dims[None, :] * stride_kod
                )
                tl.store(k_ptrs, k.to(k_out_ptr.dtype.element_ty), mask=tile_mask)


# One kernel source, two front ends: compiled for CUDA tensors, interpreted (numpy) for CPU tensors.
# `triton.jit` only looks at TRITON_INTERPRET when it runs (at import), so the interpreted twin is built here.
grouped_gemv_kernel = triton.jit(_grouped_gemv_kernel)
grouped_gemv_kernel_interpreted = InterpretedFunction(_grouped_gemv_kernel)


# The kernel's helpers from triton.language that are themselves `@triton.jit` functions.
_JIT_HELPERS = ("cdiv", "zeros", "sum")


@contextlib.contextmanager
def _interpretable_helpers():
    """Let the interpreter run the `@triton.jit` helpers of triton.language (`tl.cdiv`, ...): they are
    interpretable only when TRITON_INTERPRET=1 was set before triton was imported; otherwise swap in
    interpreted twins for the duration of the launch."""
    compiled = {name: getattr(tl, name) for name in _JIT_HELPERS}
    for name, fn in compiled.items():
        if not isinstance(fn, InterpretedFunction):
            setattr(tl, name, InterpretedFunction(fn.fn))
    try:
        yield
    finally:
        for name, fn in compiled.items():
            setattr(tl, name, fn)


# --------------------------------------------------------------------------------------------------------
# Applicability
# --------------------------------------------------------------------------------------------------------


def uniform_weights_reason(weights: Sequence[torch.Tensor]) -> str | None:
    """None when every weight is 2-D with the first one's shape, strides, dtype and device, else why not.
    One pass over the weights: it runs on every uncaptured call of the op."""
    w = weights[0]
    shape, stride, dtype, device = w.shape, w.stride(), w.dtype, w.device
    for wi in weights:
        if wi.dim() != 2:
            return "every weight must be 2-D [R, K]"
        if wi.shape != shape or wi.stride() != stride:
            return "weights differ in shape or strides"
        if wi.dtype != dtype or wi.device != device:
            return "weights differ in dtype or device"
    return None


def grouped_gemv_unsupported_reason(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    out: torch.Tensor,
    gemms: int | None = None,
) -> str | None:
    """None when `launch_grouped_gemv(x, weights, biases, out)` applies, else why not (one line). `gemms`:
    how many GEMMs the launch replaces (default one per weight; fewer when the weights are row blocks of
    larger ones), which sets the token limit (`max_tokens`)."""
    if not weights:
        return "no weights"
    w = weights[0]
    if x.dim() != 2 or out.dim() != 2:
        return f"x and out must be 2-D (got {x.dim()}-D and {out.dim()}-D)"
    gemms = len(weights) if gemms is None else gemms
    n = x.shape[0]
    if n > max_tokens(gemms):  # first: the cheapest check, and the one a large call fails
        return f"N = {n} tokens > {max_tokens(gemms)}, the most the kernel serves in place of {gemms} GEMMs"
    reason = uniform_weights_reason(weights)
    if reason is not None:
        return reason
    if w.dtype not in SUPPORTED_DTYPES:
        return f"dtype {w.dtype} is not one of {SUPPORTED_DTYPES}"
    if x.dtype != w.dtype or out.dtype != w.dtype:
        return f"x ({x.dtype}) and out ({out.dtype}) must have the weights' dtype ({w.dtype})"
    if x.device != w.device or out.device != w.device:
        return "x, weights and out must be on one device"
    if w.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "CPU tensors need TRITON_INTERPRET=1 (Triton interpreter)"
    elif w.device.type != "cuda":
        return f"device {w.device} is not CUDA"
    rows, k = w.shape
    if rows < 1 or k < 1:
        return f"empty weights ({rows} x {k})"
    if x.shape[1] != k:
        return f"x has {x.shape[1]} features, the weights {k}"
    if tuple(out.shape) != (n, len(weights) * rows):
        return f"out is {tuple(out.shape)}, expected {(n, len(weights) * rows)}"
    if len(weights) * rows >= 2**31:
        return "too many output columns for int32 column indices"
    if min(len(weights), MAX_WEIGHTS_PER_LAUNCH) * ceil_div(rows, BLOCK_N_CHOICES[-1]) > MAX_GRID_COLUMN_BLOCKS:
        return f"too many column blocks for the grid's second axis ({MAX_GRID_COLUMN_BLOCKS})"
    if biases:
        if len(biases) != len(weights):
            return f"{len(biases)} biases for {len(weights)} weights"
        b = biases[0]
        if any(bi.dim() != 1 or bi.shape[0] != rows for bi in biases):
            return f"every bias must be [R] = [{rows}]"
        if any(bi.dtype != w.dtype or bi.device != w.device or bi.stride() != b.stride() for bi in biases):
            return "biases differ from the weights in dtype or device, or from each other in stride"
    return None


def max_tokens(n_weights: int) -> int:
    """The most tokens the grouped kernel serves for `n_weights` weights (the GEMMs it replaces, one per
    weight); past it one cuBLAS GEMM per weight is faster. Each such GEMM is small and leaves most SMs
    idle, so the kernel keeps the lead longer the more weights it computes at once: [1024, 4096] weights on
    an H200, T = 256, 10 / 6 / 2 weights: kernel 59.4 / 35.3 / 35.0 us, a GEMM per weight 96.5 / 58.2 /
    19.4; at T = 512 the GEMMs win for all three (benchmarks/RESULTS.md)."""
    return MAX_TOKENS_MANY_WEIGHTS if n_weights >= MANY_WEIGHTS else MAX_TOKENS


def grouped_gemv_supported(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    out: torch.Tensor,
    gemms: int | None = None,
) -> bool:
    """Whether the grouped kernel applies (see `grouped_gemv_unsupported_reason` for why not)."""
    return grouped_gemv_unsupported_reason(x, weights, biases, out, gemms) is None


class RotaryAngles(NamedTuple):
    """RoPE's cos and sin computed in the kernel, as a graph computes its tables from positions: for token
    t and frequency j, cos(float32(positions[t]) * float32(inv_freq[j])) * scale in float32 (sin alike),
    then rounded to K's dtype when `rounded`. With neox pairs dim d < rotary_dim uses frequency d mod
    rotary_dim / 2, with interleaved pairs d // 2.

        inv_freq:  [rotary_dim // 2] floating (converted to float32 as loaded), any stride
        positions: [N] integer or floating, any stride (exact in float32: below 2**24 in magnitude)
    """

    inv_freq: torch.Tensor
    positions: torch.Tensor
    scale: float
    rounded: bool


def token_positions(positions: torch.Tensor, first: int, step: int, n_tokens: int) -> torch.Tensor:
    """[n_tokens] view: positions.reshape(-1)[first + t * step] for token t (where a graph's tables read
    their positions: `fx_fusion.rotary_angles.AngleSource`)."""
    flat = positions.reshape(-1)
    if step == 0:
        return flat[first : first + 1].expand(n_tokens)
    return flat[first : first + (n_tokens - 1) * step + 1 : step]


class KEpilogue(NamedTuple):
    """K heads among the output columns, normalised and rotated as the tiles holding them are written.

    Head h of block b is out[:, column + b * block_stride + h * head_stride :][:, :head_dim]; it also goes,
    through the math of `fused_kv_materialize` (per-head RMSNorm, then RoPE on the first rotary_dim dims), to

        k_out: [n_blocks, N, heads, head_dim]   any strides, out's dtype

    norm_weights: [] (no norm), [table] with table [n_blocks, head_dim], or n_blocks (<= 16) tensors of
    [head_dim]; eps: [n_blocks] float tensor or None (eps_value); cos / sin: per-token tables [N,
    rotary_dim] or [n_blocks, N, rotary_dim] (sin None with positions: cos is then a cos/sin cache
    [max_pos, rotary_dim] read at positions [N]); the rest as in `launch_fused_kv_materialize`. With
    `angles` the kernel computes cos and sin itself (`RotaryAngles`); cos, sin and positions are then not
    read.
    """

    k_out: torch.Tensor
    column: int
    block_stride: int
    head_stride: int
    norm_weights: Sequence[torch.Tensor]
    eps: torch.Tensor | None
    eps_value: float
    cos: torch.Tensor
    sin: torch.Tensor | None
    positions: torch.Tensor | None
    rotary_dim: int
    interleaved: bool
    norm_weight_offset: float
    norm_weight_in_float32: bool
    norm_round_before_rope: bool
    angles: RotaryAngles | None = None


def angle_tile_serves(rotary_dim: int, head_dim: int, interleaved: bool) -> bool:
    """Whether the epilogue can compute its angles as one tile of frequencies: with interleaved pairs,
    or rotate-half over the whole head (a partial rotate-half keeps one head-wide row per token)."""
    return interleaved or rotary_dim == head_dim


def max_angle_tokens(rotary_dim: int, head_dim: int, interleaved: bool) -> int:
    """Up to how many tokens the epilogue computes cos/sin rather than reading tables."""
    return MAX_ANGLE_TILE_TOKENS if angle_tile_serves(rotary_dim, head_dim, interleaved) else MAX_ANGLE_TOKENS


def _angles_unsupported_reason(angles: RotaryAngles, n_tokens: int, rotary_dim: int, device: torch.device) -> str | None:
    if angles.inv_freq.dim() != 1 or angles.inv_freq.shape[0] != rotary_dim // 2:
        return f"inv_freq must be [{rotary_dim // 2}], got {tuple(angles.inv_freq.shape)}"
    if not angles.inv_freq.is_floating_point():
        return f"inv_freq must be floating, got {angles.inv_freq.dtype}"
    if angles.positions.dim() != 1 or angles.positions.shape[0] != n_tokens:
        return f"positions must be [{n_tokens}], got {tuple(angles.positions.shape)}"
    if angles.positions.dtype == torch.bool or angles.positions.is_complex():
        return f"positions must be integer or floating, got {angles.positions.dtype}"
    if angles.inv_freq.device != device or angles.positions.device != device:
        return "inv_freq and positions must be on the output's device"
    return None


def k_epilogue_unsupported_reason(rows: int, n_columns: int, epilogue: KEpilogue, out: torch.Tensor) -> str | None:
    """None when tiles of whole heads can carry `epilogue` over weights of `rows` rows, else why not. The
    tensors' shapes and dtypes are the caller's to validate (`ops.validate_materialize_args`)."""
    e = epilogue
    n_blocks, _, heads, head_dim = e.k_out.shape
    if head_dim < 16 or head_dim & (head_dim - 1) or head_dim > 256:
        return f"head_dim {head_dim} is not a power of 2 in [16, 256]"
    if rows % head_dim or e.column % head_dim or e.block_stride % head_dim or e.head_stride % head_dim:
        return "K heads do not start on head_dim-aligned columns of one weight"
    if (heads > 1 and e.head_stride < head_dim) or (n_blocks > 1 and e.block_stride < heads * e.head_stride):
        return "K heads overlap"
    if e.column < 0 or e.column + (n_blocks - 1) * e.block_stride + (heads - 1) * e.head_stride + head_dim > n_columns:
        return "K heads outside the output"
    if e.k_out.dtype != out.dtype or e.k_out.device != out.device:
        return "k_out differs from out in dtype or device"
    if len(e.norm_weights) > MAX_WEIGHTS_PER_LAUNCH:
        return f"more than {MAX_WEIGHTS_PER_LAUNCH} separate norm weights"
    if len({w.stride() for w in e.norm_weights}) > 1:
        return "separate norm weights of different strides"
    if e.angles is not None:
        return _angles_unsupported_reason(e.angles, e.k_out.shape[1], e.rotary_dim, out.device)
    return None


# --------------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------------


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def cuda_device_index(device: torch.device) -> int:
    """The index of a CUDA device ("cuda" without one: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """The SM count of a CUDA device (cached: the device's properties cost microseconds per query)."""
    return _sm_count(cuda_device_index(device))


def default_launch_config(
    n: int, rows: int, k: int, n_weights: int, dtype: torch.dtype, device: torch.device
) -> dict[str, int]:
    """BLOCK_T, BLOCK_N, BLOCK_K, num_warps and SPLIT_K for one launch over `n_weights` weights [rows, k].

    A pure function of the shapes (no autotuning: safe under CUDA-graph capture), from a sweep on an H200
    (benchmarks/RESULTS.md):
      - BLOCK_T: next power of 2 of N, at least 16, at most 64 (more tokens: several token blocks);
      - BLOCK_N: the largest of 64, 32, 16 that still gives MIN_PROGRAMS_PER_SM programs per SM over all
        token blocks (the work is a weight read: every SM must stream), else 16;
      - BLOCK_K: up to 64 tokens BLOCK_K_BYTES of a weight row at BLOCK_T = 16, half that above; past 64
        tokens 64 for 64-wide tiles (with 4 pipeline stages: 35.2 us against 39.3 with Triton's default for
        5 layers' K and V at T = 128), else 128.
      - BLOCK_K at most the next power of 2 of K (at least 16); num_warps 4.
      - Fewer programs than SMs even so (one layer's K and V: 2 x 1024 rows make 128 programs of 16 rows),
        or, past 16 tokens, fewer than MIN_PROGRAMS_PER_SM per SM over weight rows of at least
        SPLIT_MIN_ROW_BYTES: split K (SPLIT_K_FEW_TOKENS splits of 32-row tiles up to 16 tokens,
        SPLIT_K_MORE_TOKENS of 64-row tiles above), BLOCK_K SPLIT_BLOCK_K_BYTES of a weight row (one layer
        at T = 1: 8.9 us against 11.5 unsplit and 9.6 for one cuBLAS GEMM over a stacked copy; at T = 65-128,
        256 programs of 16 rows: 12.7-13.1 us against 16.2-16.6 with rows of 4096 features, no gain with
        2048, and splitting 4 weights of 1024 features was slower at every T tried).
      - CPU (the interpreter, tests): BLOCK_N 16, BLOCK_K 32, no split, so that small tests reach every tail.
    """
    k_cap = max(16, next_power_of_2(k))
    block_t = max(MIN_BLOCK_T, min(next_power_of_2(max(n, 1)), 64))
    if device.type != "cuda":
        return {"BLOCK_T": block_t, "BLOCK_N": 16, "BLOCK_K": min(32, k_cap), "num_warps": 4, "SPLIT_K": 1}
    token_blocks = ceil_div(n, block_t)
    min_programs = MIN_PROGRAMS_PER_SM * sm_count(device)
    block_n = BLOCK_N_CHOICES[-1]
    for candidate in BLOCK_N_CHOICES:
        if token_blocks * n_weights * ceil_div(rows, candidate) >= min_programs:
            block_n = candidate
            break
    element_size = dtype.itemsize
    programs = token_blocks * n_weights * ceil_div(rows, block_n)
    long_rows = k * element_size >= SPLIT_MIN_ROW_BYTES
    if programs < min_programs // MIN_PROGRAMS_PER_SM or (n > 16 and programs < min_programs and long_rows):
        block_n, split_k = (32, SPLIT_K_FEW_TOKENS) if n <= 16 else (64, SPLIT_K_MORE_TOKENS)
        block_k = min(SPLIT_BLOCK_K_BYTES // element_size, k_cap)
        return {"BLOCK_T": block_t, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "SPLIT_K": split_k}
    if n > 64 and block_n == 64:  # several token blocks: 64 x 64 tiles step K by 64, 4 pipeline stages
        return {"BLOCK_T": block_t, "BLOCK_N": 64, "BLOCK_K": min(64, k_cap), "num_warps": 4, "SPLIT_K": 1, "num_stages": 4}
    if n > 64:  # narrower tiles step K by 128
        block_k = 128
    else:
        block_k = (BLOCK_K_BYTES if block_t == MIN_BLOCK_T else BLOCK_K_BYTES // 2) // element_size
    return {"BLOCK_T": block_t, "BLOCK_N": block_n, "BLOCK_K": min(block_k, k_cap), "num_warps": 4, "SPLIT_K": 1}


def epilogue_launch_config(
    n: int, rows: int, k: int, n_weights: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> dict[str, int]:
    """The launch for the K epilogue: tiles one head wide (BLOCK_N = head_dim), BLOCK_T as in
    `default_launch_config`, BLOCK_K SPLIT_BLOCK_K_BYTES of a weight row (less where a stage's weight tile
    would pass EPILOGUE_TILE_BYTES: shared memory). K is split over programs only when fewer programs than
    half the SMs would stream weights (up to 8 splits for up to 16 tokens, up to 4 past that); unsplit
    launches of up to 32 tokens pipeline UNSPLIT_EPILOGUE_STAGES K steps. From sweeps on an H200
    (benchmarks/RESULTS.md): one layer (16 head tiles) at T = 1 10.1 us with 8 splits (22.1 unsplit); 5
    layers' K and V (80 head tiles) 24.3 us unsplit in 4 stages (26.0 with 2 splits in 3); at 64 tokens 5
    layers unsplit (31.4 against 36.5 with 2), one layer 4 splits.
    On Hopper, 16-bit heads of SWAPPED_HEAD_DIM dims up to MAX_EPILOGUE_TOKENS tokens multiply with the
    weight rows as the MMA's M (SWAP_AB: the warp-group MMA, which needs M >= 64) in SWAPPED_EPILOGUE_WARPS warps
    (H100, 5 layers at 1 / 16 / 32 tokens: 32.3 / 32.9 / 34.1 us against 33.0 / 33.5 / 35.5; one layer
    11.1 / 11.8 / 13.5 against 11.5 / 12.3 / 14.6; either change alone gains less or nothing)."""
    element_size = dtype.itemsize
    block_t = max(MIN_BLOCK_T, min(next_power_of_2(max(n, 1)), 64))
    # at most EPILOGUE_TILE_BYTES of weights per pipeline stage (head_dim 256: half the K step)
    block_k = min(SPLIT_BLOCK_K_BYTES // element_size, EPILOGUE_TILE_BYTES // (head_dim * element_size))
    block_k = max(16, min(block_k, next_power_of_2(k)))
    config = {"BLOCK_T": block_t, "BLOCK_N": head_dim, "BLOCK_K": block_k, "num_warps": 4, "SPLIT_K": 1}
    if device.type != "cuda":
        return config
    programs = ceil_div(n, block_t) * n_weights * ceil_div(rows, head_dim)
    sms = sm_count(device)
    if programs < sms // 2:
        config["SPLIT_K"] = min(8 if n <= 16 else 4, ceil_div(sms, programs))
    elif block_t <= 32:
        config["num_stages"] = UNSPLIT_EPILOGUE_STAGES
    hopper = _capability(cuda_device_index(device))[0] == 9
    if hopper and element_size == 2 and head_dim == SWAPPED_HEAD_DIM and n <= MAX_EPILOGUE_TOKENS:
        config.update(SWAP_AB=True, num_warps=SWAPPED_EPILOGUE_WARPS)
    return config


def _epilogue_arguments(epilogue: KEpilogue | None, column_shift: int) -> tuple[tuple, dict]:
    """The kernel's K-epilogue arguments and constexprs, with the K columns shifted by `column_shift` (a
    later launch's first column). Without an epilogue: no pointers (None) and no K heads."""
    if epilogue is None:
        zeros4 = (0, 0, 0, 0)
        args = (None, 0, 1, 1, 0, 0, *zeros4, *(None,) * MAX_WEIGHTS_PER_LAUNCH, 0, 0, None, 0, 0.0)
        args += (None, None, None, 0, *(0,) * 7, 0.0)
        return args, dict(
            K_EPILOGUE=False, ROTARY_DIM=2, INTERLEAVED=False, HAS_NORM=False, NUM_NORM_WEIGHTS=1,
            HAS_EPS_TENSOR=False, USE_POSITIONS=False, ANGLES=False, ANGLE_TILE=False, ROUND_ANGLES=False,
            NORM_WEIGHT_OFFSET=0.0,
            NORM_WEIGHT_IN_FLOAT32=False, NORM_ROUND_BEFORE_ROPE=True,
        )  # fmt: skip
    e = epilogue
    n_blocks, _, heads, _ = e.k_out.shape
    norms = list(e.norm_weights)
    table = len(norms) == 1 and norms[0].dim() == 2
    args = (
        e.k_out, e.column - column_shift, e.block_stride, e.head_stride, n_blocks, heads, *e.k_out.stride(),
        *norms, *[None] * (MAX_WEIGHTS_PER_LAUNCH - len(norms)),
        *(norms[0].stride() if table else (0, norms[0].stride(0)) if norms else (0, 0)),
        e.eps, e.eps.stride(0) if e.eps is not None else 0, float(e.eps_value),
    )  # fmt: skip
    angles = e.angles
    positions = angles is None and e.positions is not None
    per_token_strides = lambda t: (0, *t.stride()) if t.dim() == 2 else t.stride()  # noqa: E731
    if angles is not None:  # cos_ptr: inv_freq
        args += (angles.inv_freq, None, angles.positions, 0, 0, 0, angles.inv_freq.stride(0), 0, 0, 0)
        args += (angles.positions.stride(0), float(angles.scale))
    else:
        args += (
            e.cos, None if positions else e.sin, e.positions if positions else None,
            e.cos.shape[0] if positions else 0,
            *((0, *e.cos.stride()) if positions else per_token_strides(e.cos)),
            *((0, 0, 0) if positions else per_token_strides(e.sin)),
            e.positions.stride(0) if positions else 0, 0.0,
        )  # fmt: skip
    return args, dict(
        K_EPILOGUE=True, ROTARY_DIM=e.rotary_dim, INTERLEAVED=e.interleaved, HAS_NORM=bool(e.norm_weights),
        NUM_NORM_WEIGHTS=1 if table else max(1, len(norms)), HAS_EPS_TENSOR=e.eps is not None, USE_POSITIONS=positions,
        ANGLES=angles is not None, ROUND_ANGLES=angles is not None and angles.rounded,
        ANGLE_TILE=(
            angles is not None and e.k_out.shape[1] >= ANGLE_TILE_MIN_TOKENS
            and angle_tile_serves(e.rotary_dim, e.k_out.shape[-1], e.interleaved)
        ),
        NORM_WEIGHT_OFFSET=float(e.norm_weight_offset), NORM_WEIGHT_IN_FLOAT32=e.norm_weight_in_float32,
        NORM_ROUND_BEFORE_ROPE=e.norm_round_before_rope,
    )  # fmt: skip


def launch_grouped_gemv(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor],
    out: torch.Tensor,
    *,
    block_t: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    split_k: int | None = None,
    num_stages: int | None = None,
    masked_k: bool = False,
    swap_ab: bool | None = None,
    k_epilogue: KEpilogue | None = None,
    traceable: bool = False,
) -> None:
    """out[:, i*R:(i+1)*R] = x @ weights[i].T (+ biases[i]) for every i, in one launch per 16 weights;
    with `k_epilogue`, the K heads among those columns also normalised and rotated into its k_out (check
    `k_epilogue_unsupported_reason` first; block_n is then the head dim).

    Arguments as in the module docstring; call `grouped_gemv_supported` first (not re-checked here; any N
    works, but beyond `max_tokens` the weights are read once per BLOCK_T tokens). CPU tensors run through
    the Triton interpreter. `block_t` / `block_n` / `block_k` / `num_warps` / `split_k` / `num_stages`
    override the heuristic (tuning only; block sizes powers of 2, each at least 16; split_k >= 1; without
    num_stages, Triton's default pipelining), as does `swap_ab` (the weight rows as the MMA's M: SWAP_AB);
    `masked_k` keeps the K masks where BLOCK_K divides K (A/B only).
    `traceable` launches through `torch.library.wrap_triton`, so that tracing records the launch for Inductor.
    """
    n, k = x.shape
    rows = weights[0].shape[0]
    if n == 0:
        return
    w = weights[0]
    interpret = x.device.type != "cuda"
    for start in range(0, len(weights), MAX_WEIGHTS_PER_LAUNCH):
        chunk_w = list(weights[start : start + MAX_WEIGHTS_PER_LAUNCH])
        chunk_b = list(biases[start : start + MAX_WEIGHTS_PER_LAUNCH]) if biases else []
        g = len(chunk_w)
        chunk_out = out if g == len(weights) else out[:, start * rows : (start + g) * rows]
        if k_epilogue is None:
            config = default_launch_config(n, rows, k, g, w.dtype, x.device)
        else:
            config = epilogue_launch_config(n, rows, k, g, k_epilogue.k_out.shape[-1], w.dtype, x.device)
        overrides = {
            "BLOCK_T": block_t, "BLOCK_N": block_n if k_epilogue is None else None, "BLOCK_K": block_k,
            "num_warps": num_warps, "SPLIT_K": split_k,
            "num_stages": num_stages, "SWAP_AB": swap_ab,
        }  # fmt: skip
        config.setdefault("SWAP_AB", False)
        config.update({key: value for key, value in overrides.items() if value is not None})
        if config["SPLIT_K"] < 1:
            raise ValueError(f"split_k must be >= 1, got {config['SPLIT_K']}")
        pad = [None] * (MAX_WEIGHTS_PER_LAUNCH - g)  # unused slots
        w_args = chunk_w + pad
        b_args = chunk_b + pad if chunk_b else [None] * MAX_WEIGHTS_PER_LAUNCH
        # Splits of whole K steps, none empty.
        k_per_split = ceil_div(ceil_div(k, config["BLOCK_K"]), config["SPLIT_K"]) * config["BLOCK_K"]
        config["SPLIT_K"] = ceil_div(k, k_per_split)
        token_blocks, column_programs = ceil_div(n, config["BLOCK_T"]), g * ceil_div(rows, config["BLOCK_N"])
        grid = (token_blocks * config["SPLIT_K"], column_programs)
        if config["SPLIT_K"] > 1:
            partial = torch.empty((config["SPLIT_K"], n, g * rows), dtype=torch.float32, device=x.device)
            arrivals = torch.zeros(token_blocks * column_programs, dtype=torch.int32, device=x.device)
        else:  # not read
            partial, arrivals = None, None
        args = (
            x,
            chunk_out,
            *w_args,
            *b_args,
            n,
            k,
            rows,
            x.stride(0),
            x.stride(1),
            w.stride(0),
            w.stride(1),
            config["BLOCK_K"] * x.stride(1),  # step_xk, step_wk: int64 arguments when past 2**31
            config["BLOCK_K"] * w.stride(1),
            chunk_b[0].stride(0) if chunk_b else 0,
            chunk_out.stride(0),
            chunk_out.stride(1),
            partial,
            arrivals,
            k_per_split,
            partial.stride(0) if config["SPLIT_K"] > 1 else 0,
            partial.stride(1) if config["SPLIT_K"] > 1 else 0,
        )
        epilogue_args, epilogue_meta = _epilogue_arguments(k_epilogue, start * rows)
        args += epilogue_args
        # The interpreter's tl.dot multiplies bfloat16's raw uint16 storage: there, bfloat16 tiles are
        # widened to float32 first (exact products) and multiplied with input_precision="ieee".
        dot_in_float32 = interpret and w.dtype == torch.bfloat16
        meta = dict(
            NUM_WEIGHTS=g,
            HAS_BIAS=bool(chunk_b),
            # "ieee": no TF32 for float32 inputs; "tf32" is ignored for 16-bit inputs.
            INPUT_PRECISION="ieee" if w.dtype == torch.float32 or dot_in_float32 else "tf32",
            DOT_IN_FLOAT32=dot_in_float32,
            EVEN_K=k % config["BLOCK_K"] == 0 and not masked_k,
            **config,
            **epilogue_meta,
        )
        if interpret:
            with _interpretable_helpers():
                grouped_gemv_kernel_interpreted[grid](*args, **meta)
        elif traceable:
            torch.library.wrap_triton(grouped_gemv_kernel)[grid](*args, **meta)
        elif x.device.index == torch.cuda.current_device():
            grouped_gemv_kernel[grid](*args, **meta)
        else:  # Triton launches on the current device
            with torch.cuda.device(x.device):
                grouped_gemv_kernel[grid](*args, **meta)


# --------------------------------------------------------------------------------------------------------
# Reference (tests)
# --------------------------------------------------------------------------------------------------------


def grouped_linear_reference(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """cat_i(x @ W_i.T + b_i) in float64, [N, G * R] (on x's device)."""
    x64 = x.double()
    cols = []
    for i, w in enumerate(weights):
        y = x64 @ w.double().t()
        if biases:
            y = y + biases[i].double()
        cols.append(y)
    return torch.cat(cols, dim=1)
