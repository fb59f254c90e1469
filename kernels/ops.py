"""`torch.library` ops for stacked K/V materialization, their validation, and a drop-in wrapper.

Ops (namespace `fx_fusion`), all backed by one kernel (`fused_kv_materialize.py`). Common leading arguments:

    k_proj         [total_ctx, n_layers, num_kv_heads*head_dim], any strides (a view of a grouped GEMM output),
                   or [total_ctx, n_layers, num_kv_heads, head_dim], any strides (heads need not be adjacent:
                   e.g. the K heads of a QKV output laid out per query group); the 3-D form is read as its
                   view `k_proj.unflatten(-1, (num_kv_heads, head_dim))`
    k_norm_weight  [] (no K norm), [w] with w [n_layers, head_dim], or n_layers tensors of [head_dim]
    eps            [n_layers] float tensor (per-layer eps, read on device), or None to use eps_value
    eps_value      float
    cos            positions None: per-token cos [total_ctx, rotary_dim] (Hugging Face layout, shared by every
                   layer) or [n_layers, total_ctx, rotary_dim] (one table per layer), any strides;
                   positions given: cos_sin_cache [max_pos, rotary_dim] (cos in the first half, sin after,
                   shared by every layer)
    sin            per-token sin shaped like cos (the same rank) when positions is None, else None
    positions      [total_ctx] int32/int64 rows of cos_sin_cache, or None
    num_kv_heads, head_dim, rotary_dim: int
    interleaved    False: neox "rotate half"; True: GPT-J pairs (2i, 2i+1)
    norm_weight_offset      float: the K norm multiplies by (norm_weight_offset + weight); Gemma uses 1.0
    norm_weight_in_float32  bool: False rounds twice, round(round(x * inv_rms) * w) (Hugging Face Llama/Qwen3);
                            True once, round(x * inv_rms * w) in float32 (SGLang's native RMSNorm, Gemma)
    norm_round_before_rope  bool: True rounds the normalised K to the output dtype before RoPE (all of the
                            above); False keeps x * inv_rms * w in float32 through RoPE and rounds once at the
                            end, round(rope(x * inv_rms * w)) (SGLang's reference math for the stacked layout).
                            False needs norm_weight_in_float32=True (ValueError otherwise); no effect without a norm

    materialize_k(<common>, token_major=False) -> k_out      token_major: k_out is the transpose of a contiguous
                                                            [total_ctx, n_layers, num_kv_heads, head_dim]
    materialize_kv(<common>, v_proj) -> (k_out, v_out)          v_proj: k_proj's shape (3-D or 4-D), any strides
    materialize_kv_out(<common>, v_proj, k_out, v_out) -> None  writes k_out, v_out in place
    materialize_kv_to_cache(<common>, v_proj, k_caches, v_caches, slots, cache_dims, k_scale, v_scale) -> None
        writes layer l's K and V into k_caches[l], v_caches[l] (mutated in place; any layout, named by
        cache_dims = the caches' dims for (batch, slot, head, head_dim), batch -1 for [slots, H, D] ones) at
        each token's slot s = slots[t] (cache[s // slots_per_batch, s % slots_per_batch]; slots outside the
        cache, e.g. -1, are skipped); FP8 caches (float8_e4m3fn / e5m2) need one-element scales: k / k_scale
        from float32 K, v / v_scale, converted once (fused_kv_materialize.CacheWrite)

k_out, v_out: [n_layers, total_ctx, num_kv_heads, head_dim] in k_proj's dtype (fresh and contiguous from the
functional ops; any strides for the out= op). On CUDA the Triton kernel runs; on CPU the PyTorch
implementation of the same math, or the Triton kernel through the interpreter when the environment
variable TRITON_INTERPRET is "1" at call time.

`fused_norm_rope_stacked` has the signature and semantics of SGLang's stacked fused K/V helper
(`kv` [total_ctx, n_layers, kv_size*2], cos_sin_cache + positions), raises the same ValueErrors in the same
order, and adds `interleaved`, `k_norm_weight=None`, `check_positions` and the three K-norm options.
"""

import functools
import math
import os
from typing import NamedTuple, Optional, Sequence

import torch

from .fused_kv_materialize import (
    FP8_CACHE_DTYPES,
    CacheWrite,
    NormWeight,
    cache_view,
    fused_kv_materialize_torch,
    launch_fused_kv_materialize,
    materialized_k_torch,
)

SUPPORTED_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED_POSITION_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------------------
# Validation (shared by the drop-in, the real kernels and the fake kernels; shapes only, no host sync)
# --------------------------------------------------------------------------------------------------------


def check_stacked_kv_rank(kv: torch.Tensor) -> None:
    """kv must be 3-D [total_ctx, n_layers, kv_size*2]."""
    if kv.dim() != 3:
        raise ValueError(
            "Invalid stacked fused KV projection shape: "
            f"got {tuple(kv.shape)}, expected 3D [total_ctx, n_layers, kv_size*2]."
        )


