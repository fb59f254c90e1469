"""Rotary angles as a broadcast multiply instead of an inner-dimension-1 matmul.

Hugging Face's rotary embeddings form their angles as an outer product,

    freqs = inv_freq[None, :, None].float() @ position_ids[:, None, :].float()    # bmm, inner dim 1

which Inductor on a GPU sends to cuBLAS as a kernel of its own, after a kernel that materializes its
inputs and before the pointwise cos/sin kernel. With an inner dimension of 1 every output element is one
product, so the matmul equals the broadcast multiply `a * b` exactly: one IEEE multiply, scaled by
alpha = 1 with nothing added, provided float32 matmuls may not use TF32 or bf16 (torch's default
precision, "highest"; checked when the pass runs). The multiply changes no value and lets Inductor fuse the
angles into its pointwise cos/sin kernel instead of launching the bmm and the kernels around it.

Only ancestors of a fused group's cos/sin tables are rewritten, and only matmuls of that exact form.

`find_angle_source` reads such tables back to what they are computed from, so that the grouped GEMM's K
epilogue can compute cos and sin itself (`grouped_gemv.RotaryAngles`) instead of a kernel writing tables
for it to read. It accepts tables exactly when the kernel's math gives the same bits:

1. the tail from each table up to its `aten.cos` / `aten.sin` nodes holds only layout ops, concatenations
   (halves joined after the trig function), casts to float32 or to one narrower float dtype (a rounding
   the kernel repeats), and at most one multiply by a Python number `scale`, made before any rounding (or
   scale = 1), alike on every path; the trig functions computed in float32;
2. the angles feeding the trig functions come from two tensors, the positions P and the frequencies I,
   through layout ops, casts and multiplies only: IEEE operations, which Inductor's code, the kernel and
   the CPU all round alike (no matmul, whose float32 may run as TF32; no division, which Triton may
   approximate; nothing transcendental, whose libraries differ);
3. replayed on the CPU with random P and I, and with the tails' trig functions, scale and casts taken as
   the identity, both tables equal float32(P[t]) * float32(I[freq(d)]) bit for bit at every token t and
   dim d, with freq(d) = d mod rotary_dim / 2 for neox pairs and d // 2 for interleaved ones. The tables
   are then round(trig(that angle) * scale), with the trig functions Inductor's code also calls
   (`tl.cos` / `tl.sin`).

Where P holds other than one position per token (the tables are cut from angles over more positions, as a
draft's context rows are from a table over context and noise), token t reads P.reshape(-1)[first + t *
step]: a replay with distinct positions and frequencies of 1 gives each token's position, which must
be evenly spaced in P, then the check of 3 runs on those positions.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .kernels.grouped_gemv import token_positions
from .values import LAYOUT_OPS

aten = torch.ops.aten
prims = torch.ops.prims

# How far up from the cos/sin tables to look (the HF rotary embedding sits within ~10 nodes).
MAX_ANCESTORS = 64


def _exact_float32_matmul(device: torch.device) -> bool:
    """True when a float32 matmul on `device` computes in IEEE float32 (no TF32 or bf16 shortcuts)."""
    if torch.get_float32_matmul_precision() != "highest":
        return False
    if device.type == "cuda":
        return not torch.backends.cuda.matmul.allow_tf32
    if device.type == "cpu":
        return getattr(torch.backends.mkldnn.matmul, "fp32_precision", "none") in ("none", "ieee")
    return False


def is_outer_product(node: torch.fx.Node) -> bool:
    """mm [M, 1] x [1, N] or bmm [B, M, 1] x [B, 1, N] in float32/float64 whose result a multiply equals."""
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.bmm.default):
        return False
    a, b = (arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None for arg in node.args[:2])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.dtype not in (torch.float32, torch.float64) or b.dtype != a.dtype:
        return False
    if not (statically_known_true(a.shape[-1] == 1) and statically_known_true(b.shape[-2] == 1)):
        return False
    return a.dtype == torch.float64 or _exact_float32_matmul(a.device)


def outer_products_to_mul(
    graph: torch.fx.Graph, fake_mode: Optional[FakeTensorMode], roots: list[torch.fx.Node]
) -> list[torch.fx.Node]:
    """Replace the outer-product matmuls among the ancestors of `roots` by multiplies; return the new nodes."""
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    found = []
    while stack and len(seen) < MAX_ANCESTORS:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_outer_product(node):
            found.append(node)
        stack.extend(node.all_input_nodes)
    created = []
    for matmul in found:
        a, b = matmul.args[:2]
        with graph.inserting_before(matmul):
            product = graph.call_function(aten.mul.Tensor, (a, b))
        product.meta.update({k: v for k, v in matmul.meta.items() if k not in ("val", "tensor_meta")})
        if fake_mode is not None:
            with fake_mode:
                product.meta["val"] = aten.mul.Tensor(a.meta["val"], b.meta["val"])
        matmul.replace_all_uses_with(product)
        graph.erase_node(matmul)
        created.append(product)
    return created


# --------------------------------------------------------------------------------------------------------
# Tables read back to positions and frequencies
# --------------------------------------------------------------------------------------------------------

_TABLE_LAYOUT = LAYOUT_OPS | {
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.expand.default,
    aten.t.default,
    aten.slice.Tensor,
    aten.select.int,
}
_CASTS = frozenset({prims.convert_element_type.default, aten._to_copy.default})
_ANGLE_OPS = _TABLE_LAYOUT | _CASTS | {aten.mul.Tensor, aten.cat.default, aten.stack.default, aten.repeat.default}
_NARROW_FLOATS = (torch.bfloat16, torch.float16)
MAX_ANGLE_NODES = 64  # the angle computations of the rotary embeddings seen stay below 20 nodes
PROBE_POSITIONS = 2**20  # replayed positions are random integers below this
MAX_GATHERED_POSITIONS = 4096  # positions tensors that tokens read a part of: at most this many replayed


class AngleSource(NamedTuple):
    """cos / sin tables [T, rotary_dim] computed as round(trig(float32(p[t]) * float32(inv_freq[j])) *
    scale), rounded to `rounded_to` (None: kept in float32), where token t's position p[t] is
    positions.reshape(-1)[first + t * step]. `nodes`: the nodes between positions / inv_freq and the tables
    (the computation the kernel takes over)."""

    inv_freq: torch.fx.Node
    positions: torch.fx.Node
    scale: float
    rounded_to: Optional[torch.dtype]
    nodes: frozenset
    first: int = 0
    step: int = 1


def _value(node) -> Optional[torch.Tensor]:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _scalar_factor(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, float]]:
    """(tensor, number) of a mul.Tensor of a node by a Python number, else None."""
    if node.target is not aten.mul.Tensor or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if isinstance(a, torch.fx.Node) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return a, float(b)
    if isinstance(b, torch.fx.Node) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return b, float(a)
    return None


def _is_cast(node: torch.fx.Node) -> bool:
    """A dtype conversion that keeps device and elements (memory format aside)."""
    if node.target not in _CASTS:
        return False
    source, out = _value(node.args[0]), _value(node)
    extra = set(node.kwargs) - {"dtype", "memory_format", "layout", "device"}
    return source is not None and out is not None and not extra and source.device == out.device


def _table_tail(table: torch.fx.Node, trig) -> Union[str, tuple]:
    """Walk from a table up to the `trig` nodes it is computed from, through layout ops, casts, Python-number
    multiplies and concatenations (a table of halves, cat(cos(f), cos(f)), as a model that rotates split
    halves gets): (trig nodes, scale, rounded_to, tail nodes), or why not. In computation order every path
    takes at most one scale, made before any rounding (or by 1), and roundings to one dtype; all paths alike."""
    tail, trigs, done = [], [], {}

    def walk(node) -> Union[str, tuple[float, Optional[torch.dtype]]]:
        if node in done:
            return done[node]
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            return f"the table is not a {trig.__name__} of angles"
        if node.target is trig:
            computed = _value(node)
            if computed is None or computed.dtype != torch.float32:
                return f"the {trig.__name__} is not computed in float32"
            trigs.append(node)
            done[node] = (1.0, None)
            return done[node]
        if len(tail) >= MAX_ANGLE_NODES:
            return "the table is too far from its trig function"
        tail.append(node)
        factor = _scalar_factor(node)
        if node.target is aten.cat.default:
            pieces = [walk(piece) for piece in node.args[0]]
            failed = [piece for piece in pieces if isinstance(piece, str)]
            if failed or len(set(pieces)) != 1:
                return failed[0] if failed else "the table joins pieces scaled or rounded differently"
            done[node] = pieces[0]
            return done[node]
        if factor is None and node.target not in _TABLE_LAYOUT and not _is_cast(node):
            return f"the table is computed with {node.target}, not from a {trig.__name__} through layout ops, casts and a scale"
        below = walk(factor[0] if factor is not None else node.args[0])
        if isinstance(below, str):
            return below
        scale, rounded_to = below
        if factor is not None:
            if scale != 1.0 or (rounded_to is not None and factor[1] != 1.0):
                return "the table is scaled twice, or after a rounding"
            scale = factor[1]
        elif node.target in _CASTS:
            dtype = _value(node).dtype
            if dtype in _NARROW_FLOATS and rounded_to in (None, dtype):
                rounded_to = dtype
            elif dtype != torch.float32:
                return f"the table is cast to {dtype}"
        done[node] = (scale, rounded_to)
        return done[node]

    found = walk(table)
    return found if isinstance(found, str) else (trigs, *found, tail)


def _angle_inputs(starts: list, limit: int = MAX_ANGLE_NODES) -> Union[str, tuple[list, list]]:
    """From the trig functions' inputs up through `_ANGLE_OPS`: (the nodes passed, the tensors where the
    walk stops: graph inputs, constants, or nodes computed by other ops), or why not."""
    inside, frontier, stack = [], [], list(starts)
    while stack:
        node = stack.pop()
        if node in inside or node in frontier:
            continue
        computed_here = node.op == "call_function" and node.target in _ANGLE_OPS and node.all_input_nodes
        if node.target in _CASTS and not _is_cast(node):
            computed_here = False
        if not computed_here:
            frontier.append(node)
            continue
        if len(inside) >= limit:
            return "the angles take too many nodes"
        inside.append(node)
        stack.extend(node.all_input_nodes)
    return inside, frontier


def _replay(nodes: list, substitutes: dict, identities: dict, tables: tuple) -> tuple[torch.Tensor, ...]:
    """Evaluate `nodes` (in graph order) on the CPU from `substitutes` (node -> tensor), each key of
    `identities` passing on the value of the node it maps to; returns the values of `tables`."""
    env = dict(substitutes)

    def lookup(arg):
        return env[arg]

    for node in nodes:
        if node in env:
            continue
        if node in identities:
            env[node] = env[identities[node]]
            continue
        args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lookup)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        env[node] = node.target(*args, **kwargs)
    return tuple(env[t] for t in tables)


def _extent(value: torch.Tensor) -> int:
    """Elements of storage that `value`'s shape and strides reach."""
    return 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()) if size > 0)


