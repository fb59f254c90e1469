"""FusedKVPass: rewrite per-layer K/V context materialization into one grouped GEMM + one fused op.

Matches (post-grad ATen graph, or the joint graph before freezing): L >= min_layers K branches that read
the same hidden states x, each

    k_l = linear(x, Wk_l[, bk_l])  (or x @ Wk_l with Wk_l stored [hidden, out]; or an einsum of the same;
          or the K columns of a fused kv/qkv linear, cut by slice or split, by a head cut, or by any views
          and permutes and a cut or two; or of one linear over weights stacked for all layers viewed as
          [T, L, 2*kv])
          -> heads [..., H, D] -> [per-head RMSNorm(w_l, eps)] -> any layout -> RoPE(cos, sin)

with D, rotary dim and style, norm form, eps and cos/sin the same across the group, plus the other
linears on x with the same width as a member (the V projections). Members may differ in head count (a
decoder layer's Q beside its K): the op then reads every member as blocks of gcd(heads) heads, each block
with its member's norm weight. First, in-place updates of column views and buffers filled index by
index are read back as plain chains (scatter_forwarding), a bias added after a product's reshape is added
to the product (bias_adds), and context and noise rows joined along tokens, or layers' rows merged for one
RoPE, ahead of per-token ops get those ops per piece (token_cats, the DFlash forms). It replaces them with

    proj  = fx_fusion.grouped_linear(x2d, [Wk_0..Wk_L-1, Wv_0..], [biases])    # [N, all columns]
    k_all = fx_fusion.materialize_k(proj columns as [N, L, H*D], norm weights, eps, cos/sin tables,
                                    or the cos/sin cache + positions they were gathered from)
    k_l   = k_all[l] re-laid out exactly as the original branch laid out its K
    v_l   = a view of proj's columns (nothing to compute)

and computes the group's rotary angles, where Hugging Face forms them as an outer-product matmul, as the
equal broadcast multiply (see rotary_angles), so Inductor fuses them into the cos/sin kernel.

Why every accepted region equals the fused op:
- the projection is an mm/addmm of x with parameters (biases one value per column), the cut of one
  that Inductor zero-padded to aligned sizes (padded_linears: the same values), or an einsum's product
  (a batch-1 bmm, or the mm Inductor makes of it on a GPU) whose operands address exactly x's rows and
  W.T (batched_linears; a bmm is put back where nothing fused it), and the columns the branch reads are
  established by replaying its layout ops on an index tensor (kv_patterns.head_layout; over a few
  tokens, which every layout op treats alike, probe_sizes);
- the scatter forwarding, the per-piece ops after a token cat and the re-layout of a strided piece are
  exact identities (the same elements through the same ops);
- the norm is matched op by op in each of its accepted forms (kv_patterns.match_rms_norm), which differ
  only in where the result is rounded (`norm_weight_in_float32`) and a constant weight offset, both
  passed to the op;
- the rotation is proven by what it computes (rotary_action): the region is bilinear in K and its tables
  by construction (a complex table counts as its real and imaginary parts), its coefficients are read
  off exactly and match K*cos + rotate(K)*sin, and a random evaluation agrees;
- blocks of heads of one member share its norm weight and eps, and the rotation is per head;
- layers are grouped only when their inputs, cos and sin are the same values (values.ValueKeys: the same
  op on the same arguments), never when they merely look alike;
- anything else is left alone with a reason, and a refusal while rewriting erases every node it added.
Results equal the spelled graph up to rounding: the op computes in float32 and rounds where the matched
norm form rounds and once after the rotation.

No weight is stacked, copied or moved: grouped_linear reads every projection weight where it lives, so
parameters, their storage and state_dict stay the user's, and in-place updates are seen by the next call.
With Inductor freezing (the pass then runs on the joint graph) the weights are constants anyway: the
grouped GEMM is spelled as one mm over their concatenation, which freezing folds into one constant.
Afterwards every fused op call is replaced by its traced body (op_lowering), so Inductor launches the
Triton kernels itself (or, off CUDA, compiles the op's math with the rest of the graph).
"""

from __future__ import annotations

import collections
import copy
import logging
import math
import sys
import types
from typing import Optional

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import statically_known_true

import fx_fusion.kernels.ops  # noqa: F401  (registers fx_fusion::materialize_*)
import fx_fusion.kernels.grouped_linear  # noqa: F401  (registers fx_fusion::grouped_linear)
from fx_fusion.kernels.fused_kv_materialize import MAX_NORM_WEIGHTS_PER_LAUNCH

from . import bias_adds, cache_writes, kv_patterns, op_lowering, rotary_action, rotary_angles, scatter_forwarding, strided_outputs, token_cats
from .diagnostics import FusedGroup, PassRecord, RecordSink, Rejection, node_location
from .kv_patterns import KBranch, NoMatch, Projection, is_call, val
from . import batched_linears, layer_unstack, select_cuts
from .padded_linears import padded_linear
from .values import RESHAPES, ValueKeys

logger = logging.getLogger("fx_fusion")
aten = torch.ops.aten
prims = torch.ops.prims


