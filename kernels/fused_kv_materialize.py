"""Stacked K/V materialization for multi-layer drafts: per-head RMSNorm + RoPE on K, copy of V.

After one grouped GEMM over the K/V projection weights of `n_layers` layers, the projections of every
layer sit side by side:

    k_proj: [total_ctx, n_layers, num_kv_heads * head_dim]   (any strides, e.g. kv[..., :kv_size])
    v_proj: [total_ctx, n_layers, num_kv_heads * head_dim]   (any strides, e.g. kv[..., kv_size:])

or, with the heads as a dimension of their own (any strides: heads need not be adjacent, e.g. the K heads
of a QKV projection laid out per query group, `qkv.view(T, L, groups, q_per_group + 2, D)[:, :, :, q_per_group]`):

    k_proj, v_proj: [total_ctx, n_layers, num_kv_heads, head_dim]   (v_proj always shaped like k_proj)

The 3-D form is read as its 4-D view `proj.unflatten(-1, (num_kv_heads, head_dim))` (head stride = head_dim
element strides). The attention cache wants, per layer, head-major tensors:

    k_out, v_out: [n_layers, total_ctx, num_kv_heads, head_dim]   (kv's dtype; any strides)

For every layer l, token t and head h, with k = k_proj[t, l, h, :] (k_proj[t, l, h*D:(h+1)*D] in the 3-D
form) in float32:

    n = round(round(k * rsqrt(mean(k^2) + eps[l])) * w)     (norm_weight_in_float32=False; skipped without a K norm)
    n = round(k * rsqrt(mean(k^2) + eps[l]) * w)            (norm_weight_in_float32=True)
    n = k * rsqrt(mean(k^2) + eps[l]) * w                   (norm_weight_in_float32=True, norm_round_before_rope=False)
    k_out[l, t, h, i] = round(n[i] * c[i] + sign(i) * n[partner(i)] * s[i])    for i < rotary_dim
    k_out[l, t, h, i] = round(n[i])                                             for i >= rotary_dim
    v_out[l, t, h, :] = v_proj[t, l, h, :]

where w = weight[l] + norm_weight_offset in float32 and round() rounds to the output dtype. The first form
reproduces Hugging Face's Llama/Qwen3 RMSNorm, `weight * hidden.to(input_dtype)` (two roundings); the second
SGLang's native RMSNorm and Gemma's, `(x * rsqrt(...) * w.float()).to(input_dtype)` (one rounding), where Gemma
uses norm_weight_offset = 1.0 (`1 + weight`). The third keeps the normalised K in float32 through RoPE and
rounds once at the very end (SGLang's reference math for the stacked layout). With r = rotary_dim,

    neox ("rotate half"):  partner(i) = i + r/2, sign -1 for i < r/2;  partner(i) = i - r/2, sign +1 after
    interleaved (GPT-J):   partner(i) = i ^ 1, sign -1 for even i.

The cos/sin come either per token, `c[i] = cos[t, i]`, `s[i] = sin[t, i]` (`cos`, `sin`: [total_ctx,
rotary_dim], Hugging Face layout, shared by every layer), per token and layer, `c[i] = cos[l, t, i]`,
`s[i] = sin[l, t, i]` (`cos`, `sin`: [n_layers, total_ctx, rotary_dim], one table per layer; the kernel reads
a shared table as one with layer stride 0), or from a cache indexed by `positions[t]` (`cos_sin_cache`:
[max_pos, rotary_dim], shared by every layer, cos in the first half, sin in the second; frequency
j = i % (r/2) for neox and i // 2 for interleaved). Positions are clamped into [0, max_pos - 1], so the
kernel never reads outside the cache.

Instead of k_out / v_out the kernel can write each layer's own KV caches (`CacheWrite`): token t of layer l
goes to slot slots[t] of k_caches[l] / v_caches[l] (slots outside the cache skipped), optionally as
k / scale converted once to an FP8 cache dtype.

This module holds the Triton kernel, its launcher and a plain-PyTorch implementation of the same math
(used for CPU tensors). Both write into caller-provided outputs and allocate nothing else; argument
validation lives in `ops.py`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .launch_math import ceil_div, next_power_of_2

# Rows are (token, head) pairs; the kernel computes row / column indices in int32.
MAX_ROWS_PER_LAYER = 2**31 - 2**20

# K-norm weights: a [n_layers, head_dim] table, n_layers tensors of [head_dim], or None (no norm)
NormWeight = torch.Tensor | Sequence[torch.Tensor] | None


def _fused_kv_materialize_kernel(
    k_proj_ptr,
    v_proj_ptr,
    k_out_ptr, k_out1, k_out2, k_out3, k_out4, k_out5, k_out6, k_out7,
    v_out_ptr, v_out1, v_out2, v_out3, v_out4, v_out5, v_out6, v_out7,
    slots_ptr,
    k_scale_ptr,
    v_scale_ptr,
    norm_weight_ptr, norm_weight1, norm_weight2, norm_weight3, norm_weight4, norm_weight5, norm_weight6,
    norm_weight7, norm_weight8, norm_weight9, norm_weight10, norm_weight11, norm_weight12, norm_weight13,
    norm_weight14, norm_weight15,
    eps_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    num_rows,
    cache_rows,
    stride_k_token,
    stride_k_layer,
    stride_k_head,
    stride_k_elem,
    stride_v_token,
    stride_v_layer,
    stride_v_head,
    stride_v_elem,
    stride_ko_layer,
    stride_ko_token,
    stride_ko_head,
    stride_ko_dim,
    stride_vo_layer,
    stride_vo_token,
    stride_vo_head,
    stride_vo_dim,
    stride_weight_layer,
    stride_weight_dim,
    stride_eps,
    stride_cos_layer,
    stride_cos_row,
    stride_cos_dim,
    stride_sin_layer,
    stride_sin_row,
    stride_sin_dim,
    stride_positions,
    stride_slots,
    num_slots,
    slots_per_batch,
    stride_ko_batch,
    stride_vo_batch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_EPS_TENSOR: tl.constexpr,
    EPS: tl.constexpr,
    USE_POSITIONS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COPY_V: tl.constexpr,
    NORM_WEIGHT_OFFSET: tl.constexpr,
    NORM_WEIGHT_IN_FLOAT32: tl.constexpr,
    NORM_ROUND_BEFORE_ROPE: tl.constexpr,
    NUM_OUT_BUFFERS: tl.constexpr,
    NUM_NORM_WEIGHTS: tl.constexpr,
    USE_SLOTS: tl.constexpr,
    K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_ROWS consecutive (token, head) rows of one layer.

    Grid: (cdiv(total_ctx * num_kv_heads, BLOCK_ROWS), n_layers). Every input element is loaded once, in
    contiguous (vectorizable) runs: the rotary dims as described below, the dims past rotary_dim as a
    pass-through tile of PASS_PAD columns (PASS_PAD = 0: none), V as a [BLOCK_ROWS, HEAD_PAD] tile.
    """
    HALF: tl.constexpr = ROTARY_DIM // 2
    kv_dtype = k_proj_ptr.dtype.element_ty  # round() rounds to it; outputs may be narrower (FP8 caches)
    layer = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    tokens = (rows // NUM_KV_HEADS).to(tl.int64)
    heads = (rows % NUM_KV_HEADS).to(tl.int64)
    k_rows = tokens * stride_k_token + layer * stride_k_layer + heads * stride_k_head

    # Outputs: one stacked tensor per K and V (layer strides), or one buffer per layer (a cache each, among
    # the pointer arguments; layer strides 0). With slots, token t goes to slot s = slots[t] of a
    # [batch, slots_per_batch, H, D] cache: (s // slots_per_batch, s % slots_per_batch); a slot outside
    # [0, num_slots) (-1: padding) is skipped, so nothing outside the cache is ever written.
    k_outs = (k_out_ptr, k_out1, k_out2, k_out3, k_out4, k_out5, k_out6, k_out7)
    v_outs = (v_out_ptr, v_out1, v_out2, v_out3, v_out4, v_out5, v_out6, v_out7)
    k_out_base = k_out_ptr
    v_out_base = v_out_ptr
    for i in tl.static_range(1, NUM_OUT_BUFFERS):
        k_out_base = tl.where(layer == i, k_outs[i], k_out_base)
        v_out_base = tl.where(layer == i, v_outs[i], v_out_base)
    row_mask = rows < num_rows
    if USE_SLOTS:
        slots = tl.load(slots_ptr + tokens * stride_slots, mask=row_mask, other=-1).to(tl.int64)
        row_mask = row_mask & (slots >= 0) & (slots < num_slots)
        batch = slots // slots_per_batch
        k_out_tokens = batch * stride_ko_batch + (slots % slots_per_batch) * stride_ko_token
    else:
        k_out_tokens = tokens * stride_ko_token
    k_out_rows = layer * stride_ko_layer + k_out_tokens + heads * stride_ko_head
    # Unscaled, K is rounded to kv's dtype (the output's); scaled, k / k_scale is computed from the float32
    # K and converted once to the output's dtype (an FP8 cache), as Inductor computes `(k / scale).to(fp8)`.
    k_out_dtype = kv_dtype
    if K_SCALED:
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        k_out_dtype = k_out_ptr.dtype.element_ty

    # Rotary part. neox: tiles x_a, x_b [BLOCK_ROWS, HALF_PAD] of the two contiguous halves, each element
    # beside its RoPE partner. Interleaved: one contiguous tile x_r [BLOCK_ROWS, 2 * HALF_PAD]; the partner
    # of element 2j / 2j+1 comes from reshaping it to pairs (which sit in one thread), so loads and stores
    # stay vectorized either way.
    ROT_PAD: tl.constexpr = 2 * HALF_PAD
    freq = tl.arange(0, HALF_PAD)
    rot_mask = row_mask[:, None] & (freq < HALF)[None, :]
    rot_dims = tl.arange(0, ROT_PAD)
    rot_dim_mask = rot_dims < ROTARY_DIM
    rot_full_mask = row_mask[:, None] & rot_dim_mask[None, :]
    if INTERLEAVED:
        x_r = tl.load(k_proj_ptr + k_rows[:, None] + rot_dims[None, :] * stride_k_elem, mask=rot_full_mask, other=0.0)
        x_r = x_r.to(tl.float32)
    else:
        x_a = tl.load(k_proj_ptr + k_rows[:, None] + freq[None, :] * stride_k_elem, mask=rot_mask, other=0.0)
        x_b = tl.load(k_proj_ptr + k_rows[:, None] + (HALF + freq[None, :]) * stride_k_elem, mask=rot_mask, other=0.0)
        x_a = x_a.to(tl.float32)
        x_b = x_b.to(tl.float32)
    if PASS_PAD > 0:
        dims_p = ROTARY_DIM + tl.arange(0, PASS_PAD)
        pass_dim_mask = dims_p < HEAD_DIM
        pass_mask = row_mask[:, None] & pass_dim_mask[None, :]
        x_p = tl.load(k_proj_ptr + k_rows[:, None] + dims_p[None, :] * stride_k_elem, mask=pass_mask, other=0.0)
        x_p = x_p.to(tl.float32)

    if HAS_NORM:
        if INTERLEAVED:
            sum_sq = tl.sum(x_r * x_r, axis=1)
        else:
            sum_sq = tl.sum(x_a * x_a, axis=1) + tl.sum(x_b * x_b, axis=1)
        if PASS_PAD > 0:
            sum_sq += tl.sum(x_p * x_p, axis=1)
        if HAS_EPS_TENSOR:
            eps = tl.load(eps_ptr + layer * stride_eps).to(tl.float32)
        else:
            eps = EPS
        inv_rms = tl.rsqrt(sum_sq / HEAD_DIM + eps)[:, None]
        # One [n_layers, head_dim] table (layer stride), or one pointer per layer (layer stride 0)
        norm_weights = (
            norm_weight_ptr, norm_weight1, norm_weight2, norm_weight3, norm_weight4, norm_weight5, norm_weight6,
            norm_weight7, norm_weight8, norm_weight9, norm_weight10, norm_weight11, norm_weight12, norm_weight13,
            norm_weight14, norm_weight15,
        )  # fmt: skip
        weight_base = norm_weight_ptr
        for i in tl.static_range(1, NUM_NORM_WEIGHTS):
            weight_base = tl.where(layer == i, norm_weights[i], weight_base)
        weight_row = weight_base + layer * stride_weight_layer
        # round(round(x * inv_rms) * w), the two roundings of `weight * hidden.to(input_dtype)`, or with
        # NORM_WEIGHT_IN_FLOAT32 round(x * inv_rms * w): x * inv_rms is then "rounded" to float32, a no-op.
        # Without NORM_ROUND_BEFORE_ROPE, (x * inv_rms * w) stays float32 too; only the final store rounds.
        normed_dtype = tl.float32 if NORM_WEIGHT_IN_FLOAT32 else kv_dtype
        weighted_dtype = kv_dtype if NORM_ROUND_BEFORE_ROPE else tl.float32
        if INTERLEAVED:
            w_r = tl.load(weight_row + rot_dims * stride_weight_dim, mask=rot_dim_mask, other=0.0)
            w_r = w_r.to(tl.float32) + NORM_WEIGHT_OFFSET
            x_r = ((x_r * inv_rms).to(normed_dtype).to(tl.float32) * w_r[None, :]).to(weighted_dtype).to(tl.float32)
        else:
            w_a = tl.load(weight_row + freq * stride_weight_dim, mask=freq < HALF, other=0.0)
            w_b = tl.load(weight_row + (HALF + freq) * stride_weight_dim, mask=freq < HALF, other=0.0)
            w_a = w_a.to(tl.float32) + NORM_WEIGHT_OFFSET
            w_b = w_b.to(tl.float32) + NORM_WEIGHT_OFFSET
            x_a = ((x_a * inv_rms).to(normed_dtype).to(tl.float32) * w_a[None, :]).to(weighted_dtype).to(tl.float32)
            x_b = ((x_b * inv_rms).to(normed_dtype).to(tl.float32) * w_b[None, :]).to(weighted_dtype).to(tl.float32)
        if PASS_PAD > 0:  # not rotated: the store rounds it either way
            w_p = tl.load(weight_row + dims_p * stride_weight_dim, mask=pass_dim_mask, other=0.0)
            w_p = w_p.to(tl.float32) + NORM_WEIGHT_OFFSET
            x_p = (x_p * inv_rms).to(normed_dtype).to(tl.float32) * w_p[None, :]

    if USE_POSITIONS:  # cache row: [cos_0 .. cos_{r/2-1}, sin_0 .. sin_{r/2-1}]
        positions = tl.load(positions_ptr + tokens * stride_positions, mask=row_mask, other=0).to(tl.int64)
        positions = tl.minimum(tl.maximum(positions, 0), cache_rows - 1)
        cos_row = cos_ptr + positions[:, None] * stride_cos_row
        sin_row = cos_row + HALF * stride_cos_dim
        sin_row_stride = stride_cos_dim
    else:  # per-token tables (per layer, or shared: layer stride 0): element i uses column i
        cos_row = cos_ptr + layer * stride_cos_layer + tokens[:, None] * stride_cos_row
        sin_row = sin_ptr + layer * stride_sin_layer + tokens[:, None] * stride_sin_row
        sin_row_stride = stride_sin_dim

    if INTERLEAVED:
        x_even, x_odd = tl.split(tl.reshape(x_r, [BLOCK_ROWS, HALF_PAD, 2]))
        partner = tl.reshape(tl.join(-x_odd, x_even), [BLOCK_ROWS, ROT_PAD])  # sign(i) * x[i ^ 1]
        if USE_POSITIONS:  # frequency j serves elements 2j and 2j+1
            cos_f = tl.load(cos_row + freq[None, :] * stride_cos_dim, mask=rot_mask, other=0.0).to(tl.float32)
            sin_f = tl.load(sin_row + freq[None, :] * sin_row_stride, mask=rot_mask, other=0.0).to(tl.float32)
            cos_r = tl.reshape(tl.join(cos_f, cos_f), [BLOCK_ROWS, ROT_PAD])
            sin_r = tl.reshape(tl.join(sin_f, sin_f), [BLOCK_ROWS, ROT_PAD])
        else:
            cos_r = tl.load(cos_row + rot_dims[None, :] * stride_cos_dim, mask=rot_full_mask, other=0.0)
            sin_r = tl.load(sin_row + rot_dims[None, :] * sin_row_stride, mask=rot_full_mask, other=0.0)
            cos_r = cos_r.to(tl.float32)
            sin_r = sin_r.to(tl.float32)
        out_r = x_r * cos_r + partner * sin_r
        if K_SCALED:
            out_r = out_r / k_scale
        tl.store(k_out_base + k_out_rows[:, None] + rot_dims[None, :] * stride_ko_dim, out_r.to(k_out_dtype), mask=rot_full_mask)
    else:
        cos_a = tl.load(cos_row + freq[None, :] * stride_cos_dim, mask=rot_mask, other=0.0).to(tl.float32)
        sin_a = tl.load(sin_row + freq[None, :] * sin_row_stride, mask=rot_mask, other=0.0).to(tl.float32)
        if USE_POSITIONS:  # both halves share a frequency
            cos_b = cos_a
            sin_b = sin_a
        else:
            cos_b = tl.load(cos_row + (HALF + freq[None, :]) * stride_cos_dim, mask=rot_mask, other=0.0)
            sin_b = tl.load(sin_row + (HALF + freq[None, :]) * sin_row_stride, mask=rot_mask, other=0.0)
            cos_b = cos_b.to(tl.float32)
            sin_b = sin_b.to(tl.float32)
        out_a = x_a * cos_a - x_b * sin_a
        out_b = x_b * cos_b + x_a * sin_b
        if K_SCALED:
            out_a = out_a / k_scale
            out_b = out_b / k_scale
        tl.store(k_out_base + k_out_rows[:, None] + freq[None, :] * stride_ko_dim, out_a.to(k_out_dtype), mask=rot_mask)
        tl.store(k_out_base + k_out_rows[:, None] + (HALF + freq[None, :]) * stride_ko_dim, out_b.to(k_out_dtype), mask=rot_mask)
    if PASS_PAD > 0:
        out_p = x_p
        if K_SCALED:
            out_p = out_p / k_scale
        tl.store(k_out_base + k_out_rows[:, None] + dims_p[None, :] * stride_ko_dim, out_p.to(k_out_dtype), mask=pass_mask)

    if COPY_V:
        dims = tl.arange(0, HEAD_PAD)
        v_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
        v_rows = tokens * stride_v_token + layer * stride_v_layer + heads * stride_v_head
        if USE_SLOTS:
            v_out_tokens = batch * stride_vo_batch + (slots % slots_per_batch) * stride_vo_token
        else:
            v_out_tokens = tokens * stride_vo_token
        v_out_rows = layer * stride_vo_layer + v_out_tokens + heads * stride_vo_head
        v = tl.load(v_proj_ptr + v_rows[:, None] + dims[None, :] * stride_v_elem, mask=v_mask)
        if V_SCALED:
            v = v.to(tl.float32) / tl.load(v_scale_ptr).to(tl.float32)
        tl.store(v_out_base + v_out_rows[:, None] + dims[None, :] * stride_vo_dim, v.to(v_out_ptr.dtype.element_ty), mask=v_mask)


# One kernel source, two front ends: compiled for GPU tensors, interpreted (numpy) for CPU tensors when
# TRITON_INTERPRET=1 is set at call time (`triton.jit` itself only looks at that variable at import).
fused_kv_materialize_kernel = triton.jit(_fused_kv_materialize_kernel)
fused_kv_materialize_kernel_interpreted = InterpretedFunction(_fused_kv_materialize_kernel)


@contextlib.contextmanager
def _interpretable_tl_sum():
    """Let the interpreter run `tl.sum`.

    `tl.sum` is itself a `@triton.jit` function, made interpretable only when TRITON_INTERPRET=1 was set
    before triton was imported; otherwise swap in an interpreted twin for the duration of the launch.
    """
    compiled_sum = tl.sum
    if isinstance(compiled_sum, InterpretedFunction):
        yield
        return
    tl.sum = InterpretedFunction(compiled_sum.fn)
    try:
        yield
    finally:
        tl.sum = compiled_sum


# The kernel's runtime (non-constexpr) parameters, in order.
_KERNEL_ARG_NAMES = tuple(
    name
    for name, parameter in inspect.signature(_fused_kv_materialize_kernel).parameters.items()
    if parameter.annotation not in (tl.constexpr, "tl.constexpr")
)


def _named(prefix: str, suffixes: Sequence, values: Sequence) -> dict:
    """{prefix + suffix: value}: a group of the kernel's arguments (strides, per-layer pointers) by name."""
    return {f"{prefix}{suffix}": value for suffix, value in zip(suffixes, values, strict=True)}


def _in_kernel_order(args: dict) -> list:
    """The kernel's runtime arguments in order, None for each one the launch does not read: a constexpr
    None, which the launchers skip (an output slot past the layer count; the cache's slots, scales and
    strides without a cache write; V's without a copy; the norm's without a norm; the per-token tables'
    with a cos/sin cache, the cache's without one)."""
    unknown = set(args) - set(_KERNEL_ARG_NAMES)
    if unknown:
        raise AssertionError(f"not arguments of the kernel: {sorted(unknown)}")
    return [args.get(name) for name in _KERNEL_ARG_NAMES]


def head_strides(proj: torch.Tensor, head_dim: int) -> tuple[int, int, int, int]:
    """(token, layer, head, element) strides of a projection, [T, L, H, D] or [T, L, H*D].

    The 3-D form is read as its 4-D view `proj.unflatten(-1, (H, D))`: the head stride is D element strides.
    Computed from the strides without building that view (no per-call view on the launch path).
    """
    if proj.dim() == 4:
        return proj.stride()
    stride_token, stride_layer, stride_elem = proj.stride()
    return stride_token, stride_layer, head_dim * stride_elem, stride_elem


def as_heads(proj: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """A [T, L, H, D] view of a projection given as [T, L, H, D] (returned as is) or [T, L, H*D]."""
    return proj if proj.dim() == 4 else proj.unflatten(-1, (num_kv_heads, head_dim))


def _table_strides(table: torch.Tensor) -> tuple[int, int, int]:
    """(layer, row, dim) strides of a [rows, r] table (layer stride 0: shared) or a [L, rows, r] one."""
    return table.stride() if table.dim() == 3 else (0, *table.stride())


def default_launch_config(rows_per_layer: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_ROWS, num_warps) for `rows_per_layer` = total_ctx * num_kv_heads rows of `head_dim`.

    About 4096 elements of K (and as many of V) per program, fewer rows when there are few (known sizes
    only); no autotuning,
    so the choice is a pure function of the shapes (safe under CUDA-graph capture and dynamic shapes).
    """
    head_pad = next_power_of_2(head_dim)
    block_rows = 4096 // head_pad
    if not isinstance(rows_per_layer, torch.SymInt):  # a symbolic size (traced, dynamic) keeps the full tile
        block_rows = max(1, min(block_rows, next_power_of_2(rows_per_layer)))
    num_warps = max(1, min(4, block_rows * head_pad // 1024))
    return block_rows, num_warps


FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def cache_view(cache: torch.Tensor, cache_dims: Sequence[int]) -> torch.Tensor:
    """The [batch, slots_per_batch, num_kv_heads, head_dim] view of a cache buffer: `cache_dims` names the
    buffer's dims in that order, with batch -1 for a buffer without one ([slots, H, D] in some order)."""
    if cache_dims[0] == -1:
        return cache.permute(list(cache_dims[1:])).unsqueeze(0)
    return cache.permute(list(cache_dims))


class CacheWrite(NamedTuple):
    """Where the kernel writes K and V instead of k_out / v_out: each layer's own caches.

    k_caches, v_caches  n_layers tensors each (the caches themselves, passed to the kernel as they are),
                        read through `cache_view(cache, cache_dims)` as [batch, slots_per_batch, num_kv_heads,
                        head_dim], any strides, one shape, stride set and dtype for all: kv's dtype, or an
                        FP8 dtype with a scale
    cache_dims          the caches' dims for (batch, slot, head, head_dim); batch -1 for [slots, H, D] caches
    slots               [total_ctx] int32/int64: token t goes to slot s = slots[t], i.e. cache[s // slots_per_batch,
                        s % slots_per_batch]; a slot outside [0, batch * slots_per_batch) (-1: padding) is skipped
    k_scale, v_scale    one-element float tensors or None: the value written is then k / scale, from K in
                        float32 (before its rounding to kv's dtype) and V as projected, converted once to the
                        cache's dtype
    """

    k_caches: Sequence[torch.Tensor]
    v_caches: Sequence[torch.Tensor]
    cache_dims: Sequence[int]
    slots: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


MAX_CACHES_PER_LAUNCH = 8  # per K and per V: the kernel's pointer arguments k_out, k_out1 .. k_out7
MAX_NORM_WEIGHTS_PER_LAUNCH = 16  # norm_weight_ptr, norm_weight1 .. norm_weight15


def norm_weight_pointers(norm_weight: NormWeight) -> list[torch.Tensor] | None:
    """The per-layer K-norm weights as the kernel's separate pointer arguments, or None where one
    [n_layers, head_dim] table is read instead (a table given; more layers than pointer arguments; weights
    whose element strides differ)."""
    if norm_weight is None or isinstance(norm_weight, torch.Tensor):
        return None
    weights = list(norm_weight)
    if len(weights) > MAX_NORM_WEIGHTS_PER_LAUNCH or len({w.stride() for w in weights}) > 1:
        return None
    return weights


def norm_weight_table(norm_weight: NormWeight, n_layers: int, head_dim: int) -> torch.Tensor | None:
    """[n_layers, head_dim]: a table as given, per-layer weights gathered (n_layers * head_dim elements;
    the parameters themselves are never moved)."""
    if norm_weight is None or isinstance(norm_weight, torch.Tensor):
        return norm_weight
    return torch.stack(list(norm_weight)).view(n_layers, head_dim)


def launch_fused_kv_materialize(
    k_proj: torch.Tensor,
    v_proj: torch.Tensor | None,
    norm_weight: NormWeight,
    eps: torch.Tensor | None,
    eps_value: float,
    cos: torch.Tensor,
    sin: torch.Tensor | None,
    positions: torch.Tensor | None,
    k_out: torch.Tensor | None,
    v_out: torch.Tensor | None,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    interleaved: bool,
    norm_weight_offset: float,
    norm_weight_in_float32: bool,
    norm_round_before_rope: bool,
    *,
    cache: CacheWrite | None = None,
    interpret: bool = False,
    traceable: bool = False,
    block_rows: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Run the Triton kernel on validated arguments, writing `k_out` (and `v_out` when `v_proj` is given),
    or with `cache`, each layer's K and V caches at the token's slots (k_out, v_out unused).

    k_proj, v_proj: [total_ctx, n_layers, num_kv_heads, head_dim] or [total_ctx, n_layers, num_kv_heads *
    head_dim] (v_proj like k_proj, or None), any strides. k_out, v_out: [n_layers, total_ctx, num_kv_heads,
    head_dim], any strides. norm_weight: a [n_layers, head_dim] table, n_layers tensors of [head_dim] (read
    where they are, as separate pointers, up to MAX_NORM_WEIGHTS_PER_LAUNCH; gathered into a table past
    that) or None (no K norm). eps: [n_layers] or None (use eps_value). positions None: `cos`, `sin` are
    per-token tables, [total_ctx, rotary_dim] shared by every layer or [n_layers, total_ctx, rotary_dim]
    one per layer (both the same rank); else `cos` is the cos/sin cache [max_pos, rotary_dim], `positions`
    [total_ctx] (any stride) and `sin` is ignored. The norm multiplies by norm_weight + norm_weight_offset,
    rounding once (norm_weight_in_float32) or twice (module docstring), and rounds the normalised K before
    RoPE unless `norm_round_before_rope` is False (float32 through RoPE; only meaningful with
    norm_weight_in_float32). `interpret` runs the kernel through Triton's
    interpreter (CPU tensors); `traceable` launches through `torch.library.wrap_triton`, so that tracing
    records the launch for Inductor. `block_rows` / `num_warps` override the launch heuristic (tuning only).
    Caches are written MAX_CACHES_PER_LAUNCH layers per launch.
    """
    total_ctx, n_layers = k_proj.shape[:2]
    num_rows = total_ctx * num_kv_heads
    if num_rows == 0 or n_layers == 0:
        return
    if num_rows > MAX_ROWS_PER_LAYER:
        raise ValueError(
            "Too many rows for fused KV materialization: "
            f"total_ctx * num_kv_heads = {num_rows} > {MAX_ROWS_PER_LAYER}."
        )
    default_rows, default_warps = default_launch_config(num_rows, head_dim)
    block_rows = block_rows or default_rows
    copy_v = v_proj is not None
    use_positions = positions is not None
    has_norm = norm_weight is not None
    has_eps_tensor = has_norm and eps is not None
    weight_pointers = norm_weight_pointers(norm_weight)
    if weight_pointers is None:
        norm_weight = norm_weight_table(norm_weight, n_layers, head_dim)
    meta = dict(
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        ROTARY_DIM=rotary_dim,
        HALF_PAD=next_power_of_2(rotary_dim // 2),
        PASS_PAD=next_power_of_2(head_dim - rotary_dim) if head_dim > rotary_dim else 0,
        HEAD_PAD=next_power_of_2(head_dim),
        BLOCK_ROWS=block_rows,
        HAS_NORM=has_norm,
        HAS_EPS_TENSOR=has_eps_tensor,
        EPS=float(eps_value) if has_norm and not has_eps_tensor else 0.0,
        USE_POSITIONS=use_positions,
        INTERLEAVED=interleaved,
        COPY_V=copy_v,
        NORM_WEIGHT_OFFSET=float(norm_weight_offset),
        NORM_WEIGHT_IN_FLOAT32=norm_weight_in_float32,
        NORM_ROUND_BEFORE_ROPE=norm_round_before_rope,
        USE_SLOTS=cache is not None,
        K_SCALED=cache is not None and cache.k_scale is not None,
        V_SCALED=cache is not None and copy_v and cache.v_scale is not None,
        num_warps=num_warps or default_warps,
    )
    if interpret:
        kernel = fused_kv_materialize_kernel_interpreted
    elif traceable:  # Triton launches on the tensors' device once Inductor runs it
        kernel = torch.library.wrap_triton(fused_kv_materialize_kernel)
    else:
        kernel = fused_kv_materialize_kernel

    def launch(first: int, count: int, k_outs: list, v_outs: list, out_strides: tuple, slot_args: tuple) -> None:
        layers = slice(first, first + count)
        per_layer_cos = cos.dim() == 3 and not use_positions
        args = dict(
            k_proj_ptr=k_proj[:, layers],
            num_rows=num_rows,
            **_named("stride_k_", ("token", "layer", "head", "elem"), head_strides(k_proj, head_dim)),
            **_named("k_out", ["_ptr", *range(1, len(k_outs))], k_outs),
            **_named("stride_ko_", ("layer", "token", "head", "dim"), out_strides[:4]),
            cos_ptr=cos[layers] if per_layer_cos else cos,
            **_named("stride_cos_", ("layer", "row", "dim"), _table_strides(cos)),
        )
        if copy_v:
            args.update(v_proj_ptr=v_proj[:, layers])
            args.update(_named("stride_v_", ("token", "layer", "head", "elem"), head_strides(v_proj, head_dim)))
            args.update(_named("v_out", ["_ptr", *range(1, len(v_outs))], v_outs))
            args.update(_named("stride_vo_", ("layer", "token", "head", "dim"), out_strides[4:]))
        num_norm_weights = 1
        if weight_pointers is not None:
            weights = weight_pointers[layers]
            num_norm_weights = len(weights)
            args.update(_named("norm_weight", ["_ptr", *range(1, num_norm_weights)], weights))
            args.update(stride_weight_layer=0, stride_weight_dim=weights[0].stride(0))
        elif has_norm:
            args.update(norm_weight_ptr=norm_weight[layers])
            args.update(_named("stride_weight_", ("layer", "dim"), norm_weight.stride()))
        if has_eps_tensor:
            args.update(eps_ptr=eps[layers], stride_eps=eps.stride(0))
        if use_positions:
            args.update(positions_ptr=positions, stride_positions=positions.stride(0), cache_rows=cos.shape[0])
            del args["stride_cos_layer"]
        else:
            args.update(sin_ptr=sin[layers] if per_layer_cos else sin)
            args.update(_named("stride_sin_", ("layer", "row", "dim"), _table_strides(sin)))
        if cache is not None:
            stride_slots, num_slots, slots_per_batch, stride_ko_batch, stride_vo_batch = slot_args
            args.update(slots_ptr=cache.slots, stride_slots=stride_slots, num_slots=num_slots)
            args.update(slots_per_batch=slots_per_batch, stride_ko_batch=stride_ko_batch)
            if copy_v:
                args.update(stride_vo_batch=stride_vo_batch)
            if meta["K_SCALED"]:
                args.update(k_scale_ptr=cache.k_scale)
            if meta["V_SCALED"]:
                args.update(v_scale_ptr=cache.v_scale)
        grid = (ceil_div(num_rows, block_rows), count)
        kernel[grid](*_in_kernel_order(args), **meta, NUM_OUT_BUFFERS=len(k_outs), NUM_NORM_WEIGHTS=num_norm_weights)

    with contextlib.ExitStack() as stack:
        if interpret:
            stack.enter_context(_interpretable_tl_sum())
        elif not traceable and k_proj.device.index != torch.cuda.current_device():
            stack.enter_context(torch.cuda.device(k_proj.device))  # Triton launches on the current device
        if cache is None:
            v_out = v_out if copy_v else k_out
            launch(0, n_layers, [k_out], [v_out], (*k_out.stride(), *v_out.stride()), (0, 0, 0, 0, 0))
            return
        k_cache = cache_view(cache.k_caches[0], cache.cache_dims)
        v_cache = cache_view(cache.v_caches[0] if copy_v else cache.k_caches[0], cache.cache_dims)
        batch, per_batch = k_cache.shape[:2]
        k_batch, k_slot, k_head, k_dim = k_cache.stride()
        v_batch, v_slot, v_head, v_dim = v_cache.stride()
        slot_args = (cache.slots.stride(0), batch * per_batch, per_batch, k_batch, v_batch)
        strides = (0, k_slot, k_head, k_dim, 0, v_slot, v_head, v_dim)
        for first in range(0, n_layers, MAX_CACHES_PER_LAUNCH):
            count = min(MAX_CACHES_PER_LAUNCH, n_layers - first)
            k_outs = list(cache.k_caches[first : first + count])
            v_outs = list(cache.v_caches[first : first + count]) if copy_v else k_outs
            launch(first, count, k_outs, v_outs, strides, slot_args)


def _rope_cos_sin(
    cos: torch.Tensor,
    sin: torch.Tensor | None,
    positions: torch.Tensor | None,
    rotary_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 (cos, sin), each [total_ctx, 1, 1, rotary_dim] (shared by every layer) or [total_ctx, n_layers,
    1, rotary_dim] (per-layer tables), indexed by the element i of a head; broadcasts over [T, L, H, r]."""
    if positions is None:
        if cos.dim() == 3:  # [L, T, r] -> [T, L, 1, r]
            return cos.float().transpose(0, 1).unsqueeze(2), sin.float().transpose(0, 1).unsqueeze(2)
        return cos.float()[:, None, None, :], sin.float()[:, None, None, :]
    half = rotary_dim // 2
    rows = cos[positions.long().clamp(0, cos.shape[0] - 1)].float()
    cos_freq, sin_freq = rows[:, :half], rows[:, half:rotary_dim]
    if interleaved:
        cos_t, sin_t = cos_freq.repeat_interleave(2, dim=-1), sin_freq.repeat_interleave(2, dim=-1)
    else:
        cos_t, sin_t = torch.cat([cos_freq, cos_freq], dim=-1), torch.cat([sin_freq, sin_freq], dim=-1)
    return cos_t[:, None, None, :], sin_t[:, None, None, :]


def _rotate_partner(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """sign(i) * x[partner(i)] over the last dim (the rotary part of a head)."""
    if interleaved:
        return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def materialized_k_torch(
    k_proj: torch.Tensor,
    norm_weight: NormWeight,
    eps: torch.Tensor | None,
    eps_value: float,
    cos: torch.Tensor,
    sin: torch.Tensor | None,
    positions: torch.Tensor | None,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    interleaved: bool,
    norm_weight_offset: float,
    norm_weight_in_float32: bool,
    norm_round_before_rope: bool,
    round_output: bool = True,
) -> torch.Tensor:
    """The kernel's K math in PyTorch (all layers at once): a [n_layers, total_ctx, H, D] view in k_proj's
    dtype (float32, unrounded, with round_output=False). Arguments as for `launch_fused_kv_materialize`."""
    n_layers = k_proj.shape[1]
    kv_dtype = k_proj.dtype
    k = as_heads(k_proj, num_kv_heads, head_dim).float()  # [T, L, H, D]
    norm_weight = norm_weight_table(norm_weight, n_layers, head_dim)
    if norm_weight is not None:
        eps_per_layer = eps.float().view(1, n_layers, 1, 1) if eps is not None else eps_value
        inv_rms = torch.rsqrt(k.square().mean(dim=-1, keepdim=True) + eps_per_layer)
        weight = norm_weight.float().view(1, n_layers, 1, head_dim) + norm_weight_offset
        normed = k * inv_rms
        if not norm_weight_in_float32:
            normed = normed.to(kv_dtype).float()
        k = normed * weight
        if norm_round_before_rope:
            k = k.to(kv_dtype).float()
    cos_t, sin_t = _rope_cos_sin(cos, sin, positions, rotary_dim, interleaved)
    rot = k[..., :rotary_dim]
    rotated = rot * cos_t + _rotate_partner(rot, interleaved) * sin_t
    k = torch.cat([rotated, k[..., rotary_dim:]], dim=-1)
    return (k.to(kv_dtype) if round_output else k).transpose(0, 1)


def fused_kv_materialize_torch(
    k_proj: torch.Tensor,
    v_proj: torch.Tensor | None,
    norm_weight: NormWeight,
    eps: torch.Tensor | None,
    eps_value: float,
    cos: torch.Tensor,
    sin: torch.Tensor | None,
    positions: torch.Tensor | None,
    k_out: torch.Tensor,
    v_out: torch.Tensor | None,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    interleaved: bool,
    norm_weight_offset: float,
    norm_weight_in_float32: bool,
    norm_round_before_rope: bool,
    *,
    cache: CacheWrite | None = None,
) -> None:
    """The kernel's math in PyTorch, same arguments as `launch_fused_kv_materialize`, written into k_out/v_out
    or the caches."""
    k = materialized_k_torch(
        k_proj, norm_weight, eps, eps_value, cos, sin, positions, num_kv_heads, head_dim, rotary_dim,
        interleaved, norm_weight_offset, norm_weight_in_float32, norm_round_before_rope,
        round_output=cache is None or cache.k_scale is None,
    )  # fmt: skip
    v = as_heads(v_proj, num_kv_heads, head_dim).transpose(0, 1) if v_proj is not None else None
    if cache is not None:
        write_caches_torch(k, v, cache)
        return
    k_out.copy_(k)
    if v is not None:
        v_out.copy_(v)


def write_caches_torch(k: torch.Tensor, v: torch.Tensor, cache: CacheWrite) -> None:
    """The kernel's cache write in PyTorch: k, v [n_layers, total_ctx, H, D] (kv's dtype; k in float32 when
    scaled) into each layer's [batch, slots_per_batch, H, D] cache view at the tokens' slots (other slots
    skipped), divided by the scale in float32 when there is one.

    Every shape is static, so Inductor compiles it (C++ on CPU): a token whose slot lies outside the cache is
    written, instead, where the first in-cache token goes and with that token's value (when no token is in
    the cache: at slot 0 with what slot 0 holds), which leaves the cache exactly as skipping it would."""
    if cache.slots.numel() == 0:  # no token, nothing to write (and no first token to stand in)
        return
    batch, per_batch = cache_view(cache.k_caches[0], cache.cache_dims).shape[:2]
    slots = cache.slots.long()
    valid = (slots >= 0) & (slots < batch * per_batch)
    any_valid = valid.any()
    first_valid = torch.argmax(valid.to(torch.int32)).reshape(1)  # a tensor index: no host sync
    stand_in = torch.where(any_valid, slots[first_valid], 0)  # [1]
    target = torch.where(valid, slots, stand_in)
    rows, stand_in_row = (target // per_batch, target % per_batch), (stand_in // per_batch, stand_in % per_batch)
    for values, caches, scale in ((k, cache.k_caches, cache.k_scale), (v, cache.v_caches, cache.v_scale)):
        for layer, target_cache in enumerate(caches):
            view = cache_view(target_cache, cache.cache_dims)
            value = values[layer]
            if scale is not None:
                value = value.float() / scale.float().reshape(())
            # select before converting: Inductor selects no FP8 values; FP8 -> float32 -> FP8 is exact
            work = torch.float32 if view.dtype in FP8_CACHE_DTYPES else torch.promote_types(value.dtype, view.dtype)
            value = value.to(work)
            held = view[stand_in_row].to(work)
            filler = torch.where(any_valid, value[first_valid], held)  # [1, H, D]
            value = torch.where(valid[:, None, None], value, filler)
            view.index_put_(rows, value.to(view.dtype))