"""Absorb the KV-cache writes that follow a fused group into one `fx_fusion.materialize_kv_to_cache` call.

After a group is rewritten (fused_kv_pass), each layer's K is a view of `materialize_k`'s output
`k_all` [n_layers, total_ctx, H, D] and each V a view of the grouped GEMM output `proj` [total_ctx, columns].
When every one of them is only written into a cache, the graph (functional, post-grad) spells each write as

    index_put(cache, [None, .., None, index], src)          # StaticCache.update's index_copy_ (along the
                                                            #   sequence axis at cache_position), k_cache[slots] = k
    index_put(cache.view(-1, H, D), [slots], src)           # a paged pool [num_blocks, block_size, H, D]
    index_put(cache, [block_index, block_offset], src)      # the same pool indexed by block and offset
    slice_scatter(cache, copy(cache[.., a:b, ..], src), ..)  # cache[:, :, a:b].copy_(k), a preallocated buffer

with `src` any views of that layer's K or V, optionally quantised `(src / scale).to(fp8)` (a one-element
float scale). The rewrite computes every layer's K and V into its cache at once: `materialize_kv_to_cache`
(K from the same k_proj / norm / rotary arguments as `materialize_k`, V from a strided view of `proj`),
called in its functional form (the graph stays functional, so Inductor re-inplaces it into the caches that
the graph writes back, as it does the index_put it replaces), and each written cache's value becomes the
op's updated cache.

Why it is exact: which element of which layer lands where is established by replaying each write's view
chain on labelled tensors (every element of k_all / proj its own number): a write is absorbed only when,
along the write's axes, the labels read layer-constant, head = arange, head_dim = arange and token =
(batch * tokens_per_batch + index position), so that the op's slots (one per token: the index value, plus
batch * rows per batch) put exactly the same element at exactly the same place. All layers must share one
index (the same node), one cache layout and one cache dtype, and every K block and every V projection of
the group must be written, else nothing is absorbed and the group keeps its plain writes (with a reason).

Differences, stated: a slot outside the cache (e.g. vLLM's -1 padding) is skipped by the op, where the
plain index_put would fail or wrap around; and the quantised value is round(k) / scale converted once to
the cache's dtype, which is what Inductor computes for the spelled graph (it does not round the quotient
to k's dtype in between; with `emulate_precision_casts` it does, and then nothing is absorbed).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.fx
from torch._inductor.pattern_matcher import stable_topological_sort

from . import op_lowering
from .kv_patterns import NoMatch, depends_on, erase_unused, val
from .values import RESHAPES, ValueKeys

aten = torch.ops.aten
prims = torch.ops.prims

# Ops that move elements without changing them (replayed on labels), and the element-wise ops of a quantised
# write (skipped on labels, kept as the op's scale and the cache's dtype).
_VIEW_OPS = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.select.int, aten.slice.Tensor, aten.expand.default, aten.clone.default, aten.alias.default,
})  # fmt: skip
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclasses.dataclass
class Write:
    """One plain cache write of one layer's K or V, as the op will do it."""

    result: torch.fx.Node  # the written cache's new value
    cache: torch.fx.Node  # the cache written (as the graph holds it)
    cache_dims: tuple[int, ...]  # its dims for (batch, slot, head, head_dim); batch -1 when it has none
    slots: tuple  # ("index", I, rows_per_batch, batches) | ("block", I_block, I_offset, block_size) | ("range", start, count, rows_per_batch, batches)
    scale: Optional[torch.fx.Node]
    member: int  # K: the block of k_all; V: the first column of proj it reads
    via_flat_view: bool  # written through a [slots, H, D] view of a 4-D cache: `result` has that view's shape


def _hint(size) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        if hint is None:
            raise NoMatch("a cache write has a size without a hint")
        return int(hint)
    return int(size)


def _concrete(value):
    """A view op's argument at its hint: sizes that are graph nodes (symbolic) become their hinted ints."""
    if isinstance(value, (list, tuple)):
        return type(value)(_concrete(v) for v in value)
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
        if not isinstance(value, (int, torch.SymInt)):
            raise NoMatch("a view in a cache write's chain takes a tensor argument")
    return _hint(value) if isinstance(value, torch.SymInt) else value


def _shape(node: torch.fx.Node) -> list[int]:
    return [_hint(s) for s in val(node).shape]