class FusedKVPass(CustomGraphPass):
    """Inductor custom graph pass; use as `post_grad_custom_post_pass` (or via backend="fx_fusion")."""

    def __init__(
        self,
        min_layers: int = 1,
        enabled: bool = True,
        stage: str = "post_grad",
        inline_ops: bool = True,
        gemm_epilogue: bool = True,
        rotary_angles_in_kernel: bool = True,
    ):
        if min_layers < 1:
            raise ValueError(f"min_layers must be >= 1, got {min_layers}")
        self.min_layers = min_layers
        self.enabled = enabled
        self.stage = stage  # "post_grad", or "joint" when installed before Inductor freezing
        self.inline_ops = inline_ops  # hand the fused ops to Inductor as code (op_lowering)
        self.gemm_epilogue = gemm_epilogue  # K norm/RoPE in the grouped GEMM where lowering can
        self.rotary_angles_in_kernel = rotary_angles_in_kernel  # ... computing its cos/sin where it can
        self.records: list[PassRecord] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        if not self.enabled:
            return
        before = copy.deepcopy(graph) if RecordSink.keep_graphs else None
        record = fuse_kv_groups(graph, self.min_layers, stack_weights_in_graph=self.stage == "joint")
        record.stage = self.stage
        if before is not None:  # the rewrite as the report shows it: fused op calls, not yet inlined
            record.full_graph_before, record.full_graph_after = before, copy.deepcopy(graph)
        if self.inline_ops:
            lowered = op_lowering.lower_fused_ops(graph, self.gemm_epilogue, self.rotary_angles_in_kernel)
            record.ops_inlined, record.ops_kept = lowered.inlined, lowered.kept
            record.gemm_epilogues, record.gemm_epilogue_notes = lowered.gemm_epilogues, lowered.gemm_epilogue_notes
            record.rotary_angles_in_kernel, record.rotary_angle_notes = lowered.angles_in_kernel, lowered.angle_notes
        self.records.append(record)
        RecordSink.emit(record)

    def uuid(self) -> bytes:
        # what shapes the rewritten graph: the matcher and the rewrite (every module of the pass), and the
        # ops' schemas and kernels (reached through torch.ops, so named)
        files = _pass_module_files() + (
            fx_fusion.kernels.ops.__file__,
            fx_fusion.kernels.fused_kv_materialize.__file__,
            fx_fusion.kernels.grouped_linear.__file__,
            fx_fusion.kernels.grouped_gemv.__file__,
            fx_fusion.kernels.grouped_gemm_tma.__file__,
        )
        options = (
            f"min_layers={self.min_layers},enabled={self.enabled},stage={self.stage},inline={self.inline_ops},"
            f"epilogue={self.gemm_epilogue},angles={self.rotary_angles_in_kernel}"
        )
        return get_hash_for_files(files, extra=options)


def _pass_module_files() -> tuple[str, ...]:
    """The files of this module and of every fx_fusion module it reaches, through the modules, functions
    and classes each one's globals hold (packages are not walked: what they hold depends on what else was
    imported), sorted: a module added to the pass is in the cache key without being listed."""
    files, stack = {}, [sys.modules[__name__]]
    while stack:
        module = stack.pop()
        if module.__name__ in files:
            continue
        files[module.__name__] = module.__file__
        for value in vars(module).values():
            name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            reached = sys.modules.get(name) if isinstance(name, str) and name.startswith("fx_fusion.") else None
            if reached is not None and not hasattr(reached, "__path__"):
                stack.append(reached)
    return tuple(files[name] for name in sorted(files))


class _GraphBuilder:
    """Adds nodes at one insertion point, giving each a fake value (Inductor lowers from meta['val']). A
    reshape gets its value once something reads it (`finish` gives the rest theirs), so that a reshape of
    a reshape nothing else reads is built as one reshape."""

    def __init__(self, graph: torch.fx.Graph, fake_mode: Optional[FakeTensorMode]):
        self.graph = graph
        self.fake_mode = fake_mode
        self.created: list[torch.fx.Node] = []
        self._unvalued: set[torch.fx.Node] = set()

    def call(self, target, *args, **kwargs) -> torch.fx.Node:
        source = args[0] if args else None
        if target in RESHAPES and isinstance(source, torch.fx.Node) and source in self._unvalued and not source.users:
            source.target, source.args = aten.reshape.default, (source.args[0], *args[1:])
            return source
        node = self.graph.call_function(target, args, kwargs)
        self.created.append(node)  # before its value: a refusal below must still erase it
        self._unvalued.add(node)
        if target not in RESHAPES:
            self._give_value(node)
        return node

    def finish(self) -> None:
        """Give every node added so far its fake value."""
        for node in self.created:
            self._give_value(node)

    def _give_value(self, node: torch.fx.Node) -> None:
        if node not in self._unvalued:
            return
        for arg in node.all_input_nodes:
            self._give_value(arg)
        self._unvalued.discard(node)
        if self.fake_mode is not None:
            fake_args, fake_kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
            with self.fake_mode:
                node.meta["val"] = node.target(*fake_args, **fake_kwargs)

    def value(self, node: torch.fx.Node):
        """`node`'s fake value (given now if it had none yet), or None without a fake mode."""
        self._give_value(node)
        return node.meta.get("val")

    def discard(self, node: torch.fx.Node) -> None:
        """Remove `node`, which nothing reads, and the added nodes that only it read."""
        stack = [node]
        while stack:
            unused = stack.pop()
            if unused.users or unused not in self.created:
                continue
            stack.extend(unused.all_input_nodes)
            self.graph.erase_node(unused)
            self.created.remove(unused)
            self._unvalued.discard(unused)

    def erase(self) -> None:
        """Remove every node added so far (none of them has outside users yet)."""
        for node in reversed(self.created):
            self.graph.erase_node(node)
        self.created.clear()
        self._unvalued.clear()

    def replay(self, nodes: list[torch.fx.Node], start: torch.fx.Node) -> torch.fx.Node:
        value = start
        for node in nodes:
            value = self.call(node.target, value, *node.args[1:], **node.kwargs)
        return value


def _fake_mode(graph: torch.fx.Graph) -> Optional[FakeTensorMode]:
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])


def _group_key(branch: KBranch, same_value: ValueKeys) -> tuple:
    """What layers must share to be fused together, as (field name, value) pairs. Inputs are compared as
    values (the same op on the same arguments), never as look-alikes."""
    norm, rotary, proj = branch.norm, branch.rotary, branch.projection
    eps = None
    if norm is not None:  # eps tensors (dynamic floats) are read per layer by the fused op
        eps = norm.eps if isinstance(norm.eps, float) else "per-layer tensor"
    return (
        ("input", same_value(proj.x2d)),
        ("dtype", val(proj.node).dtype),
        ("num_kv_heads", branch.heads.num_heads),  # (_heads_apart: this, the width and column may differ)
        ("head_dim", branch.heads.head_dim),
        ("rotary_dim", rotary.rotary_dim),
        ("rotary style", "interleaved" if rotary.interleaved else "neox"),
        ("cos/sin table layout", (rotary.cos.mode, rotary.sin.mode, rotary.cos.part, rotary.sin.part)),
        ("sin negated", rotary.sin_negated),
        ("k_norm", None if norm is None else ("weightless" if norm.weight is None else "weighted")),
        ("eps", eps),
        ("norm weight offset", norm.weight_offset if norm else None),
        ("norm rounding", (norm.weight_in_float32, norm.round_before_rope) if norm else None),
        ("bias", bool(proj.biases)),
        ("projection width", proj.layer_width),
        ("K column in projection", branch.source.col_start),
        ("K head stride", branch.source.head_stride),
        ("stacked projection", proj.node if proj.n_layers > 1 else None),
    )


