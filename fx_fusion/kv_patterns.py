"""Recognise one layer's K/V context branch in a post-grad (or joint) ATen graph.

A K branch is, in graph order:

    source  = mm(x2d, W^T) | addmm(b, x2d, W^T) | columns of such a fused kv/qkv projection (slice, split,
              chunk) | the K columns of one projection over all layers' weights viewed as [T, L, 2*kv]
    layout1 = views / reshapes / permutes / transposes / unsqueezes / clones       (to heads)
    norm    = optional per-head RMSNorm: Hugging Face, SGLang-native (weight in float32), Gemma (1 + w),
              no upcast, nn.RMSNorm / F.rms_norm; rsqrt, 1 / sqrt or division by sqrt
    layout2 = views / permutes ...                                                 (e.g. transpose(1, 2))
    rotary  = any spelling of K*cos + rotate(K)*sin (rotary_action proves it by what it computes)

The norm is checked op by op (exponent 2, mean over the head dim only, eps inside the root, the weight's
shape, dtypes); any difference raises `NoMatch` with a reason a user can act on. Which axes carry tokens,
layers, heads and the head dim is established by replaying the layout ops on an index tensor, so any
spelling of the reshapes is accepted as long as it means "split the projection into heads".
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Union

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import padded_linears, rotary_action
from .probe_sizes import FULL_SIZE, ProbeMismatch, ProbeSizes, probe_call
from .memo import OutcomeMemo, plain
from .values import LAYOUT_OPS, RESHAPES, ValueKeys

aten = torch.ops.aten
prims = torch.ops.prims
CASTS = (prims.convert_element_type.default, aten._to_copy.default)

PROJECTION_OPS = {aten.mm.default, aten.addmm.default}
SLICE_END_MAX = 2**63 - 1
FLOAT32 = torch.float32


class NoMatch(Exception):
    """The branch differs from the fusable pattern; the message says how."""


class ComputedWeight(NoMatch):
    """A linear over a weight (or bias) cut or cast from a parameter in the graph: worth telling the user
    when K math follows it. `projection`: that linear read as if its weight were a parameter."""

    def __init__(self, reason: str, projection: Optional["Projection"] = None):
        super().__init__(reason)
        self.projection = projection


def is_parameter_rows(node) -> bool:
    """A parameter, or rows of it seen as a view the grouped GEMM reads where it lives: a block of rows
    taken with `slice` along dim 0 (SGLang's DFlash `F.linear(x, qkv.weight[q_size : q_size + 2 * kv_size])`),
    one layer's weight picked from a parameter stacked for all layers (`F.linear(x, w_all[i])`, a select
    along dim 0, or `w_all.unbind(0)[i]`), or leading dims flattened into rows (modded-nanogpt's
    `qkv_w.flatten(end_dim=1)`)."""
    while True:
        if is_call(node, aten.slice.Tensor) and (node.args[1] if len(node.args) > 1 else 0) == 0:
            if (node.args[4] if len(node.args) > 4 else 1) != 1:
                return False
        elif (stacked := _stacked_entry_of(node)) is not None:
            node = stacked
            continue
        elif is_call(node, *RESHAPES):
            source = val(node.args[0])
            if source.shape[-1:] != val(node).shape[-1:] or not source.is_contiguous():
                return False  # only leading dims merged into rows
        else:
            return is_weight_input(node)
        node = node.args[0]


def _stacked_entry_of(node) -> Optional[torch.fx.Node]:
    """t when `node` is one entry along dim 0 of t, at a constant index: `t[i]` (a select) or
    `t.unbind(0)[i]`; else None."""
    if is_call(node, aten.select.int) and node.args[1] == 0 and isinstance(node.args[2], int):
        return node.args[0]
    if getattr(node, "target", None) is not operator.getitem or not isinstance(node.args[1], int):
        return None
    unbind = node.args[0]
    if not is_call(unbind, aten.unbind.int):
        return None
    return unbind.args[0] if (unbind.args[1] if len(unbind.args) > 1 else unbind.kwargs.get("dim", 0)) == 0 else None


def _cut_from_parameter(node) -> bool:
    """Is `node` a parameter seen through views, slices, selects, gathers (`qkv.weight[kv_rows]`) or casts
    (autocast's copy of a float32 weight in bfloat16)?"""
    cuts = (aten.slice.Tensor, aten.select.int, aten.index.Tensor, aten.index_select.default, aten.t.default)
    while is_call(node, *LAYOUT_OPS, *cuts, *CASTS):
        node = node.args[0]
    return is_weight_input(node)


def _computed_weight(what: str, node, linear: torch.fx.Node, bias, x2d: torch.fx.Node, rhs: torch.fx.Node) -> ComputedWeight:
    """The refusal of `linear` = x2d @ rhs (+ bias), whose weight or bias (`what`, read from `node`) is cut
    or cast from a parameter in the graph; it carries the linear read as if rhs were a parameter."""
    transposed = is_call(rhs, aten.permute.default) and list(rhs.args[1]) == [1, 0]
    projection = Projection(linear, x2d, [rhs.args[0] if transposed else rhs], [] if bias is None else [bias], not transposed)
    while is_call(node, *LAYOUT_OPS, aten.t.default):
        node = node.args[0]
    if is_call(node, *CASTS):
        reason = (
            f"projection {what} is a parameter cast to {val(node).dtype} in the graph (autocast, or a module in "
            "another dtype than its input), not a parameter"
        )
    else:
        reason = f"projection {what} is computed in the graph, not a parameter"
    return ComputedWeight(reason, projection)


def feeds_k_math(projection: Optional[Projection], same_value: Optional[ValueKeys] = None) -> bool:
    """Does a K norm or RoPE (matching or not) read `projection`'s output? True when unknown."""
    if projection is None:
        return True
    try:
        projection = split_into_layers(projection)
        sources = branch_sources(projection)
    except Exception:
        return True
    for source in sources:
        try:
            match_k_branch(projection, source, same_value)
        except NotKBranch:
            continue
        except Exception:  # noqa: BLE001  (K math that deviates, or a graph not foreseen: worth naming)
            pass
        return True
    return False


class NotKBranch(NoMatch):
    """The branch has neither a norm nor a rotary embedding (a V projection, say): nothing to report."""


def size_hint(size, fallback: int = 8) -> int:
    """An example value for a (possibly symbolic) size; `fallback` for unbacked sizes with no example."""
    if isinstance(size, torch.SymInt):
        hint = size.node._hint
        return fallback if hint is None else int(hint)
    return int(size)


def is_call(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def val(node: torch.fx.Node):
    return node.meta.get("val")


def hinted(x) -> Union[int, list, object]:
    """Replace symbolic sizes (SymInt values or nodes producing them) by their example values."""
    if isinstance(x, torch.fx.Node):
        x = val(x)
    if isinstance(x, torch.SymInt):
        return size_hint(x)
    if isinstance(x, (list, tuple)):
        return type(x)(hinted(e) for e in x)
    return x


def static_shape(node: torch.fx.Node) -> list[int]:
    return [size_hint(s) for s in val(node).shape]


def is_weight_input(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op in ("placeholder", "get_attr")


@dataclasses.dataclass
class Projection:
    """Linears whose output rows are tokens: out = x2d @ W.T (+ b), or such outputs concatenated.

    A plain mm/addmm has one weight. `torch.stack([linear_l(x) for l], dim=1)`, which Inductor spells
    `cat([mm_0, mm_1, ...], 1)`, is one Projection over n_layers weights of layer_width rows each.
    """

    node: torch.fx.Node  # the mm / addmm, or the cat of several
    x2d: torch.fx.Node
    weights: list[torch.fx.Node]  # each [layer_width, hidden], [hidden, layer_width] if weight_transposed
    biases: list[torch.fx.Node]  # [] or one [layer_width] per weight
    weight_transposed: bool  # True when a weight is stored [hidden, out_features] (`x @ W`, or a folded constant)
    n_layers: int = 1
    parts: tuple = ()  # the mm nodes of a concatenated projection

    @property
    def layer_width(self) -> int:
        return self.out_features // self.n_layers

    @property
    def out_features(self) -> int:
        return static_shape(self.node)[1]


def bias_add_of(mm: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The `mm + bias` node when mm's only use adds a 1-D bias parameter (Inductor unfuses addmm on GPU)."""
    if len(mm.users) != 1:
        return None
    (add,) = mm.users
    if not is_call(add, aten.add.Tensor) or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    bias = _other_arg(add, mm)
    if not is_parameter_rows(bias) or static_shape(bias) != static_shape(mm)[-1:]:
        return None  # a [1] bias broadcasts one value over every column: not a per-column bias
    return add


def is_product(node) -> bool:
    """A linear's product: an mm/addmm, or the cut of one that Inductor zero-padded (`padded_linears`)."""
    return is_call(node, *PROJECTION_OPS) or (isinstance(node, torch.fx.Node) and padded_linears.padded_linear(node) is not None)


def match_projection(node: torch.fx.Node) -> Projection:
    padded = padded_linears.padded_linear(node)
    if padded is not None:  # cut out of a product Inductor zero-padded: the linear it computes
        return _linear(node, padded.bias, padded.x2d, padded.rhs)
    if is_call(node, aten.add.Tensor):
        mm = next((a for a in node.args[:2] if is_call(a, aten.mm.default)), None)
        if mm is None or bias_add_of(mm) is not node:
            raise NoMatch("not a linear projection")
        inner = match_projection(mm)
        return dataclasses.replace(inner, node=node, biases=[_other_arg(node, mm)])
    if is_call(node, aten.mm.default):
        return _linear(node, None, node.args[0], node.args[1])
    if is_call(node, aten.addmm.default):
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            raise NoMatch("addmm with alpha/beta scaling")
        return _linear(node, node.args[0], node.args[1], node.args[2])
    raise NoMatch("not a linear projection")


def _linear(node: torch.fx.Node, bias, x2d: torch.fx.Node, rhs: torch.fx.Node) -> Projection:
    """node = x2d @ rhs (+ bias) as a Projection, when rhs is a weight parameter transposed, a parameter
    stored [hidden, out_features] or a folded constant, and bias a parameter with one value per column."""
    if bias is not None:
        if not is_parameter_rows(bias) or len(val(bias).shape) != 1:
            if _cut_from_parameter(bias):
                raise _computed_weight("bias", bias, node, bias, x2d, rhs)
            raise NoMatch("projection bias is computed in the graph, not a parameter")
        if static_shape(bias) != static_shape(node)[-1:]:
            raise NoMatch(f"projection bias has shape {static_shape(bias)}, not one value per output column")
    biases = [bias] if bias is not None else []
    if is_call(rhs, aten.permute.default) and list(rhs.args[1]) == [1, 0] and is_parameter_rows(rhs.args[0]):
        return Projection(node, x2d, [rhs.args[0]], biases, False)
    if is_weight_input(rhs) and (rhs.op == "get_attr" or (val(rhs).dim() == 2 and static_shape(x2d)[-1] > 1)):
        return Projection(node, x2d, [rhs], biases, True)  # stored [hidden, out]: `x @ W`, or folded by freezing
    # a contraction over the hidden size of a weight cut from a parameter; not, e.g., rotary angles'
    # outer product (inner size 1)
    if static_shape(x2d)[-1] > 1 and _cut_from_parameter(rhs):
        raise _computed_weight("weight", rhs, node, bias, x2d, rhs)
    raise NoMatch("not a linear projection")


def _is_column_cat(node) -> bool:
    """cat(..., dim=1) of 2-D tensors."""
    return (
        is_call(node, aten.cat.default)
        and len(val(node).shape) == 2
        and (node.args[1] if len(node.args) > 1 else 0) % 2 == 1
        and len(node.args[0]) >= 2
    )


def _column_cat_leaves(node: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """(leaves, inner cats) of a column concatenation, nested ones flattened in column order
    (`torch.stack([torch.cat([k_proj(x), v_proj(x)], -1) for ...], 1)` reaches the graph as cat of cats)."""
    leaves, inner = [], []
    for part in node.args[0]:
        if _is_column_cat(part) and len(part.users) == 1:
            part_leaves, part_inner = _column_cat_leaves(part)
            leaves += part_leaves
            inner += [part, *part_inner]
        else:
            leaves.append(part)
    return leaves, inner


def match_concat_projection(node: torch.fx.Node) -> Projection:
    """cat([linear_0(x2d), linear_1(x2d), ...], dim=1) of equal widths, nested cats flattened: the
    stacked spelling."""
    if not _is_column_cat(node):
        raise NoMatch("not a concatenation of projections")
    leaves, inner = _column_cat_leaves(node)
    parts = [match_projection(p) for p in leaves]
    first = parts[0]
    same_value = ValueKeys()
    for part in parts:
        same_input = same_value(part.x2d) == same_value(first.x2d)
        if not same_input or part.out_features != first.out_features or part.weight_transposed:
            raise NoMatch("concatenated projections differ in input or width")
        if bool(part.biases) != bool(first.biases) or len(part.node.users) != 1:
            raise NoMatch("concatenated projections differ in bias or are used elsewhere")
    return Projection(
        node,
        first.x2d,
        [w for p in parts for w in p.weights],
        [b for p in parts for b in p.biases],
        False,
        n_layers=len(parts),
        parts=tuple(p.node for p in parts) + tuple(inner),
    )


def base_of(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor a chain of layout ops starts from (used to see that branches read the same input)."""
    while is_call(node, *LAYOUT_OPS):
        node = node.args[0]
    return node


# A K branch's layout ops may also broadcast heads (Falcon's K heads expanded to every query head before
# RoPE): the norm and the rotation work per head, so they commute with that copy, and the rewrite replays it.
K_LAYOUT_OPS = LAYOUT_OPS | {aten.expand.default}


def is_unit_scale(node) -> bool:
    """`x * 1`: the same values in any float format (Falcon-H1's `key_multiplier` at its default; `1 / t`
    reaches the graph as a reciprocal times the numerator 1)."""
    if not is_call(node, aten.mul.Tensor) or len(node.args) != 2 or node.kwargs:
        return False
    return any(isinstance(a, (int, float)) and not isinstance(a, bool) and a == 1 for a in node.args)


def follow_layout(
    node: torch.fx.Node, ops=K_LAYOUT_OPS, side_readers: bool = False
) -> tuple[list[torch.fx.Node], torch.fx.Node]:
    """Walk forward through single-user layout ops (`ops`) and `x * 1`; return them and the last node
    reached. With `side_readers`, also through a node that other ops read too (the raw K returned or kept
    beside its norm and RoPE) when exactly one of its users is such a layout op."""
    chain = []
    while node.users:
        steps = [u for u in node.users if (is_call(u, *ops) or is_unit_scale(u)) and u.args[0] is node]
        if len(steps) != 1 or (len(node.users) > 1 and not side_readers):
            break
        chain.append(steps[0])
        node = steps[0]
    return chain, node


@dataclasses.dataclass
class RMSNorm:
    out: torch.fx.Node
    weight: Optional[torch.fx.Node]  # the weight parameter: [head_dim], [n_layers, head_dim] (stacked), None: no weight
    weight_shape: list[int]  # the weight as the norm broadcasts it (e.g. [n_layers, 1, head_dim])
    eps: Union[float, torch.fx.Node]
    width: int  # size of the normalised (last) dim
    weight_offset: float = 0.0  # the norm scales by (weight_offset + weight): 1.0 in Gemma's form
    weight_in_float32: bool = False  # weight applied before the one rounding back (else after it)
    round_before_rope: bool = True  # False: the float32 result feeds the RoPE, which rounds once at its end


def _single_user(node: torch.fx.Node, what: str) -> torch.fx.Node:
    if len(node.users) != 1:
        raise NoMatch(f"{what} has {len(node.users)} users, expected 1")
    return next(iter(node.users))


def _other_arg(node: torch.fx.Node, known) -> object:
    a, b = node.args[:2]
    if a is known:
        return b
    if b is known:
        return a
    raise NoMatch(f"{node.name} does not read {known}")


def _is_cast(node, dtype=None) -> bool:
    return is_call(node, prims.convert_element_type.default) and (dtype is None or node.args[1] == dtype)


def starts_norm(node: torch.fx.Node) -> bool:
    """Does `node` feed something that looks like a normalisation (so a mismatch is worth reporting)?"""
    for user in node.users:
        if _is_cast(user, FLOAT32):
            return any(starts_norm_op(u) for u in user.users) or starts_norm(user)
        if starts_norm_op(user):
            return True
    return False


def starts_norm_op(node) -> bool:
    return is_call(
        node,
        aten.pow.Tensor_Scalar,
        aten.mean.dim,
        aten.var_mean.correction,
        aten.var.correction,
        aten.sub.Tensor,
        aten.sum.dim_IntList,
    ) or (is_call(node, aten.mul.Tensor) and node.args[0] is node.args[1])


def _match_inverse_rms(
    upcast: torch.fx.Node, rank: int, side_readers: bool = False
) -> tuple[torch.fx.Node, Union[float, torch.fx.Node]]:
    """Match x * rsqrt(mean(x^2, -1) + eps) (or x / sqrt(..), x * (1 / sqrt(..))) on `upcast`; return the
    normalised node and eps. `side_readers`: upcast may have readers besides those two."""
    upcast_users = list(upcast.users)
    if any(is_call(u, aten.var_mean.correction, aten.var.correction, aten.sub.Tensor) for u in upcast_users):
        raise NoMatch("K norm subtracts the mean (LayerNorm), not an RMSNorm")
    squares = [
        u
        for u in upcast_users
        if (is_call(u, aten.pow.Tensor_Scalar) and u.args[0] is upcast)
        or (is_call(u, aten.mul.Tensor) and u.args[0] is upcast and u.args[1] is upcast)
    ]
    if len(squares) != 1 or (len(upcast_users) != 2 and not side_readers):
        raise NoMatch("K norm is not x * rsqrt(mean(x^2) + eps)")
    square = squares[0]
    if is_call(square, aten.pow.Tensor_Scalar) and square.args[1] != 2:
        raise NoMatch(f"K norm uses x^{square.args[1]}, not x^2")
    mean = reduced = _single_user(square, "x^2")
    if is_call(mean, aten.sum.dim_IntList):  # sum(x^2) / head_dim spells the mean
        reduced = _single_user(mean, "sum(x^2)")
        if not (is_call(reduced, aten.div.Tensor) and reduced.args[0] is mean):
            raise NoMatch("K norm sums x^2 without dividing by the head dim (an L2 norm, not an RMSNorm)")
        if reduced.args[1] != static_shape(upcast)[-1]:
            raise NoMatch("K norm divides sum(x^2) by something other than the head dim instead of taking the mean")
    elif not is_call(mean, aten.mean.dim):
        raise NoMatch("K norm does not take the mean of x^2")
    dims = [d % rank for d in mean.args[1]]
    if dims != [rank - 1]:
        raise NoMatch(f"K norm reduces over dims {list(mean.args[1])}, not the last (head) dim alone")
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if not keepdim:  # mean(x^2, -1).unsqueeze(-1) spells keepdim=True
        restored = _single_user(reduced, "mean(x^2)")
        if not (is_call(restored, aten.unsqueeze.default) and restored.args[1] % rank == rank - 1):
            raise NoMatch("K norm's mean drops the head dim (keepdim=False) and does not restore it as the last dim")
        reduced = restored
    add_eps = _single_user(reduced, "mean(x^2)")
    if not is_call(add_eps, aten.add.Tensor, aten.add.Scalar) or add_eps.kwargs.get("alpha", 1) != 1:
        raise NoMatch("K norm eps is not added to mean(x^2) inside the rsqrt (eps sits elsewhere)")
    eps = _other_arg(add_eps, reduced)
    if isinstance(eps, torch.fx.Node):
        if not isinstance(val(eps), torch.Tensor) or val(eps).dim() != 0:
            raise NoMatch("K norm eps is not a scalar")
    elif isinstance(eps, int) and not isinstance(eps, bool):
        eps = float(eps)
    elif not isinstance(eps, float):
        raise NoMatch("K norm eps is not a float")
    root = _single_user(add_eps, "mean(x^2) + eps")
    if is_call(root, aten.rsqrt.default) or (is_call(root, aten.pow.Tensor_Scalar) and root.args[1] == -0.5):
        inverse = root
    elif is_call(root, aten.sqrt.default):
        after = _single_user(root, "sqrt(mean(x^2) + eps)")
        if is_call(after, aten.div.Tensor) and after.args[0] is upcast and after.args[1] is root:
            return after, eps  # x / sqrt(...)
        if not is_call(after, aten.reciprocal.default):
            raise NoMatch("K norm does not divide x by sqrt(mean(x^2) + eps)")
        inverse = after
        while is_unit_scale(_single_user(inverse, "1 / sqrt(...)")):
            inverse = _single_user(inverse, "1 / sqrt(...)")
    else:
        raise NoMatch("K norm applies something other than rsqrt to mean(x^2) + eps (eps sits elsewhere)")
    scaled = _single_user(inverse, "rsqrt")
    if not is_call(scaled, aten.mul.Tensor) or {id(a) for a in scaled.args[:2]} != {id(upcast), id(inverse)}:
        raise NoMatch("K norm does not multiply x by rsqrt(mean(x^2) + eps)")
    return scaled, eps


def _is_whole_slice(node) -> bool:
    """`t[:]` on some dim: a no-op slice (how `w[None, :, None, :]` reaches the graph)."""
    if not is_call(node, aten.slice.Tensor):
        return False
    dim, start, end, step = slice_args(node)
    return start == 0 and step == 1 and isinstance(end, int) and end >= static_shape(node.args[0])[dim]


def _stacked_weight_row(node) -> bool:
    """Row i of norm weights stacked for all layers, `W[i]` of a `[L, D]` view of a parameter: a 1-D select
    along dim 0 (`layer_unstack` reads a norm over all layers' K with weights `[L, 1, 1, D]` so), or
    `W.unbind(0)[i]`."""
    source = _stacked_entry_of(node)
    if source is None:
        return False
    while is_call(source, *RESHAPES):
        source = source.args[0]
    return val(node).dim() == 1 and is_weight_input(source)


def _weights_stacked_in_graph(node) -> bool:
    """`torch.stack` of one [D] weight per layer in the forward, as the post-grad graph spells it: a cat along
    dim 0 of the weights (or of their views), read as the `[n_layers, D]` table it is."""
    if not is_call(node, aten.cat.default) or (node.args[1] if len(node.args) > 1 else 0) != 0:
        return False
    parts = node.args[0]
    sources = []
    for part in parts:
        while is_call(part, aten.unsqueeze.default, *RESHAPES):
            part = part.args[0]
        sources.append(part)
    shapes = {tuple(static_shape(part)) for part in sources}
    return len(parts) > 1 and all(is_weight_input(part) for part in sources) and len(shapes) == 1 and len(shapes.pop()) == 1


def norm_weight_rows(weight: torch.fx.Node) -> list[int]:
    """The shape of a norm's weight as layers x features: `[n_layers, D]` for weights stacked in the graph,
    else the parameter's own without its dims of size 1 (`[L, 1, D]` and `[1, 1, D]` parameters, shaped to
    broadcast, are `[L, D]` and `[D]`)."""
    if _weights_stacked_in_graph(weight):
        return [len(weight.args[0]), val(weight).numel() // len(weight.args[0])]
    shape = static_shape(weight)
    return [size for size in shape[:-1] if size != 1] + shape[-1:]


def _norm_weight_parameter(weight: torch.fx.Node) -> tuple[torch.fx.Node, float]:
    """The parameter behind a norm's weight operand and its offset: w, w.float(), (1 + w.float()), and
    their views (unsqueeze, view, whole slices) in any order; or one layer's row of stacked weights
    (`_stacked_weight_row`); or the weights stacked in the graph (`_weights_stacked_in_graph`)."""
    offset, node = 0.0, weight
    while not is_weight_input(node) and not _stacked_weight_row(node) and not _weights_stacked_in_graph(node):
        if _is_cast(node) or _is_whole_slice(node) or is_call(node, aten.unsqueeze.default, aten.view.default, aten.reshape.default):
            node = node.args[0]
            continue
        if is_call(node, aten.add.Tensor, aten.add.Scalar) and node.kwargs.get("alpha", 1) == 1 and not offset:
            scalars = [a for a in node.args[:2] if isinstance(a, (int, float)) and not isinstance(a, bool)]
            tensors = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
            if len(scalars) == 1 and len(tensors) == 1:
                offset, node = float(scalars[0]), tensors[0]
                continue
        raise NoMatch("K norm weight is computed in the graph, not a parameter")
    return node, offset


def _weightless(after: torch.fx.Node, normed: torch.fx.Node) -> bool:
    """Is the normalised K used as is, not scaled by a norm weight? A mul by anything but a parameter (a
    rotary table) counts as use; the rotation is then proven on its own (rotary_action)."""
    if not is_call(after, aten.mul.Tensor):
        return True
    weight = _other_arg(after, normed)
    if not isinstance(weight, torch.fx.Node):
        return False  # scaled by a constant: not a form the op has
    try:
        _norm_weight_parameter(weight)
    except NoMatch:
        return True
    return False


def match_rms_norm(x: torch.fx.Node, side_readers: bool = False) -> RMSNorm:
    """Match a per-head RMSNorm starting at x, in any of its common forms:

    weight * (x.float() * rsqrt(mean(x.float()^2, -1, keepdim) + eps)).to(x.dtype)     Hugging Face
    ((x.float() * rsqrt(...)) * (offset + weight.float())).to(x.dtype)               SGLang native, Gemma
    (x.float() * rsqrt(...)) * weight.float(), rounded only after the RoPE            SGLang reference
    x * rsqrt(...) * weight                                                            no upcast / float32
    with x / sqrt(...) or x * (1 / sqrt(...)) for x * rsqrt(...), eps added either way round; and without
    a weight (`F.rms_norm(x, (D,))`, modded-nanogpt), where the normalised K is the norm's output (weight
    None: the fused op then scales by ones). With `side_readers`, x may have readers besides the norm (its
    one float32 upcast, then): they read the raw K, which the rewrite leaves to them.
    """
    in_dtype = val(x).dtype
    width = static_shape(x)[-1]
    rank = len(val(x).shape)
    upcast = x
    if in_dtype != FLOAT32:
        casts = [u for u in x.users if _is_cast(u, FLOAT32)]
        if casts:
            if len(x.users) != 1 and not (side_readers and len(casts) == 1):
                raise NoMatch("K norm input has other users besides its float32 upcast")
            upcast = casts[0]
    normed, eps = _match_inverse_rms(upcast, rank, side_readers and upcast is x)
    weightless = RMSNorm(out=normed, weight=None, weight_shape=[], eps=eps, width=width)
    # no weight, the float32 result feeding the RoPE (F.rms_norm then a float32 RoPE, once Inductor has
    # dropped the round trip to the input dtype between them); the op's ones then scale in float32
    weightless_float32 = dataclasses.replace(weightless, weight_in_float32=True, round_before_rope=False)
    if len(normed.users) > 1:  # used as is by several ops (the RoPE's pieces)
        return weightless if upcast is x else weightless_float32
    after = _single_user(normed, "x * rsqrt(...)")
    if upcast is not x and is_call(after, aten.clone.default) and len(after.users) == 1:
        (cast,) = after.users  # a contiguous copy before the rounding (`_fused_rms_norm`'s decomposition)
        if _is_cast(cast, in_dtype):
            after = cast
    weight_in_float32, round_before_rope = False, True
    if upcast is not x and _is_cast(after, in_dtype):  # round first, then the weight (Hugging Face)
        if len(after.users) > 1:  # the rounded normalised K used as is
            return dataclasses.replace(weightless, out=after)
        normed, after = after, _single_user(after, "normalised K")
        out = after
    elif upcast is not x:  # the weight in float32, then one rounding (SGLang native, Gemma)
        if _weightless(after, normed):
            return weightless_float32
        weight_in_float32 = True
        cast_back = [u for u in after.users if _is_cast(u, in_dtype)]
        (copy,) = after.users if len(after.users) == 1 else (None,)
        if is_call(copy, aten.clone.default) and len(copy.users) == 1:  # a contiguous copy, then the cast
            cast_back = [u for u in copy.users if _is_cast(u, in_dtype)]
        if len(after.users) == 1 and cast_back:
            out = cast_back[0]
        else:  # still float32: the RoPE that follows rounds (its result must come back in_dtype)
            out, round_before_rope = after, False
    else:
        out = after
    if not weight_in_float32 and _weightless(after, normed):  # what follows is not a weight: the RoPE, say
        return dataclasses.replace(weightless, out=normed)
    if not is_call(after, aten.mul.Tensor):
        raise NoMatch("K norm has no elementwise weight after normalising")
    weight = _other_arg(after, normed)
    if not isinstance(weight, torch.fx.Node):
        raise NoMatch("K norm scales by a constant, not a weight")
    parameter, offset = _norm_weight_parameter(weight)
    if val(out).dtype != (in_dtype if round_before_rope else FLOAT32):
        raise NoMatch(f"K norm output is {val(out).dtype}, its input {in_dtype}")
    return RMSNorm(
        out=out,
        weight=parameter,
        weight_shape=static_shape(weight),
        eps=eps,
        width=width,
        weight_offset=offset,
        weight_in_float32=weight_in_float32,
        round_before_rope=round_before_rope,
    )


def slice_args(node) -> tuple:
    args = list(node.args) + [None] * (5 - len(node.args))
    dim, start, end, step = args[1:5]
    dim = node.kwargs.get("dim", dim if dim is not None else 0)
    start = node.kwargs.get("start", start if start is not None else 0)
    end = node.kwargs.get("end", end if end is not None else SLICE_END_MAX)
    step = node.kwargs.get("step", step if step is not None else 1)
    return dim, start, end, step


def _last_dim_slice(node, source, rank, width, axis: int = -1) -> Optional[tuple[int, int, int]]:
    """(start, end, step) when node = source[..., start:end:step] along `axis` (the last dim unless
    given), else None; negative bounds count from the end, and both are clamped to [0, width] as Python
    slicing does (`qkv[..., -2 * kv : -kv]` is columns [width - 2 * kv, width - kv))."""
    if not is_call(node, aten.slice.Tensor) or node.args[0] is not source:
        return None
    dim, start, end, step = slice_args(node)
    if not all(isinstance(v, int) for v in (dim, start, end, step)) or dim % rank != axis % rank:
        return None
    start, end = (min(max(b + width if b < 0 else b, 0), width) for b in (start, end))
    return start, end, step


def constant_index_cut(node) -> Optional[tuple[int, int]]:
    """(axis, i) when node = source[..., [i], ...]: `aten.index` by one constant one-element integer index
    (`torch.full([1], i)`, as `qkv[..., [-2], :]` traces) on one axis, i counted from the start. It holds
    the same elements as the one-wide slice `source[..., i : i + 1, ...]` (as a copy)."""
    if not is_call(node, aten.index.Tensor) or len(node.args) < 2:
        return None
    indices = list(node.args[1])
    present = [axis for axis, index in enumerate(indices) if index is not None]
    if len(present) != 1:
        return None
    axis = present[0]
    index = indices[axis]
    if not (is_call(index, aten.full.default) and list(index.args[0]) == [1] and type(index.args[1]) is int):
        return None
    if val(index).dtype not in (torch.int64, torch.int32):
        return None
    size = static_shape(node.args[0])[axis]
    position = index.args[1] + size if index.args[1] < 0 else index.args[1]
    return (axis, position) if 0 <= position < size else None


@dataclasses.dataclass
class HeadLayout:
    """How a branch tensor's axes relate to the projection: out[...] = proj[token, layer*P + head*D + d]."""

    num_heads: int
    head_dim: int
    head_axis: int
    token_axes: list[int]  # axes of the tensor carrying tokens, outermost first
    layer_axis: Optional[int] = None  # the axis enumerating layers (stacked spelling only)


def replay(nodes: list[torch.fx.Node], start: torch.Tensor, sizes: ProbeSizes = FULL_SIZE) -> torch.Tensor:
    """Apply the layout ops `nodes` (a forward chain) to a real tensor (token sizes mapped by `sizes`); a
    constant index cut (`constant_index_cut`) is applied as the one-wide slice it equals."""
    value = start
    for node in nodes:
        if is_unit_scale(node):
            continue
        cut = constant_index_cut(node)
        if cut is not None:
            axis, position = cut
            if value.shape[axis] != static_shape(node.args[0])[axis]:
                raise ProbeMismatch(f"{node.format_node()} cuts a token axis")
            value = value.narrow(axis, position, 1)
            continue
        value = probe_call(node, node.target, [value, *hinted(list(node.args[1:]))], hinted(dict(node.kwargs)), sizes)
    return value


def _axis_step(t: torch.Tensor, axis: int) -> int:
    if t.shape[axis] < 2:
        return 0
    return int(t.narrow(axis, 1, 1).flatten()[0] - t.narrow(axis, 0, 1).flatten()[0])


def _varies_along(values: torch.Tensor, axis: int) -> bool:
    return not bool((values == values.narrow(axis, 0, 1)).all())


def _enumerating_axis(values: torch.Tensor, count: int, exclude: tuple = ()) -> Optional[int]:
    """The one axis (not the last) along which `values` runs 0..count-1, each value possibly repeated r
    times in a row (heads broadcast to query heads: `k.expand(..., kv, r, d).reshape(..., kv * r, d)`);
    None if count == 1 and none does."""
    axes = [a for a in range(values.dim() - 1) if a not in exclude and _varies_along(values, a)]
    if len(axes) == 1:
        along = values.movedim(axes[0], 0).reshape(values.shape[axes[0]], -1)[:, 0]
        repeats = len(along) // count
        if repeats * count == len(along) and torch.equal(along, torch.arange(count).repeat_interleave(repeats)):
            return axes[0]
    if count == 1 and not axes:
        return None
    raise NoMatch("K heads/layers are not laid out along one axis each")


def head_layout(index: torch.Tensor, source: "BranchSource", row_width: int, layer_width: int, n_layers: int, features: int, head_dim: int) -> HeadLayout:
    """Read the token, layer, head and head-dim axes off an index tensor (flat positions into the projection).

    Raises NoMatch unless the last axis is exactly one head's `head_dim` consecutive features, one axis
    enumerates the heads (and one the layers, for a stacked projection), and the remaining axes are a
    row-major split of the projection rows.
    """
    tokens = torch.div(index, row_width, rounding_mode="floor")
    within_row = index % row_width
    layers = torch.div(within_row, layer_width, rounding_mode="floor")
    head_stride = source.head_stride or head_dim
    column = within_row % layer_width - source.col_start  # head h, dim d: h * head_stride + d
    last = index.shape[-1]
    if last != head_dim or features % head_dim:
        raise NoMatch(f"normalised/rotated over {last} features, not per head ({head_dim})")
    num_heads = features // head_dim
    heads = torch.div(column, head_stride, rounding_mode="floor")
    if (column < 0).any() or (heads >= num_heads).any():
        raise NoMatch("K branch reads outside its projection columns")
    if not bool((column % head_stride == torch.arange(head_dim)).all()):
        raise NoMatch(f"last dim is not one head's {head_dim} consecutive features")
    layer_axis = _enumerating_axis(layers, n_layers)
    head_axis = _enumerating_axis(heads, num_heads, exclude=(layer_axis,))
    if head_axis is None:  # a single head: a size-1 axis, or one it is broadcast along, carrying no tokens or layers
        spare = [a for a in range(index.dim() - 1) if a != layer_axis and not _varies_along(index, a)]
        if not spare:
            raise NoMatch("single-head K branch has no head axis")
        head_axis = max(spare, key=lambda a: (index.shape[a] > 1, a))  # the broadcast axis, if any
    token_axes = [a for a in range(index.dim() - 1) if a not in (head_axis, layer_axis)]
    token_axes.sort(key=lambda a: -_axis_step(tokens, a))
    expected = torch.zeros_like(tokens)
    stride = 1
    for axis in reversed(token_axes):
        shape = [1] * index.dim()
        shape[axis] = index.shape[axis]
        expected = expected + torch.arange(index.shape[axis]).view(shape) * stride
        stride *= index.shape[axis]
    if not bool((tokens == expected).all()):
        raise NoMatch("K tokens are not a plain reshape of the projection rows")
    return HeadLayout(num_heads, head_dim, head_axis, token_axes, layer_axis)


@dataclasses.dataclass
class KBranch:
    """One layer's K branch: projection columns -> [norm] -> rotary, and how to rebuild its output."""

    projection: Projection
    source: "BranchSource"
    layout_before_norm: list[torch.fx.Node]
    layout_after_norm: list[torch.fx.Node]
    norm: Optional[RMSNorm]
    rotary: rotary_action.Rotation
    heads: HeadLayout

    @property
    def features(self) -> int:
        return self.heads.num_heads * self.heads.head_dim

    @property
    def n_layers(self) -> int:
        return self.projection.n_layers

    @property
    def output(self) -> torch.fx.Node:
        return self.rotary.out


def check_norm_weight(norm: RMSNorm, heads: HeadLayout, n_layers: int, rank: int) -> None:
    """The norm weight must be one [head_dim] vector per layer, broadcast over tokens and heads; with
    layers stacked on an axis, also one [head_dim] vector for every layer, broadcast over that axis too."""
    if norm.weight is None:
        return
    shape = [1] * (rank - len(norm.weight_shape)) + list(norm.weight_shape)
    expected = [1] * rank
    expected[-1] = heads.head_dim
    parameter = norm_weight_rows(norm.weight)
    shared = heads.layer_axis is not None and parameter == [heads.head_dim]
    if heads.layer_axis is not None and not shared:
        expected[heads.layer_axis] = n_layers
    per_layer = [heads.head_dim] if n_layers == 1 or shared else [n_layers, heads.head_dim]
    if shape != expected or parameter != per_layer:
        raise NoMatch(f"K norm weight has shape {norm.weight_shape}, expected {per_layer} (one weight per head dim)")


def _check_norm_input(at_norm: torch.Tensor, layout_at, norm: RMSNorm, n_layers: int, features: int, head_dim: int) -> None:
    """The norm must see one head's features on its last dim and one [head_dim] weight per layer."""
    if at_norm.shape[-1] == features and features != head_dim:
        raise NoMatch(f"RMSNorm over the whole projection ({features} features), not per head ({head_dim})")
    try:
        heads = layout_at(at_norm)
    except NoMatch:
        if n_layers != 1:
            raise
        # tokens and heads merged on one axis (`k.reshape(-1, head_dim)`): per head all the same
        heads = HeadLayout(features // head_dim, head_dim, head_axis=0, token_axes=[])
    check_norm_weight(norm, heads, n_layers, at_norm.dim())


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rotation_after(
    start: torch.fx.Node,
    required: bool,
    same_value: Optional[ValueKeys] = None,
    side_readers: bool = False,
    out_dtype: Optional[torch.dtype] = None,
):
    """The rotary embedding applied at the end of, or part way along, the layout chain after `start`
    (ending in `out_dtype` where it can end at several casts: `rotary_action.match_rotation`).

    Returns (layout ops up to the rotation's input, that input, the Rotation). A chain may go on past the
    rotation's input (`x.reshape(..., -1, 2)` in a pair-wise rotary); the furthest point that is rotated
    wins. Raises NoMatch, or NotKBranch when nothing looks like K (not `required`, no mul/slice after).
    """
    chain, _ = follow_layout(start, side_readers=side_readers)
    points = [start] + chain
    reasons = []
    for end in range(len(points), 0, -1):
        try:
            rotation = rotary_action.match_rotation(points[end - 1], same_value, out_dtype)
            return chain[: end - 1], points[end - 1], rotation
        except rotary_action.NotRotary as reason:
            reasons.append(str(reason))
    _refuse_scaled_rotation(points[-1], same_value)
    _refuse_clamped_rotation(points, same_value)
    looks_rotated = any(is_call(u, aten.mul.Tensor, aten.slice.Tensor) for p in points for u in p.users)
    # the most telling reason: one that found a rotary-like region; with none, nothing K-like follows (a
    # linear whose output is normalised and never rotated: an o_proj before a post-attention norm)
    found = [r for r in reasons if r != rotary_action.NO_ROTATION]
    if found and (required or looks_rotated):
        raise NoMatch(found[0])
    raise NotKBranch(reasons[0])


def _rotations_downstream(
    start: torch.fx.Node, same_value: Optional[ValueKeys], depth: int, width: Optional[int], through=None
):
    """For each value within `depth` ops after `start` (of last dim `width`, when given; reached through
    ops of `through` only, when given) that is multiplied or sliced: None when a rotary embedding is applied
    to it, else why not (`rotary_action.match_rotation`)."""
    seen, frontier = {start}, [start]
    for _ in range(depth):
        frontier = [n for n in frontier if n is start or through is None or is_call(n, *through)]
        frontier = list(dict.fromkeys(u for n in frontier for u in n.users if u not in seen and u.op == "call_function"))
        seen.update(frontier)
        for node in frontier:
            value = val(node)
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if width is not None and value.shape[-1] != width:
                continue
            if not any(is_call(u, aten.mul.Tensor, aten.slice.Tensor) for u in node.users):
                continue
            try:
                rotary_action.match_rotation(node, same_value)
                yield None
            except rotary_action.NotRotary as reason:
                yield str(reason)


def _rotated_downstream(start: torch.fx.Node, same_value: Optional[ValueKeys], depth: int = 12) -> bool:
    """Whether a rotary embedding is applied within `depth` ops after `start`, to a value with start's last
    dim: the K norm a branch failed to match is then worth reporting (not an MLP's gelu or a router's
    softmax, which also start like a norm)."""
    width = static_shape(start)[-1] if isinstance(val(start), torch.Tensor) else None
    return any(reason is None for reason in _rotations_downstream(start, same_value, depth, width))


def _refuse_scaled_rotation(end: torch.fx.Node, same_value: Optional[ValueKeys]) -> None:
    """NoMatch when K is multiplied by a constant and then rotated (Falcon-H1's `key_multiplier`): say so,
    rather than that nothing is rotated. The op has no K scale; applying it after the op's rounding would
    round twice where the graph rounds once."""
    scaled = next(iter(end.users)) if len(end.users) == 1 else None
    if not is_call(scaled, aten.mul.Tensor) or end not in scaled.args[:2]:
        return
    factor = _other_arg(scaled, end)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        return
    try:
        rotary_action.match_rotation(scaled, same_value)
    except rotary_action.NotRotary:
        return
    raise NoMatch(f"K is multiplied by a constant ({factor:g}) before its RoPE; the fused op has no K scale")


CLAMPS = (aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default, aten.hardtanh.default)
# what lies between a clamped projection and its K: more clamps, casts (a 16-bit clamp runs in float32),
# cuts and re-layouts
_CLAMP_TO_K = (
    *CLAMPS, *LAYOUT_OPS, *CASTS, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    operator.getitem,
)


def _refuse_clamped_rotation(points: list[torch.fx.Node], same_value: Optional[ValueKeys]) -> None:
    """NoMatch when K is clamped and then rotated (DBRX's and OLMo's `clip_qkv`): say so, rather than that
    nothing is rotated. The op has no clamp, and K is then no linear function of x."""
    for point in points:
        for user in [u for p in (point, *(u for u in point.users if is_call(u, *CASTS))) for u in p.users]:
            if not is_call(user, *CLAMPS):
                continue
            # rotated, or rotary-like (a region of K * cos and rotated K * sin the matcher then refused)
            reasons = _rotations_downstream(user, same_value, 8, None, _CLAMP_TO_K)
            if any(r != rotary_action.NO_ROTATION for r in reasons):
                raise NoMatch("K is clamped (clip_qkv) between its projection and its RoPE; the fused op has no clamp")


def match_k_branch(projection: Projection, source: "BranchSource", same_value: Optional[ValueKeys] = None) -> KBranch:
    """Match source -> layout -> [RMSNorm] -> layout -> rotary. Raises NoMatch with a reason.
    `same_value`: the caller's ValueKeys, shared so that keys are computed once per graph.

    A branch whose raw K other ops read too (returned, or kept for something else, before the norm and
    RoPE) is matched by a second walk that passes such readers by: after the rewrite they read the same
    values from the grouped projection's columns, and only the norm/RoPE output is replaced."""
    try:
        return _match_k_branch(projection, source, same_value, side_readers=False)
    except NoMatch as first:
        if not _read_beside_the_branch(source.node):
            raise
        try:
            return _match_k_branch(projection, source, same_value, side_readers=True)
        except NotKBranch:  # nothing K-like past the readers either: the first walk's reason stands
            raise first from None


def _read_beside_the_branch(node: torch.fx.Node) -> bool:
    """Does a node of node's layout chain have several readers (so a walk past them could go further)?"""
    chain, _ = follow_layout(node, side_readers=True)
    return any(len(n.users) > 1 for n in [node, *chain])


def _match_k_branch(projection: Projection, source: "BranchSource", same_value: Optional[ValueKeys], side_readers: bool) -> KBranch:
    features = static_shape(source.node)[-1]
    if source.group_view is not None:
        features *= static_shape(source.group_view)[-2]
    elif source.head_view is not None:
        features *= static_shape(source.node)[-2]
    elif source.chain is not None:
        features *= source.n_heads
    layout_before, node = follow_layout(source.node, side_readers=side_readers)
    dtype = val(projection.node).dtype
    norm = None
    if starts_norm(node):
        try:
            norm = match_rms_norm(node, side_readers)
        except NoMatch as reason:
            if not _rotated_downstream(node, same_value):  # nothing K-like: say what it lacks
                raise NotKBranch(rotary_action.NO_ROTATION) from reason
            raise
        layout_after, node, rotary = _rotation_after(norm.out, required=True, same_value=same_value, out_dtype=dtype)
    else:
        layout_before, node, rotary = _rotation_after(source.node, False, same_value, side_readers, dtype)
        layout_after = []
    if dtype not in SUPPORTED_DTYPES:
        raise NoMatch(f"K is {dtype}; the fused op supports float32, bfloat16 and float16")
    if val(rotary.out).dtype != dtype:
        raise NoMatch(f"K output is {val(rotary.out).dtype}, the projection {dtype}")
    if norm is not None and norm.weight is not None and val(norm.weight).dtype != dtype:
        raise NoMatch(f"K norm weight is {val(norm.weight).dtype}, K is {dtype}")
    head_dim = static_shape(node)[-1]
    heads = _branch_heads(projection, source, layout_before, layout_after, norm, features, head_dim)
    return KBranch(projection, source, layout_before, layout_after, norm, rotary, heads)


# Head layouts by branch signature: the layers of a decoder lay out K alike, simulated once.
_HEAD_LAYOUTS = OutcomeMemo((NoMatch,))


def _replayed(node: torch.fx.Node) -> tuple:
    """Everything `replay` (and its probe sizing) reads of one layout node."""
    first = node.args[0]
    shapes = lambda n: tuple(static_shape(n)) if isinstance(val(n), torch.Tensor) else None  # noqa: E731
    cut = constant_index_cut(node)
    return (
        node.target,
        plain(cut) if cut is not None else plain(hinted(list(node.args[1:]))),
        plain(hinted(dict(node.kwargs))),
        shapes(first) if isinstance(first, torch.fx.Node) else None,
        shapes(node),
    )


def _layout_signature(projection, source, layout_before, layout_after, norm, sizes, features, head_dim) -> tuple:
    """Everything the head-layout simulation of a branch reads, as plain data (TypeError if not plain)."""
    views = [v for v in (source.group_view, source.head_view) if v is not None]
    return (
        tuple(static_shape(projection.node)), projection.layer_width, projection.n_layers, features, head_dim,
        plain(sizes.mapping), tuple(static_shape(source.node)), source.col_start, source.head_stride,
        source.group_view is not None, source.head_view is not None, source.chain is not None,
        source.stride, source.n_heads, plain(source.roles),
        tuple(map(_replayed, source.prefix)), tuple(map(_replayed, views)), tuple(map(_replayed, source.chain or [])),
        tuple(map(_replayed, layout_before)), tuple(map(_replayed, layout_after)),
        None if norm is None else (
            plain(norm.weight_shape), None if norm.weight is None else tuple(static_shape(norm.weight))
        ),
    )  # fmt: skip


def _branch_heads(projection, source, layout_before, layout_after, norm, features: int, head_dim: int) -> HeadLayout:
    """The branch's HeadLayout from an index simulation (memoised by `_layout_signature`); NoMatch if the
    branch does not lay out whole heads."""
    sizes = _token_sizes(projection, source, layout_before + layout_after)
    arguments = (projection, source, layout_before, layout_after, norm, sizes, features, head_dim)
    heads = _HEAD_LAYOUTS.outcome(lambda: _layout_signature(*arguments), lambda: _simulate_heads(*arguments))
    return dataclasses.replace(heads, token_axes=list(heads.token_axes))


def _simulate_heads(projection, source, layout_before, layout_after, norm, sizes, features: int, head_dim: int) -> HeadLayout:
    rows, row_width = static_shape(projection.node)

    def layout_at(index: torch.Tensor) -> HeadLayout:
        return head_layout(index, source, row_width, projection.layer_width, projection.n_layers, features, head_dim)

    def simulate(sizes: ProbeSizes) -> HeadLayout:
        index = torch.arange(sizes(rows) * row_width, dtype=torch.int64).view(sizes(rows), row_width)
        index = source.index(index, features, sizes)
        at_norm = replay(layout_before, index, sizes)
        if norm is not None:
            _check_norm_input(at_norm, layout_at, norm, projection.n_layers, features, head_dim)
        return layout_at(replay(layout_after, at_norm, sizes))

    # the index simulation runs on real tensors (also inside a traced pass), over a few tokens when it can
    with unset_fake_temporarily():
        try:
            return simulate(sizes)
        except (ProbeMismatch, RuntimeError, IndexError):
            return simulate(FULL_SIZE)


def _token_sizes(projection: Projection, source: "BranchSource", chain: list[torch.fx.Node]) -> ProbeSizes:
    """Probe sizes for a branch's index simulation: the projection's row count and the sizes it splits
    into along the branch (e.g. B and T of `view(B, T, H, D)`)."""
    rows = static_shape(projection.node)[0]
    views = [v for v in (source.group_view, source.head_view) if v is not None] + (source.chain or [])
    nodes = source.prefix + views + chain
    dims = {n for node in nodes if isinstance(val(node), torch.Tensor) for n in static_shape(node)[:-1]}
    return ProbeSizes([rows] + [n for n in dims if n > 1 and rows % n == 0])


@dataclasses.dataclass
class BranchSource:
    """The tensor a K branch starts from: a projection, or columns cut from a fused one.

    Plain: [..., kv_size], projection columns col_start .. col_start + kv_size. Grouped (`group_view`
    set: a qkv projection laid out per query group, `qkv.view(..., groups, group_width)` then cut, as
    Megatron-LM does): [..., groups, head_dim], head g at columns g * group_width + col_start.
    Head cut (`head_view` set: `qkv.view(..., heads, head_dim)` cut along the heads): [..., H, head_dim],
    the columns col_start .. col_start + H * head_dim. Strided (`chain` set: views and permutes, then a cut
    along any axis but the last, as litgpt cuts its per-group qkv): its axes enumerate tokens (a
    row-major split of the rows), the heads, or nothing (size 1), in any order (`roles`).
    """

    node: torch.fx.Node
    col_start: int  # first projection column it holds (within a group, when grouped)
    prefix: list[torch.fx.Node]  # reshapes between the mm and the cut (they keep the last dim)
    group_view: Optional[torch.fx.Node] = None
    head_view: Optional[torch.fx.Node] = None
    chain: Optional[list[torch.fx.Node]] = None  # strided: the views, permutes and cut after the prefix
    stride: Optional[int] = None  # strided: columns between consecutive heads, None when adjacent
    n_heads: int = 0  # strided: heads in the piece
    # strided: each axis but the last: ("token", rank among the token axes, outermost first), ("head", None)
    # or ("unit", None) for a size-1 axis
    roles: Optional[list[tuple[str, Optional[int]]]] = None

    @property
    def head_stride(self) -> Optional[int]:
        """Columns between consecutive heads when they are not adjacent (grouped), else None."""
        if self.chain is not None:
            return self.stride
        return static_shape(self.group_view)[-1] if self.group_view is not None else None

    def output_shape(self, features: int) -> Optional[list]:
        """Shape args that lay one layer's K [tokens * features] out as this source, or None when the
        source is the projection itself ([tokens, features])."""
        if self.group_view is not None:
            return list(self.group_view.args[1][:-1]) + [static_shape(self.node)[-1]]
        if self.head_view is not None:
            return list(self.head_view.args[1][:-2]) + static_shape(self.node)[-2:]
        return list(self.prefix[-1].args[1][:-1]) + [features] if self.prefix else None

    def index(self, index: torch.Tensor, features: int, sizes: ProbeSizes = FULL_SIZE) -> torch.Tensor:
        """The projection's flat element index laid out as this source."""
        index = replay(self.prefix, index, sizes)
        if self.chain is not None:
            return replay(self.chain, index, sizes)
        if self.group_view is not None:
            width = static_shape(self.node)[-1]
            return replay([self.group_view], index, sizes)[..., self.col_start : self.col_start + width]
        if self.head_view is not None:
            heads, head_width = static_shape(self.node)[-2:]
            first = self.col_start // head_width
            return replay([self.head_view], index, sizes)[..., first : first + heads, :]
        return index[..., self.col_start : self.col_start + features]


def whole(projection: Projection) -> BranchSource:
    """The projection's whole output as a branch source."""
    return BranchSource(projection.node, 0, [])


def split_into_layers(projection: Projection) -> Projection:
    """A projection over weights stacked for all layers, `linear(x, W_all).view(T, L, width)` cut into K
    and V columns (the seed's [total_ctx, n_layers, kv_size*2] layout), counts as L layers; so does a
    concatenation of per-layer projections viewed that way."""
    node = projection.node
    if len(node.users) != 1:
        return projection
    (view,) = node.users
    shape = static_shape(view) if is_call(view, aten.view.default, aten.reshape.default) else []
    if len(shape) < 3 or shape[-2] < 2 or shape[-2] * shape[-1] != projection.out_features:
        return projection
    if not _column_slices(view, len(shape), shape[-1], 0):
        return projection  # heads, not layers: the view is not cut into K and V columns
    return dataclasses.replace(projection, n_layers=shape[-2])


def branch_sources(projection: Projection) -> list[BranchSource]:
    """Where K branches may start on a projection: the mm itself, or each column slice of it."""
    node, width = projection.node, projection.layer_width
    prefix = []
    while len(node.users) == 1:
        (user,) = node.users
        if not (is_call(user, aten.view.default, aten.reshape.default) and static_shape(user)[-1] == width):
            break
        prefix.append(user)
        node = user
    slices = _column_slices(node, len(val(node).shape), width, 0)
    if slices:
        return [BranchSource(sliced, col_start, prefix) for sliced, col_start in slices]
    grouped = _group_view_cuts(node, width)
    if grouped:
        group_view, cuts = grouped
        return [BranchSource(piece, start, prefix, group_view) for piece, start in cuts]
    heads = _head_cuts(node, width)
    if heads:
        head_view, cuts = heads
        return [BranchSource(piece, start, prefix, head_view=head_view) for piece, start in cuts]
    return _strided_cuts(projection, node, prefix) or [whole(projection)]


_CHAIN_OPS = (
    aten.view.default, aten.reshape.default, aten.permute.default, aten.transpose.int, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.clone.default,
)


def _strided_cuts(projection: Projection, node: torch.fx.Node, prefix: list) -> Optional[list[BranchSource]]:
    """Strided sources (BranchSource docstring): `node` viewed (and permuted), then cut along one axis
    (litgpt: `qkv.view(B, T, G, q + 2, hs).permute(0, 2, 3, 1, 4).split((q, 1, 1), dim=2)`; GPT-NeoX:
    `qkv.view(B, T, H, 3 * hs).transpose(1, 2).chunk(3, dim=-1)`; Falcon: `qkv.view(B, T, H, 3, hs)[..., 1, :]`;
    `qkv.view(B, T, 3, H, hs).unbind(2)`; PyTorch's packed in-projection, `qkv.unflatten(-1, (3, E))
    .unsqueeze(0).transpose(0, -2).squeeze(-2)` then indexed); a piece whose elements are not whole heads
    at evenly spaced columns is no source. A piece that is only read cut again along an axis but the last
    is read as those pieces (vLLM's DFlash context precompute: weights stacked for all layers,
    `kv.view(T, L, 2, H, D).permute(2, 1, 0, 3, 4)`, K taken with `[0]`, then each layer's K with `[i]`; with
    one head, all layers' K would otherwise pass for one K of L heads)."""
    chain, current = follow_layout(node, _CHAIN_OPS)
    return _cut_sources(projection, current, prefix, chain, range(len(static_shape(current))), depth=2)


def _cut_sources(projection: Projection, node: torch.fx.Node, prefix: list, chain: list, axes, depth: int) -> Optional[list[BranchSource]]:
    """The strided sources among the pieces that cut `node` along one of `axes` (each piece read as the
    pieces cut from it, up to `depth` cuts in all)."""
    shape = static_shape(node)
    for axis in axes:
        cuts = [_axis_cuts(user, node, len(shape), shape[axis], axis) for user in node.users]
        if not cuts or None in cuts:
            continue
        pieces = [(piece, [user] if user is piece else [user, piece]) for user, ranges in zip(node.users, cuts) for piece, _, _ in ranges]
        sources = []
        for piece, cut in pieces:
            cut_again = None
            if depth > 1:  # cut again, maybe after layout ops (`kv.chunk(2, 0)[0].squeeze(0)[i]`)
                layout, cut_node = follow_layout(piece, _CHAIN_OPS)
                axes = range(len(static_shape(cut_node)) - 1)
                cut_again = _cut_sources(projection, cut_node, prefix, chain + cut + layout, axes, depth - 1)
            source = None if cut_again else _strided_source(projection, piece, prefix, chain + cut)
            sources += cut_again or ([source] if source is not None else [])
        return sources or None
    return None


def _axis_cuts(user: torch.fx.Node, node: torch.fx.Node, rank: int, width: int, axis: int) -> Optional[list]:
    """`_column_ranges`, or [(piece, i, i + 1)] for pieces that take index i of `axis` and drop it: a
    select (`qkv[..., 1, :]`) or the items of an unbind (`q, k, v = qkv.unbind(2)`)."""
    ranges = _column_ranges(user, node, rank, width, axis)
    if ranges is not None:
        return ranges
    if is_call(user, aten.select.int) and user.args[0] is node:
        dim, index = user.args[1], user.args[2]
        if isinstance(dim, int) and isinstance(index, int) and dim % rank == axis % rank and -width <= index < width:
            return [(user, index % width, index % width + 1)]
        return None
    if is_call(user, aten.unbind.int) and user.args[0] is node:
        dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
        if not isinstance(dim, int) or dim % rank != axis % rank:
            return None
        items = list(user.users)
        if not all(item.target is operator.getitem and isinstance(item.args[1], int) for item in items):
            return None
        return [(item, item.args[1], item.args[1] + 1) for item in items]
    return None


def _strided_source(projection: Projection, piece: torch.fx.Node, prefix: list, chain: list) -> Optional[BranchSource]:
    """The piece as a strided source when its index simulation shows whole heads at evenly spaced columns
    and axes that each enumerate tokens (together a row-major split of the rows), heads, or nothing."""
    rows, width = static_shape(projection.node)
    with unset_fake_temporarily():
        source = BranchSource(piece, 0, prefix, chain=chain)
        sizes = _token_sizes(projection, source, [])
        try:
            index = source.index(torch.arange(sizes(rows) * width).view(sizes(rows), width), width, sizes)
        except (ProbeMismatch, RuntimeError, IndexError):
            return None
        token, column = index[..., 0] // width, index % width
        head_dim = index.shape[-1]
        if not bool((column - column[..., :1] == torch.arange(head_dim)).all()):
            return None
        firsts = torch.unique(column[..., 0])
        count, col_start = len(firsts), int(firsts[0])
        stride = int(firsts[1] - firsts[0]) if count > 1 else head_dim
        if stride < head_dim or not bool((firsts == col_start + stride * torch.arange(count)).all()):
            return None
        head = (column[..., 0] - col_start) // stride
        roles = []
        for axis in range(token.dim()):
            steps = [_axis_step(t, axis) for t in (token, head)]
            roles.append("token" if steps == [steps[0], 0] and steps[0] > 0 else "head" if steps == [0, 1] else "unit" if token.shape[axis] == 1 else None)
        if None in roles or roles.count("head") > (1 if count > 1 else 0):
            return None
        token_axes = sorted((a for a, r in enumerate(roles) if r == "token"), key=lambda a: -_axis_step(token, a))
        expected = torch.zeros_like(token)
        step = 1
        for axis in reversed(token_axes):  # the token axes must be a row-major split of all rows
            expected = expected + torch.arange(token.shape[axis]).view([-1 if a == axis else 1 for a in range(token.dim())]) * step
            step *= token.shape[axis]
        head_axes = [a for a, r in enumerate(roles) if r == "head"]
        expected_head = torch.arange(count).view([-1 if a in head_axes else 1 for a in range(token.dim())]) if head_axes else 0
        if step != sizes(rows) or not (torch.equal(expected.expand_as(token), token) and bool((head == expected_head).all())):
            return None
    return dataclasses.replace(
        source, col_start=col_start, stride=None if stride == head_dim else stride, n_heads=count,
        roles=[("token", token_axes.index(a)) if r == "token" else (r, None) for a, r in enumerate(roles)],
    )  # fmt: skip


def _last_dim_split(node: torch.fx.Node, width: int) -> tuple[Optional[torch.fx.Node], list]:
    """(view, its shape) when `node`'s only use views its last dim (`width`) as [n >= 2, width / n]."""
    if len(node.users) != 1:
        return None, []
    (view,) = node.users
    if not is_call(view, aten.view.default, aten.reshape.default):
        return None, []
    shape = static_shape(view)
    if len(shape) != len(static_shape(node)) + 1 or shape[-2] * shape[-1] != width or shape[-2] < 2:
        return None, []
    return view, shape


def _group_view_cuts(node: torch.fx.Node, width: int) -> Optional[tuple[torch.fx.Node, list]]:
    """(view, [(piece, first column in the group)]) when `node`'s only use views its last dim as
    [groups, group_width] and cuts each group into column ranges (q heads, k head, v head)."""
    view, shape = _last_dim_split(node, width)
    if view is None:
        return None
    cuts = _column_slices(view, len(shape), shape[-1], 0)
    return (view, cuts) if cuts else None


def _head_cuts(node: torch.fx.Node, width: int) -> Optional[tuple[torch.fx.Node, list]]:
    """(view, [(piece, first column)]) when `node`'s only use views its last dim as [heads, head_width]
    and cuts the heads into ranges (`qkv.view(B, T, 3 * H, D).chunk(3, dim=-2)`, modded-nanogpt): each
    piece is the projection columns of its heads, laid out [..., heads, head_width]."""
    view, shape = _last_dim_split(node, width)
    if view is None:
        return None
    pieces = []
    for user in view.users:
        ranges = _column_ranges(user, view, len(shape), shape[-2], axis=-2)
        if ranges is None:
            return None
        pieces += [(piece, start * shape[-1]) for piece, start, _ in ranges]
    return view, pieces


def _column_ranges(user: torch.fx.Node, node: torch.fx.Node, rank: int, width: int, axis: int = -1) -> Optional[list]:
    """[(piece, start, end)] when `user` cuts `node`'s last dim (or `axis`, `width` long) into contiguous
    ranges: a slice (`qkv[..., q:]`), the pieces of a split (`qkv.split([q, kv, kv], -1)`,
    `kv.chunk(2, -1)`), or a constant one-element index (`qkv[..., [-2], :]`, `constant_index_cut`)."""
    bounds = _last_dim_slice(user, node, rank, width, axis)
    if bounds is not None:
        return [(user, bounds[0], bounds[1])] if bounds[2] == 1 else None
    cut = constant_index_cut(user)
    if cut is not None and user.args[0] is node:
        return [(user, cut[1], cut[1] + 1)] if cut[0] == axis % rank else None
    if not is_call(user, aten.split.Tensor, aten.split_with_sizes.default) or user.args[0] is not node:
        return None
    dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
    if not isinstance(dim, int) or dim % rank != axis % rank:
        return None
    sizes = user.args[1]
    if isinstance(sizes, int):
        sizes = [sizes] * (-(-width // sizes)) if sizes > 0 else None
    if not sizes or not all(isinstance(size, int) for size in sizes):
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = []
    for piece in user.users:
        if not (piece.target is operator.getitem and isinstance(piece.args[1], int)):
            return None
        index = piece.args[1]
        pieces.append((piece, starts[index], min(starts[index] + sizes[index], width)))
    return pieces


def column_range(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, int, int]]:
    """(tensor, start, end) when `node` is the columns [start, end) of the last dim of `tensor`."""
    if is_call(node, aten.slice.Tensor):
        source = node.args[0]
    elif node.target is operator.getitem and is_call(node.args[0], aten.split.Tensor, aten.split_with_sizes.default):
        source = node.args[0].args[0]
    else:
        return None
    rank, width = len(val(source).shape), static_shape(source)[-1]
    for piece, start, end in _column_ranges(node if node.target is not operator.getitem else node.args[0], source, rank, width) or []:
        if piece is node:
            return source, start, end
    return None


def _column_slices(node: torch.fx.Node, rank: int, width: int, offset: int) -> Optional[list]:
    """(slice node, first column) for users that cut `node`'s last dim into column ranges, recursively
    (qkv[..., q:][..., :kv]); None unless every user is such a cut (or reads only a size: `sym_size`)."""
    found = []
    for user in node.users:
        if is_call(user, aten.sym_size.int):
            continue
        ranges = _column_ranges(user, node, rank, width)
        if ranges is None:
            return None
        for piece, start, end in ranges:
            inner = _column_slices(piece, rank, end - start, offset + start) if piece.users else None
            found += inner if inner else [(piece, offset + start)]
    return found


def depends_on(inputs: list[torch.fx.Node], forbidden: set) -> bool:
    """Whether any of `inputs` is in `forbidden` or computed from one. The graph must be in topological
    order: what comes before the earliest of `forbidden` cannot read it, and is not walked."""
    if not forbidden:
        return False
    earliest = min(forbidden)  # nodes compare by their place in the graph
    seen, stack = set(), list(inputs)
    while stack:
        node = stack.pop()
        if node in forbidden:
            return True
        if node in seen or node < earliest:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return False


def same_size(a, b) -> bool:
    """Are two sizes (ints or symbolic) equal at every size the graph may run with? Decided from the
    expressions alone: no guard is added."""
    return statically_known_true(a == b)


def symbol_inputs(graph: torch.fx.Graph) -> dict:
    """{sympy symbol: the graph input holding it}: dynamo passes each free symbol of a dynamic shape as an
    input, so a symbolic size can be spelled without reading the tensor it describes."""
    symbols = {}
    for node in graph.find_nodes(op="placeholder"):
        if isinstance(val(node), torch.SymInt):
            symbols.setdefault(val(node).node.expr, node)
    return symbols


def add_call(graph: torch.fx.Graph, target, args, kwargs=None) -> torch.fx.Node:
    """A new call of `target` at the graph's insertion point, with its fake value (computed first, so that
    a call the fake tensors refuse adds no node)."""
    args, kwargs = tuple(args), kwargs or {}
    fake_args, fake_kwargs = torch.fx.map_arg((args, kwargs), lambda n: n.meta["val"])
    value = target(*fake_args, **fake_kwargs)
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = value
    return node


def erase_unused(nodes: list[torch.fx.Node]) -> None:
    """Erase each of `nodes` that nothing reads and that has no effect, then what only those read, and so on:
    what a rewrite replaced, without a dead-code pass over the whole graph."""
    pending, erased = list(nodes), set()
    while pending:
        node = pending.pop()
        if node in erased or node.users or node.op != "call_function" or node.is_impure():
            continue
        pending.extend(node.all_input_nodes)
        erased.add(node)
        node.graph.erase_node(node)


def hoist_before(anchor: torch.fx.Node, nodes: list[torch.fx.Node]) -> bool:
    """Move `nodes`, and what they read that comes after `anchor`, to just before `anchor` (in graph order);
    False, moving nothing, when one of them is or reads `anchor`, or is not a pure call."""
    moving, stack = set(), [n for n in nodes if n > anchor]
    while stack:
        node = stack.pop()
        if node in moving:
            continue
        if node is anchor or node.op != "call_function" or node.is_impure():
            return False
        moving.add(node)
        stack.extend(n for n in node.all_input_nodes if n > anchor)
    for node in sorted(moving):  # nodes compare by their place in the graph
        anchor.prepend(node)
    return True