def _write_of_value(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The write that stores `node` (its index_put, or the slice_scatter around its copy), else None."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    if user.target is aten.index_put.default and user.args[2] is node and not (len(user.args) > 3 and user.args[3]):
        return user
    if user.target is aten.copy.default and user.args[1] is node and len(user.users) == 1:
        (scatter,) = user.users
        cut = user.args[0]
        if (
            scatter.target is aten.slice_scatter.default
            and scatter.args[1] is user
            and isinstance(cut, torch.fx.Node)
            and cut.target is aten.slice.Tensor
            and cut.args[0] is scatter.args[0]
            and list(cut.args[1:4]) == list(scatter.args[2:5])
            and (len(scatter.args) < 6 or scatter.args[5] == 1)
            and (len(cut.args) < 5 or cut.args[4] == 1)
        ):
            return scatter
    return None


def _chains(
    root: torch.fx.Node, stop: set, views: frozenset = _VIEW_OPS
) -> tuple[list[tuple[list[torch.fx.Node], torch.fx.Node]], list]:
    """Paths from `root` through `views` and quantisation ops to cache writes, [(chain, write)], and the
    other nodes that read `root` or a node on such a path (nodes in `stop` are not followed)."""
    found, others, stack = [], [], [[root]]
    while stack:
        chain = stack.pop()
        node = chain[-1]
        write = _write_of_value(node) if node is not root else None
        if write is not None:
            found.append((chain, write))
            continue
        for user in node.users:
            if user in stop:
                continue
            if user.target in views or user.target in (prims.convert_element_type.default, aten.div.Tensor):
                stack.append(chain + [user])
            else:
                others.append(user)
    return found, others


def _replay(chain: list[torch.fx.Node], labels: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.fx.Node]]:
    """The chain's view ops run on `labels` (sizes at their hints), and its scale (one division at most)."""
    value, scale = labels, None
    for node in chain[1:]:
        if node.target is aten.div.Tensor:
            divisor = node.args[1]
            if scale is not None or not isinstance(divisor, torch.fx.Node) or val(divisor).numel() != 1:
                raise NoMatch("a cache write's value is divided by something other than one scale")
            if node.args[0] is not chain[chain.index(node) - 1]:
                raise NoMatch("a cache write's value is the divisor, not the dividend")
            scale = divisor
        elif node.target in _VIEW_OPS:
            args = [_concrete(a) for a in node.args[1:]]
            kwargs = {k: _concrete(v) for k, v in node.kwargs.items() if k != "memory_format"}
            value = node.target(value, *args, **kwargs)
    return value, scale


def _arange_along(shape: list[int], axis: int) -> torch.Tensor:
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return torch.arange(shape[axis]).view(view).expand(shape)


def _axis_counting(component: torch.Tensor, size: int, taken: set) -> Optional[int]:
    """The axis (not in `taken`) along which `component` counts 0 .. size-1, constant along the others."""
    shape = list(component.shape)
    for axis, extent in enumerate(shape):
        if axis not in taken and extent == size and torch.equal(component, _arange_along(shape, axis)):
            return axis
    return None


def _layout(write: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, list, list[int], int]:
    """(cache, written tensor, index nodes, region shape, indexed axis) of a write: `written` is the cache or
    a flat view of it; the region is the shape the value is broadcast to, axis its index position."""
    if write.target is aten.slice_scatter.default:
        cache, _, dim, start, end = write.args[:5]
        shape = _shape(cache)
        dim = dim % len(shape)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < min(end, shape[dim])):
            raise NoMatch("a cache write copies into a slice whose bounds are not fixed numbers")
        count = min(end, shape[dim]) - start
        return cache, cache, [("range", start, count)], shape[:dim] + [count] + shape[dim + 1 :], dim
    written, indices = write.args[0], list(write.args[1])
    present = [i for i, index in enumerate(indices) if index is not None]
    if not present or present != list(range(present[0], present[-1] + 1)) or len(present) > 2:
        raise NoMatch("a cache write indexes other than one axis (or a block and offset pair)")
    for i in present:
        if val(indices[i]).dim() != 1 or val(indices[i]).dtype not in (torch.int32, torch.int64):
            raise NoMatch("a cache write's index is not a 1-D integer tensor")
    lengths = {_hint(val(indices[i]).shape[0]) for i in present}
    if len(lengths) != 1:
        raise NoMatch("a cache write's block and offset indices differ in length")
    shape = _shape(written)
    axis = present[0]
    region = shape[:axis] + [lengths.pop()] + shape[present[-1] + 1 :]
    cache = written
    if written.target in RESHAPES:
        cache = written.args[0]
    return cache, written, [indices[i] for i in present], region, axis