def _heads_apart(key: tuple) -> tuple:
    """The group key without head count, projection width and K's column: what a GQA layer's Q and K share
    (they fuse as blocks of gcd(heads) heads when their columns are evenly spaced)."""
    return tuple(field for field in key if field[0] not in ("num_kv_heads", "projection width", "K column in projection"))


def _describe_difference(key: tuple, group_key: tuple) -> str:
    fields = [name for (name, a), (_, b) in zip(key, group_key) if a is not b and a != b]
    return "differs from the fused group in " + ", ".join(fields)


def _find_candidates(graph: torch.fx.Graph, record: PassRecord, same_value: ValueKeys):
    """Projections grouped by their input value, the K branches found on them, and why the other
    projections are not K branches (rejected K-like branches go to the record)."""
    by_input: dict = collections.defaultdict(lambda: {"projections": [], "branches": [], "not_k": {}})
    concatenated = {}
    for node in graph.nodes:
        try:
            concatenated[node] = kv_patterns.match_concat_projection(node)
        except NoMatch:
            pass
    parts = {part for projection in concatenated.values() for part in projection.parts}
    concatenated = {node: projection for node, projection in concatenated.items() if node not in parts}
    padded = {n: p for n in graph.nodes if is_call(n, aten.slice.Tensor) and (p := padded_linear(n)) is not None}
    parts |= {inner for p in padded.values() for inner in p.inner}  # read at their cut
    for node in graph.nodes:
        if node in concatenated:
            projection = kv_patterns.split_into_layers(concatenated[node])
        elif node in parts:
            continue
        else:
            if node in padded:
                pass  # the cut of a zero-padded product (padded_linears)
            elif is_call(node, aten.mm.default) and kv_patterns.bias_add_of(node) is not None:
                node = kv_patterns.bias_add_of(node)  # the projection ends at its bias add
                if node in parts:
                    continue
            elif not is_call(node, *kv_patterns.PROJECTION_OPS):
                continue
            try:
                projection = kv_patterns.split_into_layers(kv_patterns.match_projection(node))
            except kv_patterns.ComputedWeight as reason:  # a linear a user may expect to see fused
                if kv_patterns.feeds_k_math(reason.projection, same_value):
                    record.rejected.append(Rejection(str(reason), node_location(node)))
                continue
            except NoMatch:
                continue
        entry = by_input[same_value(projection.x2d)]
        entry["projections"].append(projection)
        try:
            sources = kv_patterns.branch_sources(projection)
        except Exception:  # a layout the cut reader did not foresee: the projection read whole only
            logger.debug("fx_fusion: could not read the cuts of %s", node, exc_info=True)
            sources = [kv_patterns.whole(projection)]
        if sources[0].node is not projection.node:
            # Column slices may be separate branches (a fused kv/qkv linear) or parts of one head-split
            # branch (partial rotary on a single head): the whole-projection reading wins when it matches.
            try:
                entry["branches"].append(kv_patterns.match_k_branch(projection, kv_patterns.whole(projection), same_value))
                continue
            except NoMatch:
                pass
        for source in sources:
            try:
                entry["branches"].append(kv_patterns.match_k_branch(projection, source, same_value))
            except kv_patterns.NotKBranch as reason:
                entry["not_k"][projection.node] = str(reason)
            except NoMatch as reason:
                record.rejected.append(Rejection(str(reason), node_location(node)))
            except Exception as error:  # a graph shape the matcher did not foresee: leave it alone
                logger.debug("fx_fusion: could not analyse %s", node, exc_info=True)
                reason = f"could not be analysed ({type(error).__name__}: {error})"
                record.rejected.append(Rejection(reason, node_location(node)))
    return by_input.values()


def fuse_kv_groups(graph: torch.fx.Graph, min_layers: int = 1, stack_weights_in_graph: bool = False) -> PassRecord:
    """Find, group and rewrite (module docstring). `stack_weights_in_graph`: spell the grouped GEMM as one
    mm over `cat(weights)` in the graph, for Inductor freezing to fold into one constant (no op call)."""
    # einsum projections as the linears they compute, provisionally: put back where nothing fused them
    read = batched_linears.read_as_linears(graph)
    try:
        return _fuse_kv_groups(graph, min_layers, stack_weights_in_graph)
    finally:
        batched_linears.restore(graph, read)


