"""Replace calls of fx_fusion ops in a post-grad graph by their traced bodies, so Inductor runs them itself.

An op call left in the graph is an opaque fallback: every compiled call dispatches it from Python, and on
CPU its math runs eagerly. Its body, traced here with functionalisation, is instead plain graph code:

- on CUDA, `torch.library.wrap_triton(kernel)[grid](...)` traces to a `triton_kernel_wrapper_functional`
  node, which Inductor re-inplaces and launches from its own generated code (no op dispatch per call);
- elsewhere the body is the op's math in ATen ops, which Inductor compiles like the rest of the graph (C++
  on CPU) rather than calling an eager implementation.

The tracing is the one Inductor's pattern matcher uses for its replacement graphs (make_fx with Inductor's
decompositions), plus `dispatch_functionalize` so that kernels writing into fresh outputs become functional
nodes; these private APIs are used in this module only. Bodies run on the nodes' fake values, so shapes,
symbolic sizes and the ops' own validation are exactly those of the graph.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch
import torch._guards
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.functional_tensor import (
    FunctionalTensorMode,
    dispatch_functionalize,
)
from torch.fx.experimental.proxy_tensor import make_fx

from . import rotary_angles
from .kv_patterns import hoist_before

logger = logging.getLogger("fx_fusion")


def trace_functional(fn: Callable[..., Any], example_inputs: list) -> torch.fx.GraphModule:
    """`fn` traced on fake (or real) example inputs into functional, decomposed ATen code."""
    with enable_python_dispatcher():
        traced = make_fx(dispatch_functionalize(fn, FunctionalTensorMode()), select_decomp_table())(*example_inputs)
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return traced


def _check_kernels_only_write_fresh_tensors(traced: torch.fx.Graph, writable: frozenset = frozenset()) -> None:
    """Refuse a body whose kernel may write one of its inputs (other than the `writable` kernel arguments,
    the caches a cache write is meant to update): Inductor would copy that input on every call (it clones
    what a kernel mutates), e.g. every weight when it cannot analyse which pointers are stored to."""
    for node in traced.nodes:
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            kernel_args = node.kwargs["kwargs"]
            written = [
                name for name in node.kwargs["tensors_to_clone"]
                if kernel_args[name].op == "placeholder" and name not in writable
            ]  # fmt: skip
            if written:
                raise ValueError(f"the kernel may write its inputs {written}, which would be copied on every call")


def _describe(template: Any) -> str:
    """The structure and constants of `template`, each node in it as its value's shape, strides, dtype and
    device (or its value, for a symbolic or plain one)."""

    def describe(arg: torch.fx.Node) -> str:
        value = arg.meta["val"]
        if isinstance(value, torch.Tensor):
            return f"T({tuple(value.shape)},{value.stride()},{value.dtype},{value.device})"
        return f"V({value!r})"

    return repr(torch.fx.map_arg(template, describe))


def _signature(node: torch.fx.Node) -> str:
    """What a traced body depends on: the target, the argument structure and constants, and each input's
    shape, strides, dtype and device (layers of one model share it, and so one trace)."""
    return repr((str(node.target), _describe((node.args, node.kwargs))))


def _trace_template(fn: Callable[..., Any], template: Any) -> torch.fx.GraphModule:
    """`fn(*template)` traced (trace_functional) with every fx.Node in the (possibly nested) `template` an
    input, at its fake value; everything else (ints, floats, bools, None) is a constant of the trace."""
    inputs: list[torch.fx.Node] = []
    torch.fx.map_arg(template, inputs.append)

    def call(*values):
        lookup = dict(zip(inputs, values))
        return fn(*torch.fx.map_arg(template, lookup.__getitem__))

    values = [n.meta["val"] for n in inputs]
    with torch._guards.detect_fake_mode(values) or contextlib.nullcontext():  # new tensors: the graph's fakes
        return trace_functional(call, values)


class Inserted(NamedTuple):
    outputs: Any  # the trace's output nodes (a node, or a list for a tuple output)
    created: list[torch.fx.Node]  # every node added


def insert_traced(
    graph: torch.fx.Graph, fn: Callable[..., Any], template: Any, traced: Optional[torch.fx.GraphModule] = None
) -> Inserted:
    """Add `fn(*template)`, traced functional (or the given `traced`, of the same template), to `graph` at its
    insertion point."""
    traced = traced if traced is not None else _trace_template(fn, template)
    inputs: list[torch.fx.Node] = []
    torch.fx.map_arg(template, inputs.append)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    copies = dict(zip(placeholders, inputs))  # graph_copy maps each traced node to its copy here

    def added() -> list[torch.fx.Node]:
        return [copies[n] for n in traced.graph.nodes if n.op not in ("placeholder", "output") and n in copies]

    try:
        outputs = graph.graph_copy(traced.graph, copies)
    except Exception:
        for node in reversed(added()):
            graph.erase_node(node)
        raise
    return Inserted(outputs, added())


def inline_call(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    body: Callable[..., Any],
    traces: Optional[dict] = None,
    writable: frozenset = frozenset(),
) -> list[torch.fx.Node]:
    """Replace `node` by the traced `body(*node.args, **node.kwargs)`; returns the nodes added.
    `traces` caches traced bodies by signature; `writable`: kernel arguments the body may write."""
    template = (node.args, node.kwargs)

    def call(args, kwargs):
        return body(*args, **kwargs)

    key = _signature(node)
    traced = traces.get(key) if traces is not None else None
    if traced is None:
        traced = _trace_template(call, template)
        _check_kernels_only_write_fresh_tensors(traced.graph, writable)
        if traces is not None:
            traces[key] = traced
    with graph.inserting_before(node):
        result = insert_traced(graph, call, template, traced)
    if isinstance(result.outputs, (tuple, list)):  # a multi-output op: its users read the outputs by getitem
        for user in list(node.users):
            user.replace_all_uses_with(result.outputs[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result.outputs)
    graph.erase_node(node)
    return result.created


# The kernel arguments that a cache write's kernel stores to: the caches (fused_kv_materialize's kernel).
_CACHE_POINTERS = frozenset(
    [f"{kv}_out_ptr" for kv in "kv"] + [f"{kv}_out{i}" for kv in "kv" for i in range(1, 8)]
)


def _functionalized_cache_write(op, **kwargs):
    """The body of `auto_functionalized_v2(materialize_kv_to_cache, ...)`: the op's body on its caches (the
    bases, which it writes), returning (no output, *the written bases) as the functional node does."""
    from fx_fusion.kernels import ops

    bases = list(kwargs["_all_bases"])
    caches = {}
    for name in ("k_caches", "v_caches"):
        count = kwargs[f"_{name}_length"]
        if any(f"_{name}_{i}_size" in kwargs for i in range(count)):  # a cache given as a view of its base
            raise NotImplementedError("caches that are views of other tensors")
        caches[name] = [bases[kwargs[f"_{name}_{i}_base_index"]] for i in range(count)]
    args = [caches.get(a.name, kwargs.get(a.name)) for a in op._schema.arguments]
    ops.materialize_kv_to_cache_body(*args)
    return (None, *bases)


def _bodies() -> dict:
    """target -> (traceable body, kernel arguments it may write)."""
    from fx_fusion.kernels import grouped_linear, ops

    return {
        torch.ops.fx_fusion.materialize_k.default: (ops.materialize_k_body, frozenset()),
        torch.ops.fx_fusion.grouped_linear.default: (grouped_linear.grouped_linear_body, frozenset()),
    }


def _body_of(node: torch.fx.Node, bodies: dict):
    if node.op != "call_function":
        return None
    if node.target is torch.ops.higher_order.auto_functionalized_v2:
        if node.args[0] is torch.ops.fx_fusion.materialize_kv_to_cache.default:
            return _functionalized_cache_write, _CACHE_POINTERS
        return None
    return bodies.get(node.target)


_VIEWS = frozenset(
    [torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
     torch.ops.aten._unsafe_view.default]
)  # fmt: skip


def _viewed_grouped_linear(node: torch.fx.Node) -> tuple[Optional[torch.fx.Node], list[torch.fx.Node]]:
    """The grouped_linear call that `node` is a chain of views of (or None), and the chain's nodes."""
    chain = []
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEWS:
        chain.append(node)
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and node.target is torch.ops.fx_fusion.grouped_linear.default:
        return node, chain
    return None, chain