def check_stacked_kv_width(kv: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """kv's trailing dim must hold K then V of every head: 2 * num_kv_heads * head_dim."""
    kv_size = num_kv_heads * head_dim
    if kv.shape[-1] != kv_size * 2:
        raise ValueError(
            "Invalid fused KV projection shape: "
            f"got {tuple(kv.shape)}, expected trailing dim {kv_size * 2}."
        )


def _check_projections(
    k_proj: torch.Tensor, v_proj: Optional[torch.Tensor], num_kv_heads: int, head_dim: int
) -> None:
    if k_proj.dim() not in (3, 4):
        raise ValueError(
            "Invalid stacked fused KV projection shape: "
            f"got {tuple(k_proj.shape)}, expected 3D [total_ctx, n_layers, kv_size] or "
            "4D [total_ctx, n_layers, num_kv_heads, head_dim] for k_proj."
        )
    if k_proj.dim() == 3 and k_proj.shape[-1] != num_kv_heads * head_dim:
        raise ValueError(
            "Invalid fused KV projection shape: "
            f"got {tuple(k_proj.shape)}, expected trailing dim {num_kv_heads * head_dim} for k_proj."
        )
    if k_proj.dim() == 4 and (k_proj.shape[2] != num_kv_heads or k_proj.shape[3] != head_dim):
        raise ValueError(
            "Invalid fused KV projection shape: "
            f"got {tuple(k_proj.shape)}, expected trailing dims (num_kv_heads, head_dim) = "
            f"{(num_kv_heads, head_dim)} for a 4D k_proj."
        )
    if v_proj is not None and tuple(v_proj.shape) != tuple(k_proj.shape):
        raise ValueError(
            "Invalid fused KV projection shape: "
            f"got v_proj {tuple(v_proj.shape)}, expected {tuple(k_proj.shape)} (the k_proj shape)."
        )


def _check_head_layout(num_kv_heads: int, head_dim: int, rotary_dim: int) -> None:
    if num_kv_heads <= 0 or head_dim <= 0:
        raise ValueError(
            "Invalid fused KV head layout: "
            f"num_kv_heads={num_kv_heads}, head_dim={head_dim}; both must be positive."
        )
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2 != 0:
        raise ValueError(
            "Invalid fused KV rotary/head dim pair: "
            f"rotary_dim={rotary_dim}, head_dim={head_dim}."
        )


def _check_scalars(
    eps_value: float, norm_weight_offset: float, norm_weight_in_float32: bool, norm_round_before_rope: bool
) -> None:
    if not math.isfinite(eps_value) or eps_value < 0:
        raise ValueError(
            f"Invalid eps_value for fused KV materialization: got {eps_value}, expected a finite float >= 0."
        )
    if not math.isfinite(norm_weight_offset):
        raise ValueError(
            f"Invalid norm_weight_offset for fused KV materialization: got {norm_weight_offset}, "
            "expected a finite float."
        )
    if not norm_round_before_rope and not norm_weight_in_float32:
        raise ValueError(
            "Invalid K-norm rounding options for fused KV materialization: norm_round_before_rope=False (keep "
            "the normalised K in float32 through RoPE) needs norm_weight_in_float32=True, got "
            "norm_weight_in_float32=False."
        )


def _norm_weight_shape(k_norm_weight: Sequence[torch.Tensor]) -> tuple:
    """The [n_layers, head_dim] shape the weights stack to (or a description of what was given)."""
    if len(k_norm_weight) == 1 and k_norm_weight[0].dim() == 2:
        return tuple(k_norm_weight[0].shape)
    shapes = [tuple(w.shape) for w in k_norm_weight]
    if len(shapes[0]) == 1 and all(shape == shapes[0] for shape in shapes):
        return (len(shapes), *shapes[0])
    return tuple(shapes)


def _check_norm_and_eps(
    k_norm_weight: Sequence[torch.Tensor], eps: Optional[torch.Tensor], n_layers: int, head_dim: int
) -> None:
    if k_norm_weight:
        got = _norm_weight_shape(k_norm_weight)
        if got != (n_layers, head_dim):
            raise ValueError(
                "Invalid stacked k_norm_weight shape for fused KV materialization: "
                f"got {got}, expected {(n_layers, head_dim)}."
            )
    if eps is not None and tuple(eps.shape) != (n_layers,):
        raise ValueError(
            "Invalid stacked eps shape for fused KV materialization: "
            f"got {tuple(eps.shape)}, expected {(n_layers,)}."
        )


def _check_output(name: str, out: Optional[torch.Tensor], expected_shape: tuple, like: torch.Tensor) -> None:
    if out is None:
        return
    if tuple(out.shape) != expected_shape:
        raise ValueError(
            f"Invalid {name} shape for fused KV materialization: "
            f"got {tuple(out.shape)}, expected {expected_shape}."
        )
    if out.device != like.device or out.dtype != like.dtype:
        raise ValueError(
            f"Invalid {name} device/dtype for fused KV materialization: "
            f"got device={out.device}, dtype={out.dtype}, expected device={like.device}, dtype={like.dtype}."
        )


def _check_dtypes_and_devices(
    k_proj: torch.Tensor,
    v_proj: Optional[torch.Tensor],
    k_norm_weight: Sequence[torch.Tensor],
    eps: Optional[torch.Tensor],
    cos: torch.Tensor,
    sin: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
) -> None:
    if k_proj.dtype not in SUPPORTED_KV_DTYPES:
        raise ValueError(
            f"Unsupported KV projection dtype for fused KV materialization: got {k_proj.dtype}, "
            "expected torch.bfloat16, torch.float16 or torch.float32."
        )
    if v_proj is not None and v_proj.dtype != k_proj.dtype:
        raise ValueError(
            f"Mismatched v_proj dtype for fused KV materialization: got {v_proj.dtype}, expected {k_proj.dtype}."
        )
    named = [("v_proj", v_proj), ("eps", eps), ("cos", cos), ("sin", sin), ("positions", positions)]
    named += [(f"k_norm_weight[{i}]", w) for i, w in enumerate(k_norm_weight)]
    for name, tensor in named:
        if tensor is not None and tensor.device != k_proj.device:
            raise ValueError(
                f"Device mismatch for fused KV materialization: {name} is on {tensor.device}, "
                f"expected {k_proj.device} (the projection's device)."
            )
    floating = [("eps", eps), ("cos", cos), ("sin", sin)]
    floating += [(f"k_norm_weight[{i}]", w) for i, w in enumerate(k_norm_weight)]
    for name, tensor in floating:
        if tensor is not None and not tensor.dtype.is_floating_point:
            raise ValueError(
                f"Unsupported {name} dtype for fused KV materialization: got {tensor.dtype}, expected a floating dtype."
            )
    if len({w.dtype for w in k_norm_weight}) > 1:
        raise ValueError(
            "Mismatched k_norm_weight dtypes for fused KV materialization: "
            f"got {[w.dtype for w in k_norm_weight]}, expected one dtype."
        )
    if positions is not None and positions.dtype not in SUPPORTED_POSITION_DTYPES:
        raise ValueError(
            f"Unsupported positions dtype for fused KV materialization: got {positions.dtype}, "
            "expected torch.int32 or torch.int64."
        )


def _check_rope_tables(
    cos: torch.Tensor,
    sin: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    n_layers: int,
    total_ctx: int,
    rotary_dim: int,
) -> None:
    if positions is None:
        if sin is None:
            raise ValueError(
                "Missing sin for fused KV materialization: per-token cos/sin (positions=None) need both tables."
            )
        shared, per_layer = (total_ctx, rotary_dim), (n_layers, total_ctx, rotary_dim)
        for name, table in (("cos", cos), ("sin", sin)):
            if tuple(table.shape) != (shared if table.dim() == 2 else per_layer):
                raise ValueError(
                    f"Invalid per-token {name} shape for fused KV materialization: got {tuple(table.shape)}, "
                    f"expected {shared} (shared by every layer) or {per_layer} (one table per layer)."
                )
        if cos.dim() != sin.dim():
            raise ValueError(
                "Mismatched per-token cos/sin shapes for fused KV materialization: "
                f"got cos {tuple(cos.shape)} and sin {tuple(sin.shape)}, expected both {shared} (shared by every "
                f"layer) or both {per_layer} (one table per layer)."
            )
        return
    if sin is not None:
        raise ValueError(
            "Unexpected sin for fused KV materialization: with positions, cos is the cos_sin_cache "
            "[max_pos, rotary_dim] and sin must be None."
        )
    if cos.dim() != 2 or cos.shape[0] == 0 or cos.shape[1] != rotary_dim:
        raise ValueError(
            "Invalid cos_sin_cache shape for fused KV materialization: "
            f"got {tuple(cos.shape)}, expected (max_pos >= 1, {rotary_dim})."
        )
    if tuple(positions.shape) != (total_ctx,):
        raise ValueError(
            "Invalid positions shape for fused KV materialization: "
            f"got {tuple(positions.shape)}, expected {(total_ctx,)}."
        )


def _memory_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of the memory that `tensor`'s elements lie in."""
    start = tensor.data_ptr()
    last_element = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (last_element + 1) * tensor.element_size()


def _may_share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` share an element: the same first element, or intersecting spans where one of them
    is dense (fills its span). Interleaved strided views, such as the K and V halves of one buffer, pass."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a_start, a_end), (b_start, b_end) = _memory_span(a), _memory_span(b)
    if a_start == b_start:
        return True
    dense = a_end - a_start == a.numel() * a.element_size() or b_end - b_start == b.numel() * b.element_size()
    return dense and a_start < b_end and b_start < a_end


def _check_outputs_do_not_overlap(outputs: dict, inputs: dict) -> None:
    """Outputs must not share memory with each other or with any input (real tensors only)."""
    outputs = {name: t for name, t in outputs.items() if t is not None}
    if any(t.is_meta or torch._subclasses.fake_tensor.is_fake(t) for t in outputs.values()):
        return  # no memory to share
    if len(outputs) == 2 and _may_share_memory(*outputs.values()):
        raise ValueError("Overlapping outputs for fused KV materialization: k_out and v_out share memory.")
    for out_name, out in outputs.items():
        for in_name, tensor in inputs.items():
            if tensor is not None and _may_share_memory(out, tensor):
                raise ValueError(
                    f"Overlapping {out_name} for fused KV materialization: it shares memory with the input {in_name}."
                )


def validate_materialize_args(
    k_proj: torch.Tensor,
    k_norm_weight: Sequence[torch.Tensor],
    eps: Optional[torch.Tensor],
    eps_value: float,
    cos: torch.Tensor,
    sin: Optional[torch.Tensor],
    positions: Optional[torch.Tensor],
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    norm_weight_offset: float,
    norm_weight_in_float32: bool,
    norm_round_before_rope: bool,
    v_proj: Optional[torch.Tensor] = None,
    k_out: Optional[torch.Tensor] = None,
    v_out: Optional[torch.Tensor] = None,
) -> None:
    """Raise ValueError for any argument the kernel cannot handle; reads shapes, dtypes, devices and addresses.

    Order: head layout / rotary pair, projection shapes, k_norm_weight, eps, k_out, v_out, then dtypes,
    devices, the cos/sin/positions tables, eps_value / norm_weight_offset / the rounding options and, for
    real outputs, memory
    overlap (k_out with v_out, then outputs with inputs). Works on fake tensors and symbolic shapes.
    """
    _check_head_layout(num_kv_heads, head_dim, rotary_dim)
    _check_projections(k_proj, v_proj, num_kv_heads, head_dim)
    total_ctx, n_layers = k_proj.shape[:2]
    _check_norm_and_eps(k_norm_weight, eps, n_layers, head_dim)
    expected_out_shape = (n_layers, total_ctx, num_kv_heads, head_dim)
    _check_output("k_out", k_out, expected_out_shape, k_proj)
    _check_output("v_out", v_out, expected_out_shape, k_proj)
    _check_dtypes_and_devices(k_proj, v_proj, k_norm_weight, eps, cos, sin, positions)
    _check_rope_tables(cos, sin, positions, n_layers, total_ctx, rotary_dim)
    _check_scalars(eps_value, norm_weight_offset, norm_weight_in_float32, norm_round_before_rope)
    inputs = {"k_proj": k_proj, "v_proj": v_proj, "eps": eps, "cos": cos, "sin": sin, "positions": positions}
    inputs.update((f"k_norm_weight[{i}]", w) for i, w in enumerate(k_norm_weight))
    _check_outputs_do_not_overlap({"k_out": k_out, "v_out": v_out}, inputs)


def check_positions_in_cache(positions: torch.Tensor, cache_rows: int) -> None:
    """Eager-only range check of positions against the cos_sin_cache (one host sync)."""
    if positions.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(positions)).tolist()
    if low < 0 or high >= cache_rows:
        raise ValueError(
            "Positions out of range of the cos_sin_cache for fused KV materialization: "
            f"got min={low}, max={high}, expected 0 <= position < {cache_rows}."
        )


def _check_cache_dims(cache: torch.Tensor, cache_dims: Sequence[int]) -> None:
    dims = list(cache_dims)
    named = dims[1:] if len(dims) == 4 and dims[0] == -1 else dims
    if len(dims) != 4 or sorted(named) != list(range(cache.dim())):
        raise ValueError(
            "Invalid cache_dims for the fused KV cache write: "
            f"got {dims} for a {cache.dim()}-D cache, expected the cache's dims for (batch, slot, head, head_dim), "
            "a permutation of its 4 dims, or -1 then a permutation of its 3 dims."
        )


def _check_caches(
    name: str, caches: Sequence[torch.Tensor], cache_dims: Sequence[int], n_layers: int, num_kv_heads: int,
    head_dim: int, kv: torch.Tensor, scale: Optional[torch.Tensor],
) -> None:  # fmt: skip
    if len(caches) != n_layers:
        raise ValueError(
            f"Invalid {name} for the fused KV cache write: got {len(caches)} caches, expected {n_layers} (one per layer)."
        )
    for cache in caches:
        _check_cache_dims(cache, cache_dims)
    views = [cache_view(c, cache_dims) for c in caches]
    first = views[0]
    if tuple(first.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"Invalid {name} shape for the fused KV cache write: got heads and head_dim {tuple(first.shape[2:])} "
            f"(cache {tuple(caches[0].shape)}, cache_dims {list(cache_dims)}), expected {(num_kv_heads, head_dim)}."
        )
    for i, view in enumerate(views):
        if view.shape != first.shape or view.stride() != first.stride() or view.dtype != first.dtype:
            raise ValueError(
                f"Mismatched {name}[{i}] for the fused KV cache write: every layer's cache needs the shape, strides "
                f"and dtype of {name}[0] {tuple(caches[0].shape)}, {caches[0].stride()}, {caches[0].dtype}."
            )
        if view.device != kv.device:
            raise ValueError(f"Device mismatch for the fused KV cache write: {name}[{i}] is on {view.device}, expected {kv.device}.")
    if first.dtype not in (kv.dtype, *FP8_CACHE_DTYPES):
        raise ValueError(
            f"Unsupported {name} dtype for the fused KV cache write: got {first.dtype}, expected the projection's "
            f"dtype {kv.dtype}, torch.float8_e4m3fn or torch.float8_e5m2."
        )
    if first.dtype in FP8_CACHE_DTYPES and scale is None:
        raise ValueError(f"Missing scale for the fused KV cache write: FP8 {name} need a per-tensor scale.")
    if scale is not None and (scale.numel() != 1 or not scale.dtype.is_floating_point or scale.device != kv.device):
        raise ValueError(
            f"Invalid scale for the fused KV cache write to {name}: got {tuple(scale.shape)} {scale.dtype} on "
            f"{scale.device}, expected one floating element on {kv.device}."
        )


def validate_cache_write(
    k_proj: torch.Tensor, v_proj: torch.Tensor, num_kv_heads: int, head_dim: int, k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor], slots: torch.Tensor, cache_dims: Sequence[int],
    k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
) -> None:  # fmt: skip
    """Raise ValueError for caches, slots or scales the kernel cannot write (after validate_materialize_args)."""
    total_ctx, n_layers = k_proj.shape[:2]
    _check_caches("k_caches", k_caches, cache_dims, n_layers, num_kv_heads, head_dim, k_proj, k_scale)
    _check_caches("v_caches", v_caches, cache_dims, n_layers, num_kv_heads, head_dim, v_proj, v_scale)
    if tuple(slots.shape) != (total_ctx,) or slots.dtype not in SUPPORTED_POSITION_DTYPES or slots.device != k_proj.device:
        raise ValueError(
            f"Invalid slots for the fused KV cache write: got {tuple(slots.shape)} {slots.dtype} on {slots.device}, "
            f"expected {(total_ctx,)} torch.int32 or torch.int64 on {k_proj.device}."
        )
    caches = {f"k_caches[{i}]": c for i, c in enumerate(k_caches)}
    caches.update((f"v_caches[{i}]", c) for i, c in enumerate(v_caches))
    inputs = {"k_proj": k_proj, "v_proj": v_proj, "slots": slots, "k_scale": k_scale, "v_scale": v_scale}
    if any(t.is_meta or torch._subclasses.fake_tensor.is_fake(t) for t in caches.values()):
        return
    names = list(caches)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if _may_share_memory(caches[a], caches[b]):
                raise ValueError(f"Overlapping caches for the fused KV cache write: {a} and {b} share memory.")
        for in_name, tensor in inputs.items():
            if tensor is not None and _may_share_memory(caches[a], tensor):
                raise ValueError(f"Overlapping {a} for the fused KV cache write: it shares memory with the input {in_name}.")


def _host_sync_allowed(tensor: torch.Tensor) -> bool:
    """False for meta tensors, while tracing (torch.compile / export / fake tensors) or capturing a CUDA graph."""
    if tensor.is_meta or torch.compiler.is_compiling() or torch._subclasses.fake_tensor.is_fake(tensor):
        return False
    return not (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


# --------------------------------------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------------------------------------


class CommonArgs(NamedTuple):
    """The ops' leading arguments, in schema order (module docstring)."""

    k_proj: torch.Tensor
    k_norm_weight: Sequence[torch.Tensor]
    eps: Optional[torch.Tensor]
    eps_value: float
    cos: torch.Tensor
    sin: Optional[torch.Tensor]
    positions: Optional[torch.Tensor]
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool
    norm_weight_offset: float
    norm_weight_in_float32: bool
    norm_round_before_rope: bool


def _validate(common: tuple, v_proj=None, k_out=None, v_out=None) -> None:
    c = CommonArgs(*common)
    validate_materialize_args(
        c.k_proj, c.k_norm_weight, c.eps, c.eps_value, c.cos, c.sin, c.positions, c.num_kv_heads, c.head_dim,
        c.rotary_dim, c.norm_weight_offset, c.norm_weight_in_float32, c.norm_round_before_rope, v_proj, k_out, v_out,
    )  # fmt: skip


def _new_output(common: tuple, token_major: bool = False) -> torch.Tensor:
    """An empty [n_layers, total_ctx, num_kv_heads, head_dim] tensor like k_proj: contiguous, or
    token_major: the transpose of a contiguous [total_ctx, n_layers, num_kv_heads, head_dim] one."""
    c = CommonArgs(*common)
    total_ctx, n_layers = c.k_proj.shape[:2]
    if token_major:
        return c.k_proj.new_empty((total_ctx, n_layers, c.num_kv_heads, c.head_dim)).transpose(0, 1)
    return c.k_proj.new_empty((n_layers, total_ctx, c.num_kv_heads, c.head_dim))


_N_COMMON = len(CommonArgs._fields)


def _common_and_token_major(args: tuple, kwargs: dict) -> tuple[tuple, bool]:
    """materialize_k's arguments: the common ones, and token_major (positional or keyword, default False)."""
    return args[:_N_COMMON], bool(args[_N_COMMON] if len(args) > _N_COMMON else kwargs.get("token_major", False))


def _norm_weight(k_norm_weight: Sequence[torch.Tensor]) -> NormWeight:
    """The op's k_norm_weight as the kernels take it: None (no norm), the [n_layers, head_dim] table, or the
    per-layer weights, which the kernel reads where they are (the parameters are never moved or re-homed)."""
    if not k_norm_weight:
        return None
    if len(k_norm_weight) == 1 and k_norm_weight[0].dim() == 2:
        return k_norm_weight[0]
    return list(k_norm_weight)


def _run_triton(*args, cache: Optional[CacheWrite] = None) -> None:
    launch_fused_kv_materialize(*args, cache=cache)


def _run_cpu(*args, cache: Optional[CacheWrite] = None) -> None:
    """PyTorch math, or the Triton kernel through its interpreter when TRITON_INTERPRET=1 (read per call),
    except for FP8 caches: the interpreter converts to FP8 wrongly (e4m3: 100.0 becomes 104.0)."""
    fp8 = cache is not None and {cache.k_caches[0].dtype, cache.v_caches[0].dtype} & set(FP8_CACHE_DTYPES)
    if os.environ.get("TRITON_INTERPRET") == "1" and not fp8:
        launch_fused_kv_materialize(*args, cache=cache, interpret=True)
    else:
        fused_kv_materialize_torch(*args, cache=cache)


def _launch(backend, common: tuple, v_proj, k_out, v_out, cache: Optional[CacheWrite] = None) -> None:
    """Run `backend` (`_run_triton` or `_run_cpu`) on validated arguments."""
    c = CommonArgs(*common)
    norm_weight = _norm_weight(c.k_norm_weight)
    backend(
        c.k_proj, v_proj, norm_weight, c.eps, c.eps_value, c.cos, c.sin, c.positions, k_out, v_out,
        c.num_kv_heads, c.head_dim, c.rotary_dim, c.interleaved, c.norm_weight_offset, c.norm_weight_in_float32,
        c.norm_round_before_rope, cache=cache,
    )  # fmt: skip


# Op bodies, with the backend bound first: each op's CUDA kernel binds `_run_triton`, its CPU kernel
# `_run_cpu`. They validate before allocating anything.


def _materialize_k(backend, *args, **kwargs) -> torch.Tensor:
    common, token_major = _common_and_token_major(args, kwargs)
    _validate(common)
    k_out = _new_output(common, token_major)
    _launch(backend, common, None, k_out, None)
    return k_out


def _materialize_kv(backend, *args) -> tuple[torch.Tensor, torch.Tensor]:
    common, v_proj = args[:-1], args[-1]
    _validate(common, v_proj)
    k_out, v_out = _new_output(common), _new_output(common)
    _launch(backend, common, v_proj, k_out, v_out)
    return k_out, v_out


def _materialize_kv_out(backend, *args) -> None:
    common, (v_proj, k_out, v_out) = args[:-3], args[-3:]
    _validate(common, v_proj, k_out, v_out)
    _launch(backend, common, v_proj, k_out, v_out)


_N_CACHE_ARGS = 7  # v_proj, k_caches, v_caches, slots, cache_dims, k_scale, v_scale


def _cache_write(args: tuple) -> tuple[tuple, torch.Tensor, CacheWrite]:
    """materialize_kv_to_cache's arguments, validated: (common, v_proj, the cache views to write)."""
    common, (v_proj, k_caches, v_caches, slots, cache_dims, k_scale, v_scale) = args[:-_N_CACHE_ARGS], args[-_N_CACHE_ARGS:]
    _validate(common, v_proj)
    c = CommonArgs(*common)
    validate_cache_write(
        c.k_proj, v_proj, c.num_kv_heads, c.head_dim, k_caches, v_caches, slots, cache_dims, k_scale, v_scale
    )
    return common, v_proj, CacheWrite(list(k_caches), list(v_caches), list(cache_dims), slots, k_scale, v_scale)


def _materialize_kv_to_cache(backend, *args) -> None:
    common, v_proj, cache = _cache_write(args)
    _launch(backend, common, v_proj, None, None, cache)


def materialize_k_body(*args, **kwargs) -> torch.Tensor:
    """What `fx_fusion.op_lowering` traces in place of a materialize_k call: on CUDA the Triton kernel
    launched through `torch.library.wrap_triton` (Inductor launches it from its generated code), elsewhere the
    same math in PyTorch ops (Inductor compiles it with the rest of the graph)."""
    common, token_major = _common_and_token_major(args, kwargs)
    _validate(common)
    c = CommonArgs(*common)
    norm_weight = _norm_weight(c.k_norm_weight)
    if not c.k_proj.is_cuda:
        k_out = materialized_k_torch(
            c.k_proj, norm_weight, c.eps, c.eps_value, c.cos, c.sin, c.positions, c.num_kv_heads, c.head_dim,
            c.rotary_dim, c.interleaved, c.norm_weight_offset, c.norm_weight_in_float32, c.norm_round_before_rope,
        )  # fmt: skip
        return k_out.transpose(0, 1).contiguous().transpose(0, 1) if token_major else k_out
    k_out = _new_output(common, token_major)
    launch_fused_kv_materialize(
        c.k_proj, None, norm_weight, c.eps, c.eps_value, c.cos, c.sin, c.positions, k_out, None,
        c.num_kv_heads, c.head_dim, c.rotary_dim, c.interleaved, c.norm_weight_offset, c.norm_weight_in_float32,
        c.norm_round_before_rope, traceable=True,
    )  # fmt: skip
    return k_out


def materialize_kv_to_cache_body(*args) -> None:
    """What `fx_fusion.op_lowering` traces in place of a (functionalised) materialize_kv_to_cache call, writing
    the caches given (Inductor then re-inplaces them into the graph's own caches): on CUDA the Triton kernel
    launched through `torch.library.wrap_triton` (Inductor launches it from its generated code), elsewhere
    the same math in PyTorch ops with static shapes (Inductor compiles it with the rest of the graph)."""
    common, v_proj, cache = _cache_write(args)
    c = CommonArgs(*common)
    norm_weight = _norm_weight(c.k_norm_weight)
    arguments = (
        c.k_proj, v_proj, norm_weight, c.eps, c.eps_value, c.cos, c.sin, c.positions, None, None,
        c.num_kv_heads, c.head_dim, c.rotary_dim, c.interleaved, c.norm_weight_offset, c.norm_weight_in_float32,
        c.norm_round_before_rope,
    )  # fmt: skip
    if c.k_proj.is_cuda:
        launch_fused_kv_materialize(*arguments, cache=cache, traceable=True)
    else:
        fused_kv_materialize_torch(*arguments, cache=cache)


# Defined with the low-level torch.library API (schemas, per-device implementations, fake kernels): the
# ops sit on the hot path of every compiled call, and this dispatches straight to the implementation,
# about 15 us per call less than torch.library.custom_op's Python-side wrapper.
_COMMON_SCHEMA = (
    "Tensor k_proj, Tensor[] k_norm_weight, Tensor? eps, float eps_value, Tensor cos, Tensor? sin, "
    "Tensor? positions, SymInt num_kv_heads, SymInt head_dim, SymInt rotary_dim, bool interleaved, "
    "float norm_weight_offset, bool norm_weight_in_float32, bool norm_round_before_rope"
)
_library = torch.library.Library("fx_fusion", "FRAGMENT")
_library.define(f"materialize_k({_COMMON_SCHEMA}, bool token_major=False) -> Tensor")
_library.define(f"materialize_kv({_COMMON_SCHEMA}, Tensor v_proj) -> (Tensor, Tensor)")
_library.define(f"materialize_kv_out({_COMMON_SCHEMA}, Tensor v_proj, Tensor(a!) k_out, Tensor(b!) v_out) -> ()")
_library.define(
    f"materialize_kv_to_cache({_COMMON_SCHEMA}, Tensor v_proj, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
    "Tensor slots, int[] cache_dims, Tensor? k_scale, Tensor? v_scale) -> ()"
)
for _name, _body in (
    ("materialize_k", _materialize_k),
    ("materialize_kv", _materialize_kv),
    ("materialize_kv_out", _materialize_kv_out),
    ("materialize_kv_to_cache", _materialize_kv_to_cache),
):
    _library.impl(_name, functools.partial(_body, _run_triton), "CUDA")
    _library.impl(_name, functools.partial(_body, _run_cpu), "CPU")


@torch.library.register_fake("fx_fusion::materialize_k")
def _materialize_k_fake(*args, **kwargs):
    common, token_major = _common_and_token_major(args, kwargs)
    _validate(common)
    return _new_output(common, token_major)


@torch.library.register_fake("fx_fusion::materialize_kv")
def _materialize_kv_fake(*args):
    common, v_proj = args[:-1], args[-1]
    _validate(common, v_proj)
    return _new_output(common), _new_output(common)


@torch.library.register_fake("fx_fusion::materialize_kv_out")
def _materialize_kv_out_fake(*args):
    common, (v_proj, k_out, v_out) = args[:-3], args[-3:]
    _validate(common, v_proj, k_out, v_out)


@torch.library.register_fake("fx_fusion::materialize_kv_to_cache")
def _materialize_kv_to_cache_fake(*args):
    _cache_write(args)


# --------------------------------------------------------------------------------------------------------
# Drop-in
# --------------------------------------------------------------------------------------------------------


def _check_drop_in_types(**arguments) -> None:
    """TypeError for a drop-in argument of the wrong Python type, naming it."""
    eps = arguments["eps"]
    if isinstance(eps, (int, float)):
        raise TypeError(
            f"eps must be a [n_layers] tensor or None, got {type(eps).__name__} {eps!r}; "
            f"pass a scalar eps as eps_value={eps!r}."
        )
    tensors = {"kv": False, "k_norm_weight": True, "eps": True, "cos_sin_cache": False, "positions": False}
    tensors.update(k_out=True, v_out=True)
    for name, optional in tensors.items():
        value = arguments[name]
        if not (isinstance(value, torch.Tensor) or (optional and value is None)):
            expected = "a torch.Tensor or None" if optional else "a torch.Tensor"
            raise TypeError(f"{name} must be {expected}, got {type(value).__name__}.")
    kinds = {
        "an int": (("num_kv_heads", "head_dim", "rotary_dim"), (int, torch.SymInt)),
        "a float": (("eps_value", "norm_weight_offset"), (int, float, torch.SymFloat)),
        "a bool": (("interleaved", "norm_weight_in_float32", "norm_round_before_rope", "check_positions"), bool),
    }
    for expected, (names, types) in kinds.items():
        for name in names:
            value = arguments[name]
            if not isinstance(value, types) or (expected != "a bool" and isinstance(value, bool)):
                raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}.")


def fused_norm_rope_stacked(
    kv: torch.Tensor,
    k_norm_weight: Optional[torch.Tensor],
    eps: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    k_out: Optional[torch.Tensor] = None,
    v_out: Optional[torch.Tensor] = None,
    *,
    interleaved: bool = False,
    eps_value: float = 1e-6,
    check_positions: bool = True,
    norm_weight_offset: float = 0.0,
    norm_weight_in_float32: bool = False,
    norm_round_before_rope: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm + RoPE of K and a copy of V for every layer of a stacked K/V projection.

    kv: [total_ctx, n_layers, kv_size*2], per token and layer K then V (kv_size = num_kv_heads*head_dim),
    any strides. k_norm_weight: [n_layers, head_dim], or None for no K norm. eps: [n_layers] (None: use
    `eps_value`). cos_sin_cache: [max_pos, rotary_dim], cos then sin. positions: [total_ctx] int32/int64,
    any stride. Returns (k_out, v_out), each [n_layers, total_ctx, num_kv_heads, head_dim] in kv's dtype,
    written into the given k_out / v_out when passed (either may be given alone; they must not share memory
    with each other or with the inputs).

    `interleaved=True` rotates GPT-J pairs instead of halves. The norm multiplies by
    (norm_weight_offset + k_norm_weight), Gemma's `1 + weight` with 1.0, and rounds to kv's dtype twice
    (Hugging Face Llama/Qwen3) or, with `norm_weight_in_float32=True`, once (SGLang's native RMSNorm, Gemma).
    Either way the normalised K is rounded before RoPE; `norm_round_before_rope=False` (with
    `norm_weight_in_float32=True`) keeps it in float32 through RoPE and rounds only the result (SGLang's
    reference math for the stacked layout).
    Positions outside the cache raise a ValueError in eager calls (one host sync; `check_positions=False`
    skips it); inside torch.compile, export or CUDA-graph capture, and for meta tensors, nothing syncs and
    the kernel clamps positions into the cache. Arguments of the wrong Python type raise a TypeError.
    """
    _check_drop_in_types(  # named one by one: dynamo cannot trace locals()
        kv=kv, k_norm_weight=k_norm_weight, eps=eps, cos_sin_cache=cos_sin_cache, positions=positions,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, k_out=k_out, v_out=v_out,
        interleaved=interleaved, eps_value=eps_value, check_positions=check_positions,
        norm_weight_offset=norm_weight_offset, norm_weight_in_float32=norm_weight_in_float32,
        norm_round_before_rope=norm_round_before_rope,
    )
    check_stacked_kv_rank(kv)
    total_ctx, n_layers, _ = kv.shape
    if total_ctx == 0:  # SGLang skips the width check for an empty context; everything else is still checked
        _check_head_layout(num_kv_heads, head_dim, rotary_dim)
        kv = kv.new_empty((0, n_layers, 2 * num_kv_heads * head_dim))
    check_stacked_kv_width(kv, num_kv_heads, head_dim)
    kv_size = num_kv_heads * head_dim
    k_proj, v_proj = kv[..., :kv_size], kv[..., kv_size:]
    weights = [] if k_norm_weight is None else [k_norm_weight]
    common = (
        k_proj, weights, eps, eps_value, cos_sin_cache, None, positions, num_kv_heads, head_dim, rotary_dim,
        interleaved, norm_weight_offset, norm_weight_in_float32, norm_round_before_rope,
    )  # fmt: skip
    if check_positions and _host_sync_allowed(positions):
        _validate(common, v_proj, k_out, v_out)  # shapes first, then the range check that syncs
        check_positions_in_cache(positions, cos_sin_cache.shape[0])
    if k_out is None and v_out is None:
        return torch.ops.fx_fusion.materialize_kv(*common, v_proj)
    k_out = k_out if k_out is not None else _new_output(common)
    v_out = v_out if v_out is not None else _new_output(common)
    torch.ops.fx_fusion.materialize_kv_out(*common, v_proj, k_out, v_out)
    return k_out, v_out