def _fuse_kv_groups(graph: torch.fx.Graph, min_layers: int, stack_weights_in_graph: bool) -> PassRecord:
    record = PassRecord()
    fake_mode = _fake_mode(graph)
    # canonical forms first: in-place column updates as plain chains, K/V of stacked layers cut by selects
    # as column slices, one norm over a layer-major stack of every layer's K as one norm per layer,
    # projections concatenated along tokens before the norm (z-lab DFlash) as one chain per projection
    scatter_forwarding.forward_scattered_views(graph)
    select_cuts.selects_as_column_slices(graph)
    layer_unstack.unstack_layer_chains(graph)
    bias_adds.move_bias_adds_to_products(graph)
    if token_cats.push_token_cats(graph):
        graph.eliminate_dead_code()
    same_value = ValueKeys()
    for entry in _find_candidates(graph, record, same_value):
        branches: list[KBranch] = entry["branches"]
        fused_projections = set()
        keyed = collections.defaultdict(list)
        for branch in branches:
            keyed[_group_key(branch, same_value)].append(branch)
        ordered = sorted(keyed.items(), key=lambda kv: -sum(b.n_layers for b in kv[1]))
        if not ordered:
            _explain_plain_projections(entry, fused_projections, record)
            continue
        # Largest key first; a key that cannot join an earlier group gets an attempt of its own.
        handled, fused_main_key, merge_note, reasons = set(), None, {}, {}
        for main_key, _ in ordered:
            if main_key in handled:
                continue
            # Projections that differ only in head count (a layer's Q and K in GQA) fuse as blocks of heads
            merged = [k for k, _ in ordered if k not in handled and _heads_apart(k) == _heads_apart(main_key)]
            attempts = [merged, [main_key]] if len(merged) > 1 else [[main_key]]
            fused_keys, failures = [], []
            for keys in attempts:
                # a projection already rewritten by a group is not fused again (its other branches stay)
                members = [b for k in keys for b in keyed[k] if b.projection.node not in fused_projections]
                if not members:
                    failures.append("its projections were fused with another group")
                    continue
                failure = _fuse_members(graph, fake_mode, entry, members, fused_projections, min_layers, record, same_value, stack_weights_in_graph)
                if failure is not None:
                    failures.append(failure)
                    continue
                fused_keys = keys
                break
            handled |= {main_key, *fused_keys}
            if fused_keys:
                fused_main_key = fused_main_key or main_key
                for key in merged:
                    if key not in fused_keys:
                        merge_note.setdefault(key, (main_key, failures[0]))
                continue
            if main_key in merge_note and failures[-1] == "its projections were fused with another group":
                group_key, merge_failure = merge_note[main_key]
                reason = f"{_describe_difference(main_key, group_key)} and could not join it as blocks of heads: {merge_failure}"
            elif fused_main_key is not None:
                reason = f"{_describe_difference(main_key, fused_main_key)}; on its own: {failures[-1]}"
            else:
                reason = failures[-1]
                if len(attempts) > 1:
                    reason += f"; with its siblings of other head counts as blocks of heads: {failures[0]}"
            reasons[main_key] = reason
        for key, members in ordered:
            for branch in members if key in reasons else []:
                record.rejected.append(Rejection(reasons[key], node_location(branch.projection.node)))
        _explain_plain_projections(entry, fused_projections, record)
    return record


def _fuse_members(
    graph, fake_mode, entry: dict, members: list[KBranch], fused_projections: set, min_layers: int, record, same_value, stack_in_graph: bool
) -> Optional[str]:
    """Rewrite `members` as one group, with the input's plain projections of a K width as V-like views;
    adds what it rewrote to `fused_projections`. Returns why not, or None when fused."""
    n_layers = sum(b.n_layers for b in members)
    if n_layers < min_layers:
        return f"only {n_layers} matching layer(s) share this input; min_layers={min_layers}"
    used = {b.projection.node for b in members}
    with_branches = {b.projection.node for b in entry["branches"]}  # those may form groups of their own
    first = members[0].projection
    widths = {b.features for b in members}
    extra = [
        p
        for p in entry["projections"]
        if p.node not in used | fused_projections | with_branches
        and p.n_layers == 1
        and first.n_layers == 1
        and p.out_features in widths
        and bool(p.biases) == bool(first.biases)
        and val(p.node).dtype == val(first.node).dtype
        and not _frozen_transposed(p)
    ]
    try:
        group, in_order = _rewrite_group(graph, fake_mode, members, extra, record, same_value, stack_in_graph)
    except Exception as error:  # never fail a compile: leave the group as it was, say why
        logger.debug("fx_fusion: group left alone", exc_info=True)
        return str(error) if isinstance(error, NoMatch) else f"could not be fused ({type(error).__name__}: {error})"
    record.fused_groups.append(group)
    if not in_order:  # sorted at once: later groups rely on graph order (kv_patterns.depends_on)
        stable_topological_sort(graph)
    fused_projections |= used | {p.node for p in extra}
    return None


def _explain_plain_projections(entry: dict, fused: set, record: PassRecord) -> None:
    """Give a reason for every unfused projection that has a same-width sibling on the same input (a
    layer's K or V that a user may expect to see fused), unless its K branch was already reported."""
    reported = {b.projection.node for b in entry["branches"]}
    widths = collections.Counter(p.out_features for p in entry["projections"])
    located = {r.location for r in record.rejected}
    for projection in entry["projections"]:
        node = projection.node
        if node in fused or node in reported or widths[projection.out_features] < 2:
            continue
        reason = entry["not_k"].get(node, "not a K projection")
        location = node_location(node)
        if location not in located:
            record.rejected.append(Rejection(f"left as a plain linear: {reason}", location))
            located.add(location)


def _rotary_table_sizes(table: torch.fx.Node, branch: KBranch, hidden: torch.fx.Node) -> Optional[list]:
    """Check that cos/sin vary with the token only (size 1 on the head and layer axes).

    Returns None when the table already holds one row per token, else the size of each token axis to
    expand it to (a table shared by several tokens, e.g. one position row for a whole batch): an int, or
    the index of the equally sized leading dim of the hidden states `hidden` (a symbolic size).
    """
    k_shape = val(branch.rotary.out).shape
    shape = [1] * (len(k_shape) - len(val(table).shape)) + list(val(table).shape)
    heads = branch.heads
    for axis in (heads.head_axis, heads.layer_axis):
        if axis is not None and not statically_known_true(shape[axis] == 1):
            raise NoMatch("cos/sin differ between heads or layers")
    if all(statically_known_true(shape[axis] == k_shape[axis]) for axis in heads.token_axes):
        return None
    hidden_dims = list(val(hidden).shape[:-1])
    sizes = []
    for axis in heads.token_axes:
        size = k_shape[axis]
        if not (statically_known_true(shape[axis] == size) or statically_known_true(shape[axis] == 1)):
            raise NoMatch("cos/sin do not line up with the tokens")
        if isinstance(size, int):
            sizes.append(size)
            continue
        matches = [i for i, dim in enumerate(hidden_dims) if statically_known_true(dim == size)]
        if not matches:
            raise NoMatch("cos/sin are shared by several tokens of a dynamic size that cannot be located")
        sizes.append(("hidden dim", matches[0]))
    return sizes