def _k_columns(grouped: torch.fx.Node, k_proj: torch.fx.Node, num_heads: int, head_dim: int) -> Optional[tuple]:
    """(column, block_stride, head_stride) of head h of block b in the grouped output, from the fake values
    of the output [N, columns] and of k_proj, a view of it [N, blocks, heads * head_dim] or [N, blocks, heads,
    head_dim]; None unless k_proj shares the output's storage, its tokens are the output's rows and its
    elements are adjacent."""
    out, k = grouped.meta.get("val"), k_proj.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(k, torch.Tensor) or out.dim() != 2 or k.dim() not in (3, 4):
        return None
    sizes = (*out.shape, *out.stride(), out.storage_offset(), *k.shape, *k.stride(), k.storage_offset())
    if not all(isinstance(v, int) for v in sizes) or not out.is_contiguous():  # symbolic sizes: no guards
        return None
    if k.untyped_storage()._cdata != out.untyped_storage()._cdata:  # not a view of the output after all
        return None
    columns = out.shape[1]
    token_stride, block_stride, element_stride = k.stride()[0], k.stride()[1], k.stride()[-1]
    head_stride = k.stride()[2] if k.dim() == 4 else head_dim * element_stride
    if element_stride != 1 or (k.shape[0] != 1 and token_stride != columns):
        return None
    if k.shape[1] == 1:  # one block: any stride past the output keeps block 0 the only one
        block_stride = columns + (-columns) % head_dim
    if num_heads == 1:  # one head per block: it starts the block
        head_stride = block_stride
    return k.storage_offset() - out.storage_offset(), block_stride, head_stride