def _parse_write(chain: list[torch.fx.Node], write: torch.fx.Node, decode, n_tokens: int, heads: int, head_dim: int) -> Write:
    """Establish where `write` puts each element of the chain's root (module docstring); NoMatch if not
    exactly the op's cache write. `decode(labels)` -> (member, token, head, element) arrays."""
    cache, written, indices, region, axis = _layout(write)
    if any(isinstance(size, torch.SymInt) for size in val(written).shape):
        raise NoMatch("a cache of dynamic shape")  # its sizes become constants of the op's slots
    labels = torch.arange(math.prod(_shape(chain[0]))).view(_shape(chain[0]))
    value, scale = _replay(chain, labels)
    try:
        value = value.expand(region)
    except RuntimeError:
        raise NoMatch(f"a cache write's value {list(value.shape)} does not fill its region {region}") from None
    member, token, head, element = decode(value)
    if not bool((member == member.flatten()[0]).all()):
        raise NoMatch("a cache write mixes layers")
    head_axis = _axis_counting(head, heads, {axis}) if heads > 1 else None
    dim_axis = _axis_counting(element, head_dim, {axis, head_axis})
    if (heads > 1 and head_axis is None) or dim_axis is None or (heads == 1 and bool(head.any())):
        raise NoMatch("a cache write does not keep each head's elements along its head and head_dim axes")
    rest = [a for a in range(len(region)) if a not in (axis, head_axis, dim_axis)]
    batch_axes = [a for a in rest if region[a] > 1]
    if len(batch_axes) > 1:
        raise NoMatch("a cache write spreads tokens over more than one batch axis")
    count = region[axis]
    expected = _arange_along(region, axis)
    batches = 1
    if batch_axes:
        batches = region[batch_axes[0]]
        expected = expected + count * _arange_along(region, batch_axes[0])
    if batches * count != n_tokens or not torch.equal(token, expected):
        raise NoMatch("a cache write does not put token b*T + t at batch b, index position t")
    dims = _cache_dims(cache, written, region, axis, head_axis, dim_axis, batch_axes, len(indices))
    if isinstance(indices[0], tuple):  # a slice: ("range", start, count)
        _, start, count = indices[0]
        slots = ("range", start, count, _shape(written)[axis], batches)
    elif len(indices) == 2:
        slots = ("block", indices[0], indices[1], _shape(written)[axis + 1])
    else:
        slots = ("index", indices[0], _shape(written)[axis], batches)
    return Write(write, cache, dims, slots, scale, int(member.flatten()[0]), written is not cache)


def _cache_dims(cache, written, region, axis, head_axis, dim_axis, batch_axes, n_indices) -> tuple[int, ...]:
    """The cache's dims for (batch, slot, head, head_dim), from the region's axes."""
    rank = len(_shape(cache))
    if written is not cache or n_indices == 2:  # a [slots, ..] view of [blocks, block_size, ..], or block + offset
        if batch_axes:
            raise NoMatch("a paged cache write has tokens along a batch axis")
        if written is not cache:
            outer, inner = _shape(cache), _shape(written)
            merged = outer[:axis] + [outer[axis] * outer[axis + 1]] + outer[axis + 2 :]
            strides = val(cache).stride()
            if len(outer) != len(inner) + 1 or merged != inner or _hint(strides[axis]) != outer[axis + 1] * _hint(strides[axis + 1]):
                raise NoMatch("a cache write goes through a view that is not the pool's flat [slots, H, D] view")
        shift = lambda a: a if a < axis else a + 1  # noqa: E731  (region axis -> cache dim)
        head = shift(head_axis) if head_axis is not None else None
        dims = [axis, axis + 1, head, shift(dim_axis)]
    else:
        head = head_axis
        batch = batch_axes[0] if batch_axes else None
        dims = [batch, axis, head, dim_axis]
    unnamed = [d for d in range(rank) if d not in dims]  # size-1 dims: a single head or batch
    for i in (2, 0):
        if dims[i] is None and unnamed:
            dims[i] = unnamed.pop(0)
    if dims[2] is None or unnamed or (dims[0] is None and rank != 3):
        raise NoMatch(f"a cache write's cache {_shape(cache)} is not [batch, slots, H, D] in some order")
    return tuple(-1 if d is None else d for d in dims)