def _per_token_rotary_table(
    builder: _GraphBuilder, table: rotary_action.Table, branch: KBranch, hidden: torch.fx.Node, sizes: Optional[list]
) -> torch.fx.Node:
    """cos or sin as [tokens, rotary_dim], tokens in projection-row order (a view unless expanded or
    widened from half width)."""
    rank = len(val(branch.rotary.out).shape)
    table_spec, table = table, table.node
    node = table
    if table_spec.part is not None:  # cos/sin as the real/imaginary parts of a complex table
        node = builder.call(aten.view_as_real.default, node)
        node = builder.call(aten.select.int, node, -1, 0 if table_spec.part == "real" else 1)
    for _ in range(rank - len(val(table).shape)):
        node = builder.call(aten.unsqueeze.default, node, 0)
    heads = branch.heads
    other_axes = [a for a in (heads.layer_axis, heads.head_axis) if a is not None]
    order = heads.token_axes + other_axes + [rank - 1]
    if order != list(range(rank)):
        node = builder.call(aten.permute.default, node, order)
    if sizes is not None:
        token_sizes = [
            size if isinstance(size, int) else builder.call(aten.sym_size.int, hidden, size[1]) for size in sizes
        ]
        node = builder.call(aten.expand.default, node, token_sizes + [1] * len(other_axes) + [-1])
    rotary_dim = branch.rotary.rotary_dim
    width = rotary_dim if table_spec.mode == "full" else rotary_dim // 2
    node = builder.call(aten.reshape.default, node, [-1, width])
    if table_spec.mode == "neox":  # the same frequencies for both halves
        node = builder.call(aten.cat.default, [node, node], -1)
    elif table_spec.mode == "interleaved":  # each frequency for a pair of elements
        node = builder.call(aten.unsqueeze.default, node, -1)
        node = builder.call(aten.expand.default, node, [-1, -1, 2])
        node = builder.call(aten.reshape.default, node, [-1, rotary_dim])
    return node


_GATHERS = (aten.index.Tensor, aten.index_select.default, aten.embedding.default)
_TABLE_VIEWS = (aten.unsqueeze.default, aten.view.default, aten.reshape.default, prims.convert_element_type.default)


def _gathered_rows(table: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node, int, int]]:
    """(cache, positions, first column, end column) when `table` is a column range of `cache[positions]`
    (index, index_select or embedding), seen through unsqueezes/views/casts."""
    node = table
    while is_call(node, *_TABLE_VIEWS):
        node = node.args[0]
    cut = kv_patterns.column_range(node)
    if cut is None:
        return None
    gather, start, end = cut
    if is_call(gather, aten.index.Tensor) and len(gather.args[1]) == 1 and gather.args[1][0] is not None:
        cache, positions = gather.args[0], gather.args[1][0]
    elif is_call(gather, aten.index_select.default) and gather.args[1] == 0:
        cache, positions = gather.args[0], gather.args[2]
    elif is_call(gather, aten.embedding.default):
        cache, positions = gather.args[0], gather.args[1]
    else:
        return None
    if val(cache).dim() != 2 or val(positions).dtype not in (torch.int32, torch.int64):
        return None
    return cache, positions, start, end


def _cache_and_positions(branch: KBranch) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """The cos/sin cache [max_pos, rotary_dim] (cos then sin halves) and the positions of the K rows when
    cos and sin are the two halves of `cache[positions]`, one position per token in projection-row order;
    the fused op then reads the cache itself instead of per-token tables (SGLang/vLLM's layout)."""
    rotary = branch.rotary
    half, mode = rotary.rotary_dim // 2, ("interleaved" if rotary.interleaved else "neox")
    found = [_gathered_rows(t.node) if t.part is None else None for t in (rotary.cos, rotary.sin)]
    if None in found or rotary.cos.mode != mode or rotary.sin.mode != mode or rotary.sin_negated:
        return None
    (cache, positions, cos_start, cos_end), (cache_s, positions_s, sin_start, sin_end) = found
    if (cache, positions) != (cache_s, positions_s) or (cos_start, cos_end, sin_start, sin_end) != (0, half, half, 2 * half):
        return None
    if kv_patterns.static_shape(cache)[-1] != rotary.rotary_dim:
        return None
    # rows in token order: the table's non-unit leading dims are K's token dims, in order, and the positions'
    k_shape = kv_patterns.static_shape(rotary.out)
    table_shape = kv_patterns.static_shape(rotary.cos.node)
    table_shape = [1] * (len(k_shape) - len(table_shape)) + table_shape
    token_axes = branch.heads.token_axes
    if token_axes != sorted(token_axes) or [a for a, n in enumerate(table_shape[:-1]) if n != 1] != [
        a for a in token_axes if k_shape[a] != 1
    ]:
        return None
    if any(table_shape[a] != k_shape[a] for a in token_axes):
        return None
    if [n for n in kv_patterns.static_shape(positions) if n != 1] != [k_shape[a] for a in token_axes if k_shape[a] != 1]:
        return None
    return cache, positions


def _shared_rotary_tables(branches: list[KBranch], same_value: ValueKeys):
    """("cache", (cache, positions)) when every layer gathers its cos/sin from the same cache rows,
    ("shared", None) when every layer reads the same cos/sin values, else ("per layer", None)."""
    found = [_cache_and_positions(b) for b in branches]
    if found[0] is not None and all(f is not None and same_value(f) == same_value(found[0]) for f in found):
        return "cache", found[0]
    tables = {(same_value(b.rotary.cos.node), same_value(b.rotary.sin.node)) for b in branches}
    return ("shared" if len(tables) == 1 else "per layer"), None