K_EPILOGUE_DEVICE_TYPES = frozenset({"cuda"})  # where grouped_linear_k_epilogue_body has a launch


def _k_epilogue_body(args, kwargs):
    from fx_fusion.kernels import grouped_linear

    return grouped_linear.grouped_linear_k_epilogue_body(*args, **kwargs)


def _angle_source(c, n_tokens: int) -> "rotary_angles.AngleSource | str":
    """Where the launch can compute materialize_k's cos / sin from (`rotary_angles.find_angle_source`), or
    why it reads them as tables."""
    from fx_fusion.kernels.grouped_gemv import max_angle_tokens

    limit = max_angle_tokens(c.rotary_dim, c.head_dim, c.interleaved)
    if n_tokens > limit:  # reading the tables is faster (and replays would grow with the tokens)
        return f"{n_tokens} tokens: reading tables is faster past {limit}"
    if c.positions is not None or not isinstance(c.cos, torch.fx.Node) or not isinstance(c.sin, torch.fx.Node):
        return "the rotary tables are a cos/sin cache read at positions"
    try:
        source = rotary_angles.find_angle_source(c.cos, c.sin, n_tokens, c.rotary_dim, c.interleaved)
    except Exception as error:  # noqa: BLE001  (a failed read-back costs the angles only, not the epilogue)
        logger.debug("fx_fusion: reading back the rotary tables failed", exc_info=True)
        return f"reading the tables back failed: {type(error).__name__}: {error}"
    kv_dtype = c.k_proj.meta["val"].dtype
    if not isinstance(source, str) and source.rounded_to not in (None, kv_dtype):
        return f"the tables are rounded to {source.rounded_to}, K is {kv_dtype}"
    return source


def _k_epilogue_plan(node: torch.fx.Node, traces: dict, angles_in_kernel: bool = True):
    """For a materialize_k call: (its k_proj, the grouped_linear that is a view of, the views between, the
    template and traced body of the fused launch, the `rotary_angles.AngleSource` the launch computes cos /
    sin from or why it reads the tables), or why there is none (a string). Changes no graph."""
    from fx_fusion.kernels import ops

    common, _ = ops._common_and_token_major(node.args, node.kwargs)
    c = ops.CommonArgs(*common)
    grouped, chain = _viewed_grouped_linear(c.k_proj)
    if grouped is None or grouped.kwargs:
        return "K is not a view of a grouped_linear output"
    x = grouped.args[0].meta.get("val")
    if not isinstance(x, torch.Tensor) or x.device.type not in K_EPILOGUE_DEVICE_TYPES:  # no trace needed
        return "the fused launch serves CUDA tensors"
    k_columns = _k_columns(grouped, c.k_proj, c.num_kv_heads, c.head_dim)
    if k_columns is None:
        return f"K's tokens are not the rows of {grouped.name} (or sizes are symbolic)"
    angles = _angle_source(c, c.k_proj.meta["val"].shape[0]) if angles_in_kernel else "not asked for"
    kwargs = dict(node.kwargs)
    if not isinstance(angles, str):
        kwargs["rotary_angles"] = (
            angles.inv_freq, angles.positions, angles.scale, angles.rounded_to is not None, angles.first, angles.step
        )
    template = ((*grouped.args, k_columns, *node.args), kwargs)
    key = ("k_epilogue", _signature(grouped), _signature(node), k_columns, _describe(kwargs.get("rotary_angles")))
    traced = traces.get(key)
    if isinstance(traced, Exception):  # layers alike: refused once, refused again
        raise traced
    if traced is None:
        try:
            traced = _trace_template(_k_epilogue_body, template)
            _check_kernels_only_write_fresh_tensors(traced.graph)
        except Exception as error:
            traces[key] = error
            raise
        traces[key] = traced
    return c.k_proj, grouped, chain, template, traced, angles


