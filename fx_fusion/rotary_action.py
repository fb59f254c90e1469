"""Recognise a rotary embedding by what it computes, not by how it is spelled.

Starting from K (a node laid out [..., head_dim]), the *rotary region* is the set of nodes that depend on
K through elementwise-linear and layout ops only (mul, add, sub, addcmul, neg, casts, views, permutes,
slices, selects, splits, cat, stack, expand, and slice assignments into a buffer: copy, slice_scatter).
Every other input of the region (cos, sin, a freqs_cis table, a cos/sin cache row...) is a *table*. The
region is accepted when

1. structurally, every mul multiplies K-dependent values by a table (never K by K, never by a constant),
   and adds, subs, cats and slice assignments combine only K-dependent values (addcmul: one K-dependent
   value plus K times a table, with value +-1; a slice assigned into an uninitialised buffer leaves the
   rest of it as a term without K, which step 2 refuses unless it is overwritten too): the output is then
   exactly a sum of terms +-K[a] * table[b] (or +-K[a] alone), i.e. bilinear in K and the tables; and
2. evaluated on probe inputs in float64 (casts skipped), its coefficients read off as integers are those
   of a rotation: out[i] = K[i] * cos[i] + sign(i) * K[partner(i)] * sin[i] for i < rotary_dim, out[i] =
   K[i] beyond, with neox (rotate-half) or interleaved (GPT-J) partners, one cos and one sin element per
   output element, shared by every head (or the same with sign(i) negated: a rotation by -angle, as
   modded-nanogpt writes it, which is the op's rotation with -sin); and
3. a final evaluation on random inputs agrees with that formula. Two bilinear forms that agree on random
   inputs are the same form, so the region computes the fused op's rotation with these tables.

The rotation then needs only where its tables come from: each of cos and sin is one table node whose
last dim holds the rotary frequencies, at full width (`full`), or at half width repeated over both halves
(`neox`, vLLM/SGLang's `cos, sin = cache.chunk(2, -1)`) or over pairs (`interleaved`, GPT-J's
`freqs_cis`). Floating-point results differ from the spelled graph only by rounding: the fused op
computes in float32 and rounds once.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .probe_sizes import FULL_SIZE, ProbeMismatch, ProbeSizes, probe_call
from .memo import OutcomeMemo, plain
from .values import LAYOUT_OPS, UNINITIALISED, ValueKeys

aten = torch.ops.aten
prims = torch.ops.prims

_LAYOUT = LAYOUT_OPS | {
    aten.squeeze.dims,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    operator.getitem,
    prims.convert_element_type.default,
    aten._to_copy.default,
    aten.view_as_complex.default,  # pairs of reals as one complex number, and back: the same elements
    aten.view_as_real.default,
}
_JOIN = {aten.cat.default, aten.stack.default}
_SUM = {aten.add.Tensor, aten.sub.Tensor}
_ADDCMUL = aten.addcmul.default  # self + value * t1 * t2: a sum and a product in one op
# slice assignments into a buffer, as functionalisation spells `out[..., :h] = -x2`: copy (dst's shape, src's
# values) and slice_scatter (base with one slice replaced): a cat written in place
_SCATTERS = {aten.copy.default, aten.slice_scatter.default}
_REGION_OPS = _LAYOUT | _JOIN | _SUM | _SCATTERS | {aten.mul.Tensor, aten.neg.default, _ADDCMUL}
_VIEWS = {aten.view.default, aten._unsafe_view.default}  # evaluated as reshape: probe strides may differ
_MAX_REGION = 256
_MAX_DEPTH = 16  # region ops between K and a node of its rotation (a rotation takes about 10)


NO_ROTATION = "no rotary embedding (K times cos plus rotated K times sin) on K"


class NotRotary(Exception):
    """The nodes after K do not compute a rotary embedding; the message says how."""


@dataclasses.dataclass(frozen=True)
class Table:
    """cos or sin: `node` laid out like K up to broadcasting, its last dim holding `width` frequencies.

    mode: "full" (width == rotary_dim), "neox" (width == rotary_dim / 2, the same values for both halves),
    "interleaved" (width == rotary_dim / 2, each value for a pair of elements). A complex table holds cos
    in its real parts and sin in its imaginary parts (`part`).
    """

    node: torch.fx.Node
    mode: str
    part: Optional[str] = None  # "real" or "imag" of a complex table (Meta Llama's freqs_cis), else None

    def full_width_columns(self, rotary_dim: int) -> torch.Tensor:
        d = torch.arange(rotary_dim)
        return {"full": d, "neox": d % (rotary_dim // 2), "interleaved": d // 2}[self.mode]


@dataclasses.dataclass(frozen=True)
class Rotation:
    out: torch.fx.Node  # the rotated K, laid out like the K it started from
    cos: Table
    sin: Table
    rotary_dim: int
    interleaved: bool  # partner of element i: i ^ 1 (GPT-J pairs), else i +- rotary_dim / 2 (neox)
    sin_negated: bool = False  # K*cos - rotate(K)*sin: a rotation by -angle (the op reads -sin)


def _is_call(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def node_val(node: torch.fx.Node):
    return node.meta.get("val")


def _hint(x):
    if isinstance(x, torch.fx.Node):
        x = node_val(x)
    if isinstance(x, torch.SymInt):
        return x.node.hint if x.node.hint is not None else 8
    if isinstance(x, (list, tuple)):
        return type(x)(_hint(e) for e in x)
    return x


def _table_degree(node: torch.fx.Node, inside: dict) -> Optional[int]:
    """How many table factors each term of `node` carries (0 or 1), or None if the node breaks bilinearity."""
    target = node.target
    args = node.args
    if target is aten.mul.Tensor:
        k_args = [a for a in args[:2] if a in inside]
        others = [a for a in args[:2] if a not in inside]
        if len(k_args) == 1 and len(others) == 1 and _is_sign(others[0]):
            return inside[k_args[0]]  # times 1 or -1 (`value * t1 * t2`, addcmul's decomposition): exact
        if len(k_args) != 1 or len(others) != 1 or not isinstance(others[0], torch.fx.Node):
            return None  # K * K, or K times a constant
        if not isinstance(node_val(others[0]), torch.Tensor) or inside[k_args[0]] != 0:
            return None
        return 1
    if target in _SUM:
        if node.kwargs.get("alpha", 1) != 1 or len(args) != 2 or not all(a in inside for a in args):
            return None
        return max(inside[a] for a in args)
    if target is aten.copy.default:  # src's values in dst's shape: dst's own values are discarded
        dst, src = args[0], args[1]
        if src not in inside or _hint(list(node_val(dst).shape)) != _hint(list(node_val(src).shape)):
            return None
        # into the region's own buffer only: a copy into anything else (a cache slice) is a write of the
        # result, not part of its computation
        return inside[src] if dst in inside or _uninitialised(dst) else None
    if target is aten.slice_scatter.default:  # base with a slice replaced by src
        base, src = args[0], args[1]
        if src not in inside:
            return None
        if base in inside:
            return max(inside[base], inside[src])
        # an uninitialised buffer: elements left unwritten would be garbage, which the probes would read
        # as a term without K (no rotation), so the region is only accepted when it is written whole
        return inside[src] if _uninitialised(base) else None
    if target is _ADDCMUL:  # self + K * table (value +-1: a sign, not a scale)
        if len(args) < 3 or not _is_sign(node.kwargs.get("value", 1)) or args[0] not in inside:
            return None
        k_args = [a for a in args[1:3] if a in inside]
        others = [a for a in args[1:3] if a not in inside]
        if len(k_args) != 1 or inside[k_args[0]] != 0 or not isinstance(others[0], torch.fx.Node):
            return None
        if not isinstance(node_val(others[0]), torch.Tensor):
            return None
        return max(inside[args[0]], 1)
    if target in _JOIN:
        parts = list(args[0])
        if not all(p in inside for p in parts):
            return None
        return max(inside[p] for p in parts)
    if args[0] not in inside or any(a in inside for a in args[1:] if isinstance(a, torch.fx.Node)):
        return None
    return inside[args[0]]


def _is_sign(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value in (1, -1)


def _uninitialised(node: torch.fx.Node) -> bool:
    """Is `node` a view of an uninitialised allocation (`torch.empty`, `empty_like`)?"""
    while _is_call(node, _LAYOUT):
        node = node.args[0]
    return _is_call(node, UNINITIALISED)


def _region(start: torch.fx.Node) -> dict:
    """Nodes that depend on `start` only through region ops that keep the value bilinear in K and the
    tables, in graph order: node -> number of table factors in its terms (0 or 1).

    Only nodes reached from `start` through at most _MAX_DEPTH region ops can qualify, so the walk stays
    near K (attention is no region op; a residual stream, all adds and multiplies, is cut off after a few
    layers); an input outside the region must not depend on `start`."""
    reached, frontier = set(), [start]
    for _ in range(_MAX_DEPTH):
        users = {user for node in frontier for user in node.users}
        frontier = {user for user in users if user not in reached and _is_call(user, _REGION_OPS)}
        reached.update(frontier)
    descendants: set = set()

    def reads_k_from_outside(node: torch.fx.Node) -> bool:
        if not descendants:  # once, on first need (most projections are no K: their region stays empty)
            # Descendants of `start` up to the last reached node (in graph order, every path to a node runs
            # through earlier nodes, so this window holds all of them that region nodes can read).
            last = max(reached, default=start)
            descendants.add(start)
            stack = [start]
            while stack:
                for user in stack.pop().users:
                    if user not in descendants and not last < user:
                        descendants.add(user)
                        stack.append(user)
        return any(a not in inside and a in descendants for a in node.all_input_nodes)

    inside = {start: 0}
    for node in sorted(reached):  # graph order
        degree = _table_degree(node, inside)
        if degree is None or reads_k_from_outside(node):
            continue  # not bilinear in K and the tables, or K reaches it through something outside the region
        inside[node] = degree
        if len(inside) >= _MAX_REGION:
            break
    return inside


def _closed_outputs(start: torch.fx.Node, inside: dict) -> list[torch.fx.Node]:
    """Region nodes shaped like `start` whose ancestors in the region feed nothing else (a dead pure node,
    such as the view functionalisation leaves behind a slice assignment, reads nothing), last first."""
    shape = list(_hint(list(node_val(start).shape)))
    found = []
    for node in reversed(list(inside)):
        value = node_val(node)  # a split's is a list of tensors
        if node is start or inside[node] != 1 or not isinstance(value, torch.Tensor) or list(_hint(list(value.shape))) != shape:
            continue
        ancestors, stack = set(), [node]
        while stack:
            current = stack.pop()
            if current in ancestors or current is start:
                continue
            ancestors.add(current)
            stack.extend(a for a in current.all_input_nodes if a in inside)
        if all(_live_users(a) <= ancestors for a in ancestors if a is not node):
            found.append((node, ancestors))
    return found


def _live_users(node: torch.fx.Node) -> set:
    return {user for user in node.users if user.users or user.is_impure()}


def _negated_table(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """t when `node` is `neg(t)` computed on the table side, else None."""
    return node.args[0] if _is_call(node, {aten.neg.default}) else None


class _Probe:
    """Evaluates a rotary region in float64 for given K and table values (casts are skipped).

    A table computed as -t beside the region (modded-nanogpt's `x1 * (-sin)`) is read as t negated, so
    that sin used with both signs is one table (the rotation is then one by -angle, or by +angle)."""

    def __init__(self, start: torch.fx.Node, nodes: list[torch.fx.Node], inside: dict, sizes: ProbeSizes, same_value: ValueKeys):
        self.start, self.nodes, self.sizes = start, nodes, sizes
        self.tables: list[torch.fx.Node] = []  # one representative per distinct table value
        self.table_of: dict = {}
        keys: dict = {}
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg in inside or arg in self.table_of or not isinstance(node_val(arg), torch.Tensor):
                    continue  # a size node (a view's symbolic token count) is an argument, not a table
                table, sign = arg, 1.0
                negated = _negated_table(arg)
                if negated is not None and isinstance(node_val(negated), torch.Tensor):
                    table, sign = negated, -1.0
                key = same_value(table)
                if key not in keys:
                    keys[key] = len(self.tables)
                    self.tables.append(table)
                self.table_of[arg] = (keys[key], sign)
        self.shape = sizes(list(_hint(list(node_val(start).shape))))
        # complex tables are probed through their real view [..., 2] (real and imaginary parts)
        self.complex = [node_val(t).is_complex() for t in self.tables]
        self.table_shapes = [
            sizes(list(_hint(list(node_val(t).shape)))) + ([2] if is_complex else [])
            for t, is_complex in zip(self.tables, self.complex)
        ]

    def signature(self) -> tuple:
        """Everything `_identify` reads, as plain data (no nodes): the ops in order, their arguments (K, an
        earlier node or a table by position), every shape involved and the probe's size mapping. Two probes
        with equal signatures compute the same function of K and the tables, so they identify alike."""
        position = {node: i for i, node in enumerate(self.nodes)}

        def encode(a):
            if isinstance(a, torch.fx.Node):
                if a is self.start:
                    return ("k",)
                if a in position:
                    return ("node", position[a])
                return ("table", *self.table_of[a]) if a in self.table_of else ("size", plain(_hint(a)))
            if isinstance(a, (list, tuple)):
                return (type(a).__name__, *(encode(e) for e in a))
            if isinstance(a, dict):
                return tuple(sorted((key, encode(v)) for key, v in a.items()))
            return plain(_hint(a))  # TypeError for anything hashed by identity, or not at all

        def shapes(value):
            if isinstance(value, torch.Tensor):
                return tuple(_hint(list(value.shape)))
            if isinstance(value, (list, tuple)):
                return tuple(shapes(v) for v in value)
            return None

        return (
            tuple(sorted(self.sizes.mapping.items())),
            shapes(node_val(self.start)),
            tuple(shapes(node_val(t)) for t in self.tables),
            tuple(self.complex),
            tuple((n.target, encode(n.args), encode(n.kwargs), shapes(node_val(n))) for n in self.nodes),
        )

    def run(self, k: torch.Tensor, tables: list[torch.Tensor]) -> torch.Tensor:
        env = {self.start: k}

        def value(a):
            if isinstance(a, torch.fx.Node):
                if a in env:
                    return env[a]
                if a not in self.table_of:
                    return _hint(a)  # a size node: its example value (probe_call maps token counts)
                index, sign = self.table_of[a]
                table = torch.view_as_complex(tables[index]) if self.complex[index] else tables[index]
                return table if sign > 0 else -table
            if isinstance(a, (list, tuple)):
                return type(a)(value(e) for e in a)
            return _hint(a)

        for node in self.nodes:
            args, kwargs = value(node.args), {k: value(v) for k, v in node.kwargs.items()}
            if node.target in (prims.convert_element_type.default, aten._to_copy.default):
                env[node] = args[0]
            else:
                target = aten.reshape.default if node.target in _VIEWS else node.target
                env[node] = probe_call(node, target, list(args), kwargs, self.sizes)
        return env[self.nodes[-1]]


def _partner_pattern(rotary_dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    d = torch.arange(rotary_dim)
    if interleaved:
        return d ^ 1, torch.where(d % 2 == 0, -1.0, 1.0).double()
    half = rotary_dim // 2
    return (d + half) % rotary_dim, torch.where(d < half, -1.0, 1.0).double()


def _decode_codes(codes: torch.Tensor, bases: list[int], sizes: list[int]) -> tuple[int, torch.Tensor]:
    """Codes base_j + index + 1 -> (table j, flat indices); all codes must name elements of one table."""
    if not bool((codes == codes.round()).all()) or not bool((codes >= 1).all()):
        raise NotRotary("a rotated element is not one table element times K")
    codes = codes.long() - 1
    table = int(torch.searchsorted(torch.tensor(bases), codes.min(), right=True)) - 1
    index = codes - bases[table]
    if not bool(((index >= 0) & (index < sizes[table])).all()):
        raise NotRotary("cos (or sin) comes from several tables")
    return table, index


def _table_mode(shape: list[int], k_shape: list[int], index: torch.Tensor, rotary_dim: int) -> Optional[str]:
    """How the table of `shape` (flat indices `index` [tokens*heads, rotary_dim] read per K element) maps
    onto K's elements, or None when it is not one value per (token, frequency) broadcast like K."""
    rank = len(k_shape)
    if len(shape) > rank:
        return None
    padded = [1] * (rank - len(shape)) + shape
    if any(p not in (1, k) for p, k in zip(padded[:-1], k_shape[:-1])):
        return None
    width = padded[-1]
    flat = torch.arange(max(1, torch.Size(shape).numel())).view(padded)
    flat = flat.expand(*k_shape[:-1], width).reshape(-1, width)
    for mode in ("full", "neox", "interleaved"):
        columns = Table(None, mode).full_width_columns(rotary_dim)
        if int(columns.max()) < width and width == (rotary_dim if mode == "full" else rotary_dim // 2):
            if torch.equal(flat[:, columns], index):
                return mode
    return None


def match_rotation(
    k: torch.fx.Node, same_value: Optional[ValueKeys] = None, out_dtype: Optional[torch.dtype] = None
) -> Rotation:
    """Find the rotary embedding applied to `k` ([..., head_dim]); raises NotRotary with the reason.
    `same_value`: a ValueKeys to share (tables are told apart by value). `out_dtype`: where the rotation can
    end at several casts of one value, the end in this dtype wins (a rotation whose result is upcast for a
    norm after it ends before that cast; a float32 one rounded back to K's dtype ends after it)."""
    same_value = same_value if same_value is not None else ValueKeys()
    if not isinstance(node_val(k), torch.Tensor) or node_val(k).dim() == 0:
        raise NotRotary(NO_ROTATION)
    inside = _region(k)
    candidates = _closed_outputs(k, inside)
    if out_dtype is not None:
        candidates.sort(key=lambda found: node_val(found[0]).dtype != out_dtype)  # stable: last first within
    if not candidates:
        raise NotRotary(NO_ROTATION)
    reasons = []
    few_tokens = ProbeSizes(_hint(list(node_val(k).shape))[:-1])
    for out, ancestors in candidates:
        nodes = [n for n in inside if n in ancestors]
        try:
            with unset_fake_temporarily(), torch.no_grad():
                try:  # over a few tokens (probe_sizes); at full size where that does not reproduce the graph
                    return _identify(k, out, nodes, inside, few_tokens, same_value)
                except (ProbeMismatch, RuntimeError, IndexError):
                    if not few_tokens:
                        raise
                return _identify(k, out, nodes, inside, FULL_SIZE, same_value)
        except NotRotary as reason:
            reasons.append(str(reason))
        except Exception as error:  # an op the probe cannot evaluate: not something we can prove
            reasons.append(f"could not be evaluated ({type(error).__name__})")
    if _factors_share_inputs_with_k(k, inside, same_value):  # e.g. an MLP's up * act(gate): no rotary embedding
        raise NotRotary(NO_ROTATION)
    raise NotRotary(reasons[0])


def _factors_share_inputs_with_k(k: torch.fx.Node, inside: dict, same_value: ValueKeys) -> bool:
    """Whether the region's other factors (the would-be cos/sin) are computed from a graph input that K is
    computed from: rotary tables come from positions, never from the hidden states K is projected from."""
    factors = 0
    for node in inside:
        if node is k:  # K's own inputs are no factor
            continue
        for a in node.all_input_nodes:
            if a not in inside and not _uninitialised(a):  # `empty_like(k)` takes K's shape, not its values
                factors |= same_value.input_mask(a)
    return bool(factors & same_value.input_mask(k))


# Outcomes of `_identify_on` by probe signature: a decoder's layers repeat one rotary region, identified once.
_IDENTIFIED = OutcomeMemo((NotRotary, ProbeMismatch))


def _identify(
    k: torch.fx.Node, out: torch.fx.Node, nodes: list[torch.fx.Node], inside: dict, sizes: ProbeSizes, same_value: ValueKeys
) -> Rotation:
    probe = _Probe(k, nodes, inside, sizes, same_value)
    # refusals are outcomes too (their texts name no node)
    rotary_dim, interleaved, sin_negated, tables = _IDENTIFIED.outcome(probe.signature, lambda: _identify_on(probe))
    cos, sin = (Table(probe.tables[index], mode, part) for index, mode, part in tables)
    return Rotation(out=out, cos=cos, sin=sin, rotary_dim=rotary_dim, interleaved=interleaved, sin_negated=sin_negated)


def _identify_on(probe: _Probe) -> tuple:
    """(rotary_dim, interleaved, sin_negated, ((table index, mode, part) of cos, of sin)) for the probe's
    region, or NotRotary with the reason."""
    shape = probe.shape
    numel, head_dim = torch.Size(shape).numel(), shape[-1]
    k_codes = torch.arange(1, numel + 1, dtype=torch.float64).view(shape)

    def tables_filled(value: float) -> list[torch.Tensor]:
        return [torch.full(s, value, dtype=torch.float64) for s in probe.table_shapes]

    passed = probe.run(k_codes, tables_filled(0.0)).reshape(-1, head_dim)
    flat_k = k_codes.reshape(-1, head_dim)
    kept = passed == flat_k
    if not bool((kept | (passed == 0)).all()):
        raise NotRotary("K is not rotated element by element")
    rotary_dim = int((~kept[0]).sum())
    if rotary_dim == 0 or rotary_dim % 2 or not bool((kept == (torch.arange(head_dim) >= rotary_dim)).all()):
        raise NotRotary("the rotated part of K is not its first rotary_dim dims")

    ones = probe.run(k_codes, tables_filled(1.0)).reshape(-1, head_dim)[:, :rotary_dim]
    partner_codes = ones - flat_k[:, :rotary_dim]
    interleaved = None
    for style in (False, True):
        partner, sign = _partner_pattern(rotary_dim, style)
        for flip in (1.0, -1.0):  # -1: the sine enters negated, a rotation by -angle
            if torch.equal(partner_codes, flip * sign * flat_k[:, partner]):
                interleaved, sin_negated = style, flip < 0
                break
        if interleaved is not None:
            break
    if interleaved is None:
        raise NotRotary("K is not rotated in neox halves or interleaved pairs with cos/sin as K*cos + rotate(K)*sin")
    partner, sign = _partner_pattern(rotary_dim, interleaved)
    if sin_negated:
        sign = -sign

    sizes = [max(1, torch.Size(s).numel()) for s in probe.table_shapes]
    bases = [sum(sizes[:j]) for j in range(len(sizes))]
    coded = [torch.arange(b + 1, b + n + 1, dtype=torch.float64).view(s) for b, n, s in zip(bases, sizes, probe.table_shapes)]
    first_of_pair = (partner > torch.arange(rotary_dim))  # the element of each pair with sign -1
    cos_codes = torch.empty(numel // head_dim, rotary_dim, dtype=torch.float64)
    sin_codes = torch.empty_like(cos_codes)
    for selected in (first_of_pair, ~first_of_pair):
        k_sel = torch.zeros(numel // head_dim, head_dim, dtype=torch.float64)
        k_sel[:, :rotary_dim][:, selected] = 1.0
        got = probe.run(k_sel.view(shape), coded).reshape(-1, head_dim)[:, :rotary_dim]
        cos_codes[:, selected] = got[:, selected]
        sin_codes[:, ~selected] = got[:, ~selected] * sign[~selected]
    cos_table, cos_index = _decode_codes(cos_codes, bases, sizes)
    sin_table, sin_index = _decode_codes(sin_codes, bases, sizes)

    generator = torch.Generator().manual_seed(0)  # a private stream: compiling leaves the user's RNG alone
    k_random = torch.randn(shape, dtype=torch.float64, generator=generator)
    tables_random = [torch.randn(s, dtype=torch.float64, generator=generator) for s in probe.table_shapes]
    got = probe.run(k_random, tables_random).reshape(-1, head_dim)
    flat = k_random.reshape(-1, head_dim)
    rot = flat[:, :rotary_dim]
    expected = torch.cat(
        [
            rot * tables_random[cos_table].flatten()[cos_index]
            + sign * rot[:, partner] * tables_random[sin_table].flatten()[sin_index],
            flat[:, rotary_dim:],
        ],
        dim=-1,
    )
    if not torch.allclose(got, expected, rtol=1e-10, atol=1e-12):
        raise NotRotary("the region is not exactly K*cos + rotate(K)*sin")

    specs = []
    for table, index, part in ((cos_table, cos_index, "real"), (sin_table, sin_index, "imag")):
        table_shape = probe.table_shapes[table]
        if probe.complex[table]:  # cos from the real parts, sin from the imaginary parts
            if not bool((index % 2 == (0 if part == "real" else 1)).all()):
                raise NotRotary("cos/sin are not the real/imaginary parts of one complex table")
            index, table_shape = index // 2, table_shape[:-1]
        mode = _table_mode(table_shape, shape, index, rotary_dim)
        if mode is None:
            raise NotRotary("cos/sin are not one value per token and frequency, shared by every head")
        specs.append((table, mode, part if probe.complex[table] else None))
    return rotary_dim, interleaved, sin_negated, tuple(specs)