def _rotary_tables(builder: _GraphBuilder, branches: list[KBranch], hidden: torch.fx.Node, sizes: dict, blocks_of: Optional[dict]):
    """Per-token (cos, sin) [tokens, rotary_dim] shared by the group (blocks_of None), or
    [n_blocks, tokens, rotary_dim] with each branch's tables repeated for its blocks (blocks_of[id])."""
    shared = blocks_of is None
    per_branch = []
    for branch in branches if not shared else branches[:1]:
        pair = []
        for table in (branch.rotary.cos, branch.rotary.sin):
            node = _per_token_rotary_table(builder, table, branch, hidden, sizes[table.node])
            if table is branch.rotary.sin and branch.rotary.sin_negated:  # the op rotates by +angle
                node = builder.call(aten.neg.default, node)
            if not shared:  # [blocks, tokens, rotary_dim] per branch
                node = builder.call(aten.unsqueeze.default, node, 0)
                if blocks_of[id(branch)] > 1:
                    node = builder.call(aten.expand.default, node, [blocks_of[id(branch)], -1, -1])
            pair.append(node)
        per_branch.append(pair)
    if shared:
        return per_branch[0]
    return tuple(builder.call(aten.cat.default, [pair[i] for pair in per_branch]) for i in (0, 1))


def _grouped_gemm(builder: _GraphBuilder, x2d, weights: list, biases: list, stack_in_graph: bool) -> torch.fx.Node:
    """x2d @ cat(weights).T (+ cat(biases)): our grouped_linear op, which reads every weight where it lives,
    or, for Inductor freezing, an mm over weights concatenated in the graph, which freezing folds into
    one constant (what its own concat-linear pass does)."""
    if not stack_in_graph or len(biases) not in (0, len(weights)):
        return builder.call(torch.ops.fx_fusion.grouped_linear.default, x2d, weights, biases)
    stacked = builder.call(aten.permute.default, builder.call(aten.cat.default, weights), [1, 0])
    if biases:
        return builder.call(aten.addmm.default, builder.call(aten.cat.default, biases), x2d, stacked)
    return builder.call(aten.mm.default, x2d, stacked)


def _frozen_transposed(projection: Projection) -> bool:
    """Weights Inductor freezing folded into constants stored [hidden, out_features]."""
    return projection.weight_transposed and any(w.op == "get_attr" for w in projection.weights)