def _k_decoder(k_all: torch.fx.Node):
    layers, tokens, heads, dim = _shape(k_all)
    return lambda lab: (lab // (tokens * heads * dim), lab // (heads * dim) % tokens, lab // dim % heads, lab % dim)


def _v_decoder(proj: torch.fx.Node, head_dim: int):
    columns = _shape(proj)[1]

    def decode(lab):
        column = lab % columns
        first = column.min()
        return torch.full_like(lab, int(first)), lab // columns, (column - first) // head_dim, (column - first) % head_dim

    return decode


def _path_from(root: torch.fx.Node, node: torch.fx.Node) -> set:
    """The nodes from `root` (excluded) to `node` along first arguments."""
    path = set()
    while node is not root and isinstance(node, torch.fx.Node):
        path.add(node)
        node = node.args[0] if node.args else None
    return path


def _same_slots(a: tuple, b: tuple, same_value: ValueKeys) -> bool:
    return len(a) == len(b) and all(same_value(x) == same_value(y) for x, y in zip(a, b))


def _check_alike(writes: list[Write], what: str, same_value: ValueKeys) -> None:
    first = writes[0]
    for w in writes[1:]:
        if not _same_slots(w.slots, first.slots, same_value):
            raise NoMatch(f"the {what} cache writes do not share one index")
        if w.cache_dims != first.cache_dims or w.scale is not first.scale:
            raise NoMatch(f"the {what} cache writes differ in cache layout or scale")
        a, b = val(w.cache), val(first.cache)
        if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
            raise NoMatch(f"the {what} caches differ in shape, strides or dtype")


def plan(k_all: torch.fx.Node, proj: torch.fx.Node, k_paths: list, k_others: list) -> tuple[list[Write], list[Write]]:
    """(K writes by block, V writes by column) when every layer's K and V of the group is written to a cache
    exactly as the op writes it (`k_paths`, `k_others`: `_chains(k_all)`, which found writes); NoMatch
    otherwise."""
    if k_others:
        raise NoMatch(f"a layer's K is also read by {k_others[0].name}")
    layers, tokens, heads, head_dim = _shape(k_all)
    k_writes = sorted((_parse_write(c, w, _k_decoder(k_all), tokens, heads, head_dim) for c, w in k_paths), key=lambda w: w.member)
    if [w.member for w in k_writes] != list(range(layers)):
        raise NoMatch("not every layer's K is written to a cache exactly once")
    v_paths, v_others = _chains(proj, _path_from(proj, k_all.args[0]))
    if v_others:
        raise NoMatch(f"a layer's V is also read by {v_others[0].name}")
    v_writes = sorted((_parse_write(c, w, _v_decoder(proj, head_dim), tokens, heads, head_dim) for c, w in v_paths), key=lambda w: w.member)
    if len(v_writes) != layers:
        raise NoMatch(f"{len(v_writes)} V projections of the group are written to caches, expected {layers}")
    same_value = ValueKeys()
    _check_alike(k_writes, "K", same_value)
    _check_alike(v_writes, "V", same_value)
    if not _same_slots(k_writes[0].slots, v_writes[0].slots, same_value):
        raise NoMatch("K and V are written at different indices")
    if k_writes[0].cache_dims != v_writes[0].cache_dims:
        raise NoMatch("the K and V caches are laid out differently")
    kv_dtype = val(k_all).dtype
    for writes in (k_writes, v_writes):
        dtype = val(writes[0].cache).dtype
        if dtype != kv_dtype and dtype not in _FP8:
            raise NoMatch(f"the caches hold {dtype}; only {kv_dtype} or an FP8 dtype are written by the op")
        if writes[0].scale is not None and torch._inductor.config.emulate_precision_casts:
            raise NoMatch("emulate_precision_casts rounds the scaled value to K's dtype before the cast")
    return k_writes, v_writes


def _slots(builder, spec: tuple, device) -> torch.fx.Node:
    """The op's slots [total_ctx] from a write's index spec (see Write.slots)."""
    kind = spec[0]
    if kind == "block":  # block * block_size + offset
        _, block, offset, block_size = spec
        return builder.call(aten.add.Tensor, builder.call(aten.mul.Tensor, block, block_size), offset)
    if kind == "range":
        _, start, count, rows, batches = spec
        index = builder.call(prims.iota.default, count, start=start, step=1, dtype=torch.int64, device=device, requires_grad=False)
    else:
        _, index, rows, batches = spec
    if batches == 1:
        return index
    first_rows = builder.call(prims.iota.default, batches, start=0, step=rows, dtype=torch.int64, device=device, requires_grad=False)
    grid = builder.call(aten.add.Tensor, builder.call(aten.unsqueeze.default, first_rows, 1), builder.call(aten.unsqueeze.default, index, 0))
    return builder.call(aten.reshape.default, grid, [-1])


def _v_proj(builder, proj: torch.fx.Node, v_writes: list[Write], width: int) -> torch.fx.Node:
    """proj's V columns as [total_ctx, n_layers, width] (a strided view), when evenly spaced."""
    columns = [w.member for w in v_writes]
    step = columns[1] - columns[0] if len(columns) > 1 else width
    total = _shape(proj)[1]
    within = max(0, columns[0] + len(columns) * step - total)  # V's first column inside each step
    start = columns[0] - within
    if any(c != columns[0] + i * step for i, c in enumerate(columns)) or step < width or start < 0 or within + width > step:
        raise NoMatch("the V columns of the grouped projection are not evenly spaced")
    block = builder.call(aten.slice.Tensor, proj, 1, start, start + len(columns) * step)
    block = builder.call(aten.view.default, block, [-1, len(columns), step])
    return builder.call(aten.slice.Tensor, block, 2, within, within + width)


def _scale(builder, writes: list[Write], device) -> Optional[torch.fx.Node]:
    """The writes' scale as a float32 one-element tensor; 1.0 for a plain cast to FP8; None unscaled."""
    scale = writes[0].scale
    if scale is None and val(writes[0].cache).dtype in _FP8:
        return builder.call(aten.full.default, [], 1.0, dtype=torch.float32, device=device)
    if scale is not None and val(scale).device != device:
        raise NoMatch("the cache write's scale is on another device")
    return scale


def absorb(graph: torch.fx.Graph, builder, k_all: torch.fx.Node, proj: torch.fx.Node, in_order: bool) -> str:
    """Rewrite the cache writes of a fused group (module docstring); returns what was absorbed, '' when the
    group's K is not written to a cache. NoMatch (graph unchanged) when they cannot be absorbed exactly.
    `in_order`: whether the graph is still in topological order after the group's rewrite."""
    if k_all.kwargs.get("token_major"):  # its outputs may be strided views of it (strided_outputs)
        if _chains(k_all, set(), _VIEW_OPS | {aten.as_strided.default})[0]:
            raise NoMatch("the group also holds query heads, which are not cached")
        return ""
    k_paths, k_others = _chains(k_all, set())
    if not k_paths:
        return ""
    if not in_order:  # the group's users after its new nodes
        stable_topological_sort(graph)
    k_writes, v_writes = plan(k_all, proj, k_paths, k_others)
    writes = k_writes + v_writes
    spec = k_writes[0].slots
    inputs = [*k_all.all_input_nodes, proj, *(w.cache for w in writes), *(w.scale for w in writes if w.scale is not None)]
    inputs += [x for x in spec[1:] if isinstance(x, torch.fx.Node)]
    if depends_on(inputs, {w.result for w in writes}):
        raise NoMatch("the group's inputs depend on a cache it writes")
    point = max(inputs)  # the last in graph order; the caches' readers follow once the graph is sorted
    device = val(k_all).device
    heads, head_dim = _shape(k_all)[2:]
    with graph.inserting_before(point.next):  # in the order they are built
        slots = _slots(builder, spec, device)
        template = (
            tuple(k_all.args),
            _v_proj(builder, proj, v_writes, heads * head_dim),
            [w.cache for w in k_writes],
            [w.cache for w in v_writes],
            slots,
            _scale(builder, k_writes, device),
            _scale(builder, v_writes, device),
        )
        cache_dims = list(k_writes[0].cache_dims)
        builder.finish()  # the values the trace below starts from

        def write_all(*values):
            common, v_proj, k_caches, v_caches, slots, k_scale, v_scale = values
            torch.ops.fx_fusion.materialize_kv_to_cache(
                *common, v_proj, k_caches, v_caches, slots, cache_dims, k_scale, v_scale
            )
            return (*k_caches, *v_caches)

        updated = op_lowering.insert_traced(graph, write_all, template)
        builder.created.extend(updated.created)
        for write, cache in zip(writes, updated.outputs):
            if write.via_flat_view:  # users read the flat view of the written cache
                cache = builder.call(aten.reshape.default, cache, list(val(write.result).shape))
            write.result.replace_all_uses_with(cache)
        builder.finish()
    erase_unused([w.result for w in writes])
    scaled = " (FP8, scaled)" if val(k_writes[0].cache).dtype in _FP8 else ""
    return (
        f"K and V of {len(k_writes)} layers written straight into their caches{scaled}: "
        f"{len(writes)} cache writes absorbed ({_describe(spec)})"
    )


def _describe(spec: tuple) -> str:
    return {
        "index": "index_put / index_copy at the index",
        "block": "index_put at block and offset",
        "range": "copy into a slice",
    }[spec[0]]