def _probe(value: torch.Tensor, kind: str, generator: torch.Generator) -> torch.Tensor:
    """CPU values laid out like `value` (shape and strides; elements that share memory there, as an
    expanded tensor's do, share a value here). kind: "positions" (random integers below PROBE_POSITIONS),
    "distinct" (distinct ones of those), "frequencies" (random floats in [1e-4, 1)) or "ones"."""
    extent = _extent(value)
    if kind == "positions":
        storage = torch.randint(0, PROBE_POSITIONS, (extent,), generator=generator)
    elif kind == "distinct":
        storage = torch.randperm(PROBE_POSITIONS, generator=generator)[:extent]
    elif kind == "frequencies":
        storage = torch.rand(extent, generator=generator, dtype=torch.float64) * (1 - 1e-4) + 1e-4
    else:
        storage = torch.ones(extent)
    return storage.to(value.dtype).as_strided(tuple(value.shape), value.stride())


def _evenly_spaced(indices: list[int]) -> Optional[tuple[int, int]]:
    """(first, step) with indices[t] = first + t * step, step >= 0, or None."""
    step = indices[1] - indices[0] if len(indices) > 1 else 1
    if step < 0 or any(index != indices[0] + t * step for t, index in enumerate(indices)):
        return None
    return indices[0], step