def _rewrite_group(
    graph, fake_mode, branches: list[KBranch], extra: list[Projection], record, same_value, stack_in_graph: bool
) -> FusedGroup:
    branches = sorted(branches, key=lambda b: b.projection.node)  # nodes compare in graph order
    first = branches[0]
    projections: list[Projection] = []
    for projection in [b.projection for b in branches] + extra:
        if projection.node not in {p.node for p in projections}:
            projections.append(projection)
    if any(_frozen_transposed(p) for p in projections):
        raise NoMatch("projection weights were pre-transposed by Inductor freezing; use backend='fx_fusion'")
    offsets, column = {}, 0
    for projection in projections:
        offsets[projection.node] = column
        column += projection.out_features
    # Each layer's K in blocks of `unit` heads (one block per layer unless head counts differ, e.g. a GQA
    # layer's Q and K): the first projection column of every block, in order. The fused op reads them as
    # a strided [tokens, n_blocks, unit * head_dim] view, so they must be evenly spaced.
    head_dim = first.heads.head_dim
    head_stride = first.source.head_stride or head_dim
    unit = math.gcd(*(b.heads.num_heads for b in branches))
    blocks_of = {id(b): b.n_layers * (b.heads.num_heads // unit) for b in branches}
    k_columns = [
        offsets[b.projection.node] + layer * b.projection.layer_width + b.source.col_start + block * unit * head_stride
        for b in branches
        for layer in range(b.n_layers)
        for block in range(b.heads.num_heads // unit)
    ]
    n_blocks, features = len(k_columns), unit * head_dim
    split_heads = n_blocks > sum(b.n_layers for b in branches)  # some layer's heads span several blocks
    step = k_columns[1] - k_columns[0] if n_blocks > 1 else first.projection.layer_width
    within = max(0, k_columns[0] + n_blocks * step - column)  # K's first column inside each block's step
    block_start = k_columns[0] - within
    if (
        any(c != k_columns[0] + i * step for i, c in enumerate(k_columns))
        or within + (unit - 1) * head_stride + head_dim > step
        or block_start < 0
        or step % head_stride
    ):
        raise NoMatch("K columns of the stacked projection are not evenly spaced")

    x2d = min(p.x2d for p in projections)
    norm_weights = [b.norm.weight for b in branches] if first.norm and first.norm.weight is not None else []
    # One [head_dim] weight per layer: the op reads them where they are, each once per block of its layer's
    # heads (Q's weight for each of its blocks beside K's); else they are gathered into a table.
    one_weight_per_layer = all(b.n_layers == 1 and val(w).dim() == 1 for b, w in zip(branches, norm_weights))
    per_block_weights = [w for b, w in zip(branches, norm_weights) for _ in range(blocks_of[id(b)])]
    weights_in_place = one_weight_per_layer and len(per_block_weights) <= MAX_NORM_WEIGHTS_PER_LAUNCH
    # a branch's weight as the op takes it: [head_dim] for one layer, [n_layers, head_dim] for a stack; one
    # [head_dim] weight for all of a stack's layers, weights stacked in the graph (a cat) or a parameter
    # shaped to broadcast ([L, 1, D]) go through the table below
    weights_as_they_are = all(val(w).dim() == (1 if b.n_layers == 1 else 2) for b, w in zip(branches, norm_weights))
    eps_nodes = [b.norm.eps for b in branches for _ in range(blocks_of[id(b)]) if first.norm and isinstance(b.norm.eps, torch.fx.Node)]
    table_kind, cache_positions = _shared_rotary_tables(branches, same_value)
    if cache_positions is not None:
        tables = list(cache_positions)
    else:
        tables = list({t.node: None for b in branches for t in (b.rotary.cos, b.rotary.sin)})
    inputs = [x2d, *tables, *norm_weights, *eps_nodes]
    inputs += [w for p in projections for w in p.weights + p.biases]
    replaced = {p.node for p in projections} | {b.output for b in branches}
    if kv_patterns.depends_on([x2d, *tables, *eps_nodes], replaced):
        raise NoMatch("the group's inputs depend on its own outputs")
    hidden = kv_patterns.base_of(x2d)
    table_sizes = {}
    if cache_positions is None:
        for branch in branches:
            for table in (branch.rotary.cos, branch.rotary.sin):
                table_sizes[table.node] = _rotary_table_sizes(table.node, branch, hidden)
    before = _region_text(graph, projections, branches)

    # The replacement goes just before the first projection, so that every reader of a replaced node
    # follows it; inputs formed later (e.g. tables a layer computes after its projections) move there
    # first when they are pure (harmless if the rewrite is then refused). Else it goes after the last
    # input, and the graph is sorted afterwards.
    first_projection = min(p.node for p in projections)
    point = first_projection if kv_patterns.hoist_before(first_projection, inputs) else max(inputs).next
    builder = _GraphBuilder(graph, fake_mode)
    try:
        with graph.inserting_before(point):  # in the order they are built
            # each weight as the op reads it, [out_features, hidden]: one stored [hidden, out_features]
            # (`x @ W`) as its transposed view, read where it lives
            weights = [builder.call(aten.permute.default, w, [1, 0]) if p.weight_transposed else w for p in projections for w in p.weights]
            biases = [b for p in projections for b in p.biases]
            proj = _grouped_gemm(builder, x2d, weights, biases, stack_in_graph)
            k_block = builder.call(aten.slice.Tensor, proj, 1, block_start, block_start + n_blocks * step)
            k_block = builder.call(aten.view.default, k_block, [-1, n_blocks, step])
            if head_stride == head_dim:  # [tokens, n_blocks, unit * head_dim]
                k_proj = builder.call(aten.slice.Tensor, k_block, 2, within, within + features)
            else:  # heads apart from each other: [tokens, n_blocks, unit, head_dim], strided
                k_proj = builder.call(aten.view.default, k_block, [-1, n_blocks, step // head_stride, head_stride])
                first_head = within // head_stride
                k_proj = builder.call(aten.slice.Tensor, k_proj, 2, first_head, first_head + unit)
                offset = within % head_stride
                k_proj = builder.call(aten.slice.Tensor, k_proj, 3, offset, offset + head_dim)
            if first.norm is not None and first.norm.weight is None:  # a weightless norm scales by ones
                norm_weights = [builder.call(
                    aten.full.default, [n_blocks, head_dim], 1.0, dtype=val(x2d).dtype, device=val(x2d).device
                )]  # fmt: skip
            elif weights_in_place:
                norm_weights = per_block_weights
            elif norm_weights and (split_heads or len(norm_weights) > 1 or not weights_as_they_are):
                rows = []  # a table (the parameters stay where they are)
                for branch, weight in zip(branches, norm_weights):
                    row = builder.call(aten.reshape.default, weight, [-1, 1, head_dim])
                    blocks = blocks_of[id(branch)] // branch.n_layers
                    shared = val(weight).numel() != branch.n_layers * head_dim  # one weight for all its layers
                    if blocks > 1 or shared:  # each layer's weight (or the one for all) per block of heads
                        row = builder.call(aten.expand.default, row, [branch.n_layers, blocks, head_dim])
                    rows.append(builder.call(aten.reshape.default, row, [-1, head_dim]))
                norm_weights = [builder.call(aten.cat.default, rows)]
            eps_value, eps_tensor = 0.0, None
            if first.norm is not None:
                if eps_nodes:  # eps arrives as a tensor (dynamic floats): gather one per layer
                    device = val(proj).device  # dynamo passes unspecialized floats as CPU scalar tensors
                    eps32 = [builder.call(torch.ops.prims.convert_element_type.default, e, torch.float32) for e in eps_nodes]
                    if val(eps32[0]).device != device:
                        # 0 + eps on the device: Inductor passes a CPU scalar to its kernel by value, where a
                        # copy to the device would be one per call (and no CUDA graph could capture it)
                        zero = builder.call(aten.full.default, [1], 0.0, dtype=torch.float32, device=device)
                        eps32 = [builder.call(aten.add.Tensor, zero, e) for e in eps32]
                    eps_tensor = builder.call(aten.cat.default, [builder.call(aten.view.default, e, [1]) for e in eps32])
                else:
                    eps_value = first.norm.eps
            if cache_positions is not None:  # the op gathers cos/sin rows itself
                cos, sin = cache_positions[0], None
                positions = builder.call(aten.reshape.default, cache_positions[1], [-1])
            else:
                cos, sin = _rotary_tables(builder, branches, hidden, table_sizes, None if table_kind == "shared" else blocks_of)
                positions = None
            k_all = builder.call(
                torch.ops.fx_fusion.materialize_k.default,
                k_proj,
                norm_weights,
                eps_tensor,
                eps_value,
                cos,
                sin,
                positions,
                unit,
                head_dim,
                first.rotary.rotary_dim,
                first.rotary.interleaved,
                first.norm.weight_offset if first.norm else 0.0,
                first.norm.weight_in_float32 if first.norm else False,
                first.norm.round_before_rope if first.norm else True,
                # a layer in several blocks (Q beside K) reads its blocks as one [tokens, heads] view
                **({"token_major": True} if split_heads else {}),
            )
            new_outputs, block, strided_views = [], 0, 0
            symbols = kv_patterns.symbol_inputs(graph) if split_heads else {}
            for branch in branches:
                count = blocks_of[id(branch)]
                if branch.source.roles is not None:  # a strided piece (litgpt): its K, re-laid out
                    k_branch = _strided_piece(builder, k_all, block, count, branch.source)
                    block += count
                    new_outputs.append((branch.output, builder.replay(branch.layout_before_norm + branch.layout_after_norm, k_branch)))
                    continue
                if count == 1:  # [tokens, H, D] of this layer
                    k_branch = builder.call(aten.select.int, k_all, 0, block)
                else:  # stacked layers or blocks of heads: [tokens, count, unit, D]
                    k_branch = builder.call(aten.slice.Tensor, k_all, 0, block, block + count)
                    k_branch = builder.call(aten.permute.default, k_branch, [1, 0, 2, 3])
                block += count
                # [tokens, n_layers * features], or laid out as the source when it is a view of the projection
                shape = branch.source.output_shape(branch.features) or [-1, branch.n_layers * branch.features]
                k_branch = builder.call(aten.reshape.default, k_branch, shape)
                k_branch = builder.replay(branch.layout_before_norm + branch.layout_after_norm, k_branch)
                # a layer's query heads over several blocks: read in place where that is a view (strided_outputs)
                view = strided_outputs.as_strided_view(builder, k_all, k_branch, symbols) if split_heads else None
                if view is not None:
                    builder.discard(k_branch)
                    k_branch, strided_views = view, strided_views + 1
                new_outputs.append((branch.output, k_branch))
            pieces = []
            for projection in projections:
                start = offsets[projection.node]
                pieces.append((projection.node, builder.call(aten.slice.Tensor, proj, 1, start, start + projection.out_features)))
            builder.finish()
    except Exception as error:  # e.g. the op's fake kernel refusing the shapes: leave the graph as it was
        builder.erase()
        raise NoMatch(f"could not build the fused replacement ({type(error).__name__}: {error})") from error
    # placed after the last input, an earlier reader of a replaced node would need a sort
    in_order = all(new < user for old, new in new_outputs + pieces for user in old.users)
    for old, new in new_outputs + pieces:
        old.replace_all_uses_with(new)
    kv_patterns.erase_unused([old for old, _ in new_outputs + pieces] + [new for _, new in pieces])
    cache_builder = _GraphBuilder(graph, fake_mode)
    try:
        cache_note = cache_writes.absorb(graph, cache_builder, k_all, proj, in_order)
        in_order &= not cache_note  # its writes' readers now read caches written after them
    except Exception as error:  # the group stays fused; its cache writes stay as written
        cache_builder.erase()
        reason = str(error) if isinstance(error, NoMatch) else f"{type(error).__name__}: {error}"
        cache_note = f"cache writes left as written: {reason}"
        logger.debug("fx_fusion: cache writes left alone", exc_info=True)
    angles = rotary_angles.outer_products_to_mul(graph, fake_mode, tables)
    record.graph_before += before
    record.graph_after += "\n".join(n.format_node() for n in angles + builder.created + cache_builder.created) + "\n"
    group = FusedGroup(
        n_layers=sum(b.n_layers for b in branches),
        num_kv_heads=unit,
        head_dim=head_dim,
        rotary_dim=first.rotary.rotary_dim,
        rotary_style="interleaved" if first.rotary.interleaved else "neox",
        k_norm=first.norm is not None,
        bias=bool(first.projection.biases),
        v_as_view=len(projections) - len({b.projection.node for b in branches}),
        rotary_matmuls_as_mul=len(angles),
        rotary_tables={"cache": "cos/sin cache + positions", "shared": "per-token cos/sin", "per layer": "per-layer cos/sin"}[table_kind],
        layers=[node_location(b.projection.node) for b in branches],
        layer_heads=[b.heads.num_heads for b in branches for _ in range(b.n_layers)],
        cache_writes=cache_note,
        strided_views=strided_views,
    )
    return group, in_order


def _strided_piece(builder: _GraphBuilder, k_all: torch.fx.Node, block: int, count: int, source) -> torch.fx.Node:
    """One layer's K [tokens, H, D] laid out as its strided source piece (kv_patterns.BranchSource): the
    tokens split as the piece's token axes, then its axes put in the piece's order, size-1 axes added."""
    shape = list(val(source.node).shape)
    token_axes = sorted((a for a, (role, _) in enumerate(source.roles) if role == "token"), key=lambda a: source.roles[a][1])
    head_axes = [a for a, (role, _) in enumerate(source.roles) if role == "head"]
    token_sizes = _size_args(builder, [shape[a] for a in token_axes])
    if count == 1:  # [tokens, H, D]
        piece = builder.call(aten.select.int, k_all, 0, block)
    else:  # its heads in `count` blocks: [tokens, count, unit, D]
        piece = builder.call(aten.slice.Tensor, k_all, 0, block, block + count)
        piece = builder.call(aten.permute.default, piece, [1, 0, 2, 3])
    piece = builder.call(aten.reshape.default, piece, token_sizes + [source.n_heads, shape[-1]])
    present = token_axes + head_axes  # the axes `piece` has now (a head axis only when the piece has one)
    if not head_axes:
        piece = builder.call(aten.select.int, piece, len(token_axes), 0)
    order = sorted(range(len(present)), key=lambda i: present[i])
    piece = builder.call(aten.permute.default, piece, order + [len(present)])
    for axis, (role, _) in enumerate(source.roles):
        if role == "unit":
            piece = builder.call(aten.unsqueeze.default, piece, axis)
    return piece


def _size_args(builder: _GraphBuilder, sizes: list) -> list:
    """`sizes` as a reshape's size arguments: a number as it is, a symbolic size as the graph inputs that
    hold its symbols (dynamo passes each free symbol of a dynamic shape as an input; a product of them is
    built with `builder`), one other as -1; NoMatch when more are left (the reshape could not be spelled)."""
    symbols = kv_patterns.symbol_inputs(builder.graph)
    terms = [strided_outputs.spelled(size, symbols) for size in sizes]
    if terms.count(None) > 1:
        raise NoMatch("a strided K piece has token axes of symbolic sizes that are not graph inputs")
    return [-1 if term is None else strided_outputs.spell(builder, term) for term in terms]


def _region_text(graph, projections: list[Projection], branches: list[KBranch]) -> str:
    """The original nodes between the group's projections and its K outputs, in graph order."""
    ends = [b.output for b in branches] + [p.node for p in projections]
    starts = {p.node for p in projections}
    region, stack = set(), list(ends)
    while stack:
        node = stack.pop()
        if node in region or node.op in ("placeholder", "get_attr"):
            continue
        region.add(node)
        if node not in starts:
            stack.extend(node.all_input_nodes)
    return "\n".join(n.format_node() for n in graph.nodes if n in region) + "\n"