class Lowered(NamedTuple):
    """What `lower_fused_ops` did."""

    inlined: int  # op calls replaced by their traced bodies
    kept: list[str]  # op calls left in place, with the reason
    gemm_epilogues: int  # grouped GEMMs carrying the K norm/RoPE of a materialize_k call
    gemm_epilogue_notes: list[str]  # why other materialize_k calls keep their own kernel
    angles_in_kernel: int  # of those epilogues, how many compute their cos / sin themselves
    angle_notes: list[str]  # why the others read tables


def _erase_unused(graph: torch.fx.Graph, nodes: frozenset) -> None:
    """Erase the nodes of `nodes` that nothing reads any more, users before their inputs."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    for node in sorted((n for n in nodes if n in order), key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)


def _fuse_k_epilogues(
    graph: torch.fx.Graph, traces: dict, angles_in_kernel: bool = True
) -> tuple[int, list[str], int, list[str]]:
    """Lower each grouped_linear call whose K heads a materialize_k call reads (through views) together with
    that call, as one launch (grouped_linear.grouped_linear_k_epilogue_body), which computes the rotary
    cos / sin itself where the tables are read back to positions and frequencies (the table computations
    then go); returns how many pairs, why other materialize_k calls keep their own kernel (those are
    lowered one by one), how many launches compute their cos / sin, and why the others read tables."""
    fused, notes, in_kernel, angle_notes = 0, [], 0, []
    for node in list(graph.nodes):
        if node.target is not torch.ops.fx_fusion.materialize_k.default:
            continue
        try:
            plan = _k_epilogue_plan(node, traces, angles_in_kernel)
        except Exception as error:  # noqa: BLE001  (NotImplementedError: not served; either way lowered one by one)
            logger.debug("fx_fusion: %s keeps its own norm/RoPE kernel", node.name, exc_info=True)
            plan = f"{type(error).__name__}: {error}"
        if isinstance(plan, str):
            notes.append(f"{node.name}: {plan}")
            continue
        k_proj, grouped, chain, template, traced, angles = plan
        # The launch replaces the grouped_linear call: the norm/RoPE inputs must be ready there.
        if not hoist_before(grouped, [n for n in node.all_input_nodes if n is not k_proj]):
            notes.append(f"{node.name}: an input depends on {grouped.name}")
            continue
        try:
            with graph.inserting_before(grouped):
                projection, k_out = insert_traced(graph, _k_epilogue_body, template, traced).outputs
        except Exception as error:  # noqa: BLE001  (insert_traced removed what it added)
            notes.append(f"{node.name}: {type(error).__name__}: {error}")
            continue
        grouped.replace_all_uses_with(projection)
        node.replace_all_uses_with(k_out)
        graph.erase_node(node)
        for view in chain:  # k_proj's views, read by nothing now
            if not view.users:
                graph.erase_node(view)
        graph.erase_node(grouped)
        fused += 1
        if isinstance(angles, str):
            angle_notes.append(f"{node.name}: {angles}")
        else:
            _erase_unused(graph, angles.nodes)  # the tables, once no other call reads them
            in_kernel += 1
    return fused, notes, in_kernel, angle_notes


def lower_fused_ops(graph: torch.fx.Graph, gemm_epilogue: bool = True, angles_in_kernel: bool = True) -> Lowered:
    """Inline every fx_fusion op call that has a traceable body; says what it did (`Lowered`).

    With `gemm_epilogue`, a grouped_linear and the materialize_k reading its K heads become one launch
    where it serves them (`_fuse_k_epilogues`), which computes RoPE's cos / sin itself where the tables
    allow and `angles_in_kernel` asks for it. A body that cannot be traced leaves its call in place
    (still correct, as an opaque op) with the reason.
    """
    bodies, kept, traces = _bodies(), [], {}
    epilogues, notes, angles, angle_notes = (
        _fuse_k_epilogues(graph, traces, angles_in_kernel) if gemm_epilogue else (0, [], 0, [])
    )
    inlined = 2 * epilogues
    for node in list(graph.nodes):
        found = _body_of(node, bodies)
        if found is None:
            continue
        body, writable = found
        try:
            inline_call(graph, node, body, traces, writable)
            inlined += 1
        except NotImplementedError as reason:  # the body does not serve this call: the op call is the right code
            kept.append(f"{node.name}: {reason}")
        except Exception as error:  # noqa: BLE001  (any tracing failure: keep the op call)
            kept.append(f"{node.name}: {type(error).__name__}: {error}")
    return Lowered(inlined, kept, epilogues, notes, angles, angle_notes)