def find_angle_source(
    cos: torch.fx.Node, sin: torch.fx.Node, n_tokens: int, rotary_dim: int, interleaved: bool
) -> Union[AngleSource, str]:
    """Where per-token cos / sin tables [n_tokens, rotary_dim] come from, as an `AngleSource` the K epilogue
    can compute them from (module docstring), or why they cannot be read back that way (a string)."""
    tails = []
    for table, trig in ((cos, aten.cos.default), (sin, aten.sin.default)):
        value = _value(table)
        if value is None or tuple(value.shape) != (n_tokens, rotary_dim):
            return f"the {trig.__name__} table is not [{n_tokens}, {rotary_dim}]"
        found = _table_tail(table, trig)
        if isinstance(found, str):
            return found
        tails.append(found)
    (cos_trigs, cos_scale, cos_rounding, cos_tail), (sin_trigs, sin_scale, sin_rounding, sin_tail) = tails
    if (cos_scale, cos_rounding) != (sin_scale, sin_rounding):
        return "cos and sin are scaled or rounded differently"
    trig_nodes = list(dict.fromkeys([*cos_trigs, *sin_trigs]))  # in a fixed order
    walked = _angle_inputs([trig.args[0] for trig in trig_nodes])
    if isinstance(walked, str):
        return walked
    inside, frontier = walked
    tensors = [node for node in frontier if _value(node) is not None]
    if len(tensors) != 2 or len(frontier) != 2:
        return f"the angles come from {len(tensors)} tensors and {len(frontier) - len(tensors)} other values, not positions and frequencies"
    values = [_value(node) for node in tensors]
    if any(not all(isinstance(v, int) for v in (*t.shape, *t.stride())) for t in values):
        return "the angles' inputs have symbolic sizes"
    half = rotary_dim // 2
    order = [(p, i) for p, i in ((0, 1), (1, 0))
             if values[p].numel() >= 1 and values[i].numel() == half and values[i].is_floating_point()
             and values[p].dtype != torch.bool and not values[p].is_complex()]  # fmt: skip
    order.sort(key=lambda pair: values[pair[0]].numel() != n_tokens)  # one position per token first
    if not order:
        return f"no input holds positions and the other {half} floating-point frequencies"
    identities = {trig: trig.args[0] for trig in trig_nodes}  # trig functions, scales, casts: passed through
    for step in (*cos_tail, *sin_tail):
        factor = _scalar_factor(step)
        if factor is not None or step.target in _CASTS:
            identities[step] = factor[0] if factor is not None else step.args[0]
    graph_order = {node: index for index, node in enumerate(cos.graph.nodes)}
    nodes = sorted({*inside, *trig_nodes, *cos_tail, *sin_tail}, key=graph_order.__getitem__)
    dims = torch.arange(rotary_dim)
    freq = dims // 2 if interleaved else dims % half
    generator = torch.Generator().manual_seed(0)

    def replay(positions: torch.Tensor, inv_freq: torch.Tensor, p: int, i: int):
        try:
            return _replay(nodes, {tensors[p]: positions, tensors[i]: inv_freq}, identities, (cos, sin))
        except (RuntimeError, TypeError, ValueError, IndexError) as error:
            return f"replaying the angles failed: {type(error).__name__}: {error}"

    reasons = []
    for p, i in order:
        with unset_fake_temporarily(), torch.no_grad():
            first_step = (0, 1)
            if values[p].numel() == n_tokens:
                positions = _probe(values[p], "positions", generator)
            elif max(values[p].numel(), _extent(values[p])) > MAX_GATHERED_POSITIONS:
                reasons.append(f"the tables' tokens read part of {values[p].numel()} positions, too many to replay")
                continue
            else:
                positions = _probe(values[p], "distinct", generator)
                first_step = _gathered_positions(positions, replay(positions, _probe(values[i], "ones", generator), p, i))
                if isinstance(first_step, str):
                    reasons.append(first_step)
                    continue
            inv_freq = _probe(values[i], "frequencies", generator)
            per_token = token_positions(positions, *first_step, n_tokens).float()
            expected = per_token[:, None] * inv_freq.reshape(-1).float()[freq][None, :]
            got = replay(positions, inv_freq, p, i)
        if isinstance(got, str):
            reasons.append(got)
        elif all(g.dtype == torch.float32 and g.shape == expected.shape and torch.equal(g, expected) for g in got):
            return AngleSource(tensors[i], tensors[p], cos_scale, cos_rounding, frozenset(nodes), *first_step)
        else:
            reasons.append("the tables are not trig(position * frequency) at each token and dim")
    return reasons[0]


def _gathered_positions(positions: torch.Tensor, got) -> Union[str, tuple[int, int]]:
    """(first, step) such that token t of tables `got`, replayed with the distinct `positions` and every
    frequency 1, holds positions.reshape(-1)[first + t * step] in every dim; or why not."""
    if isinstance(got, str):
        return got
    flat = positions.reshape(-1)
    if torch.unique(flat).numel() != flat.numel():
        return f"the tables' tokens read part of {flat.numel()} positions that are not distinct (expanded, or rounded by their dtype)"
    indices = []
    for table in got:
        if table.dim() != 2 or table.dtype != torch.float32 or not torch.equal(table, table[:, :1].expand_as(table)):
            return "the tables are not trig(position * frequency) at each token and dim"
        where = [torch.nonzero(flat.float() == value).reshape(-1) for value in table[:, 0]]
        if any(found.numel() != 1 for found in where):
            return "the tables' tokens do not each read one of the positions"
        indices.append([int(found) for found in where])
    spaced = _evenly_spaced(indices[0])
    if indices[0] != indices[1] or spaced is None:
        return "the tables' tokens read positions that are not evenly spaced"
    return spaced
