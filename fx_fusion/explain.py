"""`fx_fusion.explain`: compile once with the fx_fusion backend and report what the pass did.

    report = fx_fusion.explain(model, hidden_states, position_ids)
    print(report)                      # summary table: fused groups and rejected candidates
    report.fused_groups, report.rejected, report.graph_before, report.graph_after
    report.to_dict(), report.to_json()

`explain` leaves no global state behind: Inductor's configuration is only patched for the duration of the
call, the compile goes through a throw-away wrapper whose cache entries are dropped afterwards (they are
also kept apart from the caller's own `torch.compile` entries while they exist), and the on-disk graph
caches are neither read nor written.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import re
import shutil
import time
import warnings
from typing import Any, Callable, Optional

import torch
import torch._functorch.config
import torch._inductor.config
import torch.fx

from .diagnostics import FusedGroup, PassRecord, RecordSink, Rejection

logger = logging.getLogger("fx_fusion")

__all__ = ["FusionReport", "explain"]

DEPYF_MISSING = "depyf is not installed (pip install depyf, or the project's [dump] extra)"
SVG_MISSING = (
    "drawing SVGs needs pydot and Graphviz's `dot`: pip install pydot; apt-get install graphviz "
    "(or your system's graphviz package)"
)


# ----------------------------------------------------------------------------------------------------------
# The report


def _short_location(location: str) -> str:
    """'layers.0.k_proj ("/path/to/drafts.py", line 108, in forward)' -> 'layers.0.k_proj (drafts.py:108)'."""
    return re.sub(r'\("(?:[^"]*/)?([^"/]+)", line (\d+), in [^)]*\)', r"(\1:\2)", location)


def _json_safe(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


@dataclasses.dataclass
class FusionReport:
    """What the fused K/V pass did in one compile (every graph it ran on, together).

    fused_groups  groups of layers rewritten into one grouped GEMM + one fused materialization op
    rejected      K/V candidates the pass left alone, with where they are and why
    graph_before  readable code of the rewritten region(s) of the post-grad graph before the pass
    graph_after   the same region(s) after the pass
    graphs        how many graphs the pass ran on (0: it did not run, e.g. nothing was compiled)
    files         files written for `dump_dir` / `svg_dir`
    notes         things a user should know (a missing optional tool, the pass not running, ...)
    output        what the compiled call returned (not serialised)
    """

    fused_groups: list[FusedGroup] = dataclasses.field(default_factory=list)
    rejected: list[Rejection] = dataclasses.field(default_factory=list)
    graph_before: str = ""
    graph_after: str = ""
    graphs: int = 0
    stages: list[str] = dataclasses.field(default_factory=list)
    backend_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    compile_seconds: float = 0.0
    files: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    records: list[PassRecord] = dataclasses.field(default_factory=list, repr=False, compare=False)
    output: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def fused_layers(self) -> int:
        return sum(g.n_layers for g in self.fused_groups)

    def summary(self) -> str:
        return (
            f"fx_fusion: fused {len(self.fused_groups)} K/V group(s) ({self.fused_layers} layers) "
            f"in {self.graphs} graph(s); left {len(self.rejected)} candidate(s) alone"
        )

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.fused_groups:
            lines += ["", "Fused groups:"]
            header = ["#", "layers", "heads x dim", "rotary", "cos/sin", "k_norm", "bias", "V as view", "absorbed layers"]
            rows = []
            for i, g in enumerate(self.fused_groups):
                layers = [_short_location(loc) for loc in g.layers] or ["-"]
                rows.append(
                    [
                        str(i),
                        str(g.n_layers),
                        f"{g.num_kv_heads} x {g.head_dim}",
                        f"{g.rotary_dim} {g.rotary_style}",
                        g.rotary_tables,
                        "yes" if g.k_norm else "no",
                        "yes" if g.bias else "no",
                        str(g.v_as_view),
                        layers[0],
                    ]
                )
                rows += [[""] * (len(header) - 1) + [loc] for loc in layers[1:]]
            lines += _table(header, rows)
            cached = [(i, g.cache_writes) for i, g in enumerate(self.fused_groups) if g.cache_writes]
            if cached:
                lines += ["", "Cache writes after a fused group:"]
                lines += _table(["#", "what became of them"], [[str(i), note] for i, note in cached])
        if self.rejected:
            lines += ["", "Rejected candidates:"]
            lines += _table(["location", "reason"], [[_short_location(r.location), r.reason] for r in self.rejected])
        if self.notes:
            lines += [""] + [f"note: {n}" for n in self.notes]
        if self.files:
            folders = sorted({os.path.dirname(f) or "." for f in self.files})
            lines += ["", f"{len(self.files)} file(s) written to {', '.join(folders)} (report.files)"]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "fused_groups": [dataclasses.asdict(g) for g in self.fused_groups],
            "rejected": [dataclasses.asdict(r) for r in self.rejected],
            "graph_before": self.graph_before,
            "graph_after": self.graph_after,
            "graphs": self.graphs,
            "stages": list(self.stages),
            "backend_options": {str(k): _json_safe(v) for k, v in self.backend_options.items()},
            "compile_seconds": self.compile_seconds,
            "files": list(self.files),
            "notes": list(self.notes),
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FusionReport":
        return cls(
            fused_groups=[FusedGroup(**g) for g in data.get("fused_groups", [])],
            rejected=[Rejection(**r) for r in data.get("rejected", [])],
            graph_before=data.get("graph_before", ""),
            graph_after=data.get("graph_after", ""),
            graphs=data.get("graphs", 0),
            stages=list(data.get("stages", [])),
            backend_options=dict(data.get("backend_options", {})),
            compile_seconds=data.get("compile_seconds", 0.0),
            files=list(data.get("files", [])),
            notes=list(data.get("notes", [])),
        )

    @classmethod
    def from_json(cls, text: str) -> "FusionReport":
        return cls.from_dict(json.loads(text))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row):
        return ("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths))).rstrip()

    return [fmt(header)] + [fmt(r) for r in rows]


# ----------------------------------------------------------------------------------------------------------
# The rewritten regions as small graphs


_NODE_NAME = re.compile(r"^%([A-Za-z_][A-Za-z0-9_]*) :", re.MULTILINE)


def _region(graph: torch.fx.Graph, names: set[str]) -> Optional[torch.fx.Graph]:
    """A graph of the named nodes: their outside inputs become placeholders, nodes used outside are outputs."""
    nodes = [n for n in graph.nodes if n.name in names and n.op not in ("placeholder", "output", "get_attr")]
    if not nodes:
        return None
    inside = set(nodes)
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes:
        for inp in node.all_input_nodes:
            if inp not in inside and inp not in env:
                env[inp] = sub.placeholder(inp.name)
                env[inp].meta = copy.copy(inp.meta)
    for node in nodes:
        env[node] = sub.node_copy(node, lambda n: env[n])
    outputs = [env[n] for n in nodes if not n.users or any(u not in inside for u in n.users)]
    sub.output(tuple(outputs))
    return sub


def _code(graph: torch.fx.Graph) -> str:
    try:
        return graph.python_code("self", verbose=True).src.strip("\n") + "\n"
    except Exception:  # readable text is best effort; fall back to FX's node listing
        return "\n".join(n.format_node() for n in graph.nodes) + "\n"


def _regions(record: PassRecord) -> tuple[Optional[torch.fx.Graph], Optional[torch.fx.Graph]]:
    if record.full_graph_before is None or record.full_graph_after is None:
        return None, None
    before_names = set(_NODE_NAME.findall(record.graph_before))
    after_names = set(_NODE_NAME.findall(record.graph_after))
    return _region(record.full_graph_before, before_names), _region(record.full_graph_after, after_names)


def _joined(parts: list[str]) -> str:
    """One graph's text as is; several graphs' texts each under a '# graph i' header."""
    if len(parts) <= 1:
        return "".join(parts)
    return "\n".join(f"# graph {i}\n" + (text or "(nothing rewritten)\n") for i, text in enumerate(parts))


# ----------------------------------------------------------------------------------------------------------
# Dump files and SVGs


def _write(path: str, text: str, files: list[str]) -> None:
    with open(path, "w") as f:
        f.write(text)
    files.append(path)


REPORT_FILES = ("fx_fusion_report.txt", "fx_fusion_report.json")


def _new_files(directory: str, since: float) -> list[str]:
    """Files under `directory` (not ours) modified since `since`, sorted."""
    found = []
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            if not name.startswith("fx_fusion_") and os.path.getmtime(path) >= since - 1:
                found.append(path)
    return sorted(found)


def _write_dump_files(report: FusionReport, records: list[PassRecord], dump_dir: str) -> None:
    """The rewritten regions, the whole graph right before/after the pass, and (listed now) the report."""
    os.makedirs(dump_dir, exist_ok=True)
    files = report.files
    _write(os.path.join(dump_dir, "fx_fusion_graph_before.txt"), report.graph_before, files)
    _write(os.path.join(dump_dir, "fx_fusion_graph_after.txt"), report.graph_after, files)
    for i, record in enumerate(records):
        _write(os.path.join(dump_dir, f"fx_fusion_full_graph{i}_before.py"), _code(record.full_graph_before), files)
        _write(os.path.join(dump_dir, f"fx_fusion_full_graph{i}_after.py"), _code(record.full_graph_after), files)
    files += [os.path.join(dump_dir, name) for name in REPORT_FILES]


def _write_report_files(report: FusionReport, dump_dir: str) -> None:
    text_path, json_path = (os.path.join(dump_dir, name) for name in REPORT_FILES)
    _write(text_path, str(report) + "\n", [])
    _write(json_path, report.to_json() + "\n", [])


def _svg_problem() -> Optional[str]:
    """None when FX's graph drawer can render SVGs here, else what is missing."""
    from torch.fx.passes import graph_drawer

    if not getattr(graph_drawer, "HAS_PYDOT", False):
        return SVG_MISSING + " [pydot is missing]"
    if shutil.which("dot") is None:
        return SVG_MISSING + " [Graphviz's dot is missing]"
    return None


def _write_svgs(report: FusionReport, records: list[PassRecord], svg_dir: str) -> None:
    if not records:
        report.notes.append("no SVG drawn: the pass rewrote nothing")
        return
    problem = _svg_problem()
    if problem is not None:
        report.notes.append(problem)
        return
    from torch.fx.passes.graph_drawer import FxGraphDrawer

    os.makedirs(svg_dir, exist_ok=True)
    for i, record in enumerate(records):
        for when, region in zip(("before", "after"), _regions(record)):
            if region is None:
                continue
            name = f"fx_fusion_region{i}_{when}"
            try:
                module = torch.fx.GraphModule(torch.nn.Module(), region, class_name=name)
                svg = FxGraphDrawer(module, name).get_dot_graph().create_svg()
            except Exception as exc:  # a drawing problem must not lose the report
                report.notes.append(f"could not draw {name}: {type(exc).__name__}: {exc}")
                continue
            path = os.path.join(svg_dir, name + ".svg")
            with open(path, "wb") as f:
                f.write(svg)
            report.files.append(path)


# ----------------------------------------------------------------------------------------------------------
# explain


def _entry_name(fn: Any) -> str:
    if isinstance(fn, torch.nn.Module):
        name = type(fn).__name__
    else:
        name = getattr(fn, "__name__", type(fn).__name__)
    return "fx_fusion_explain_" + (re.sub(r"\W", "_", name) or "fn")


def _unwrap(fn: Any) -> Any:
    """The user's own callable when given something already wrapped by torch.compile."""
    if isinstance(fn, torch._dynamo.eval_frame.OptimizedModule):
        return fn._orig_mod
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def _fresh_entry(fn: Callable, name: str) -> Callable:
    """A wrapper calling fn, with a code object of its own: its dynamo cache is this call's alone."""

    def entry(*args, **kwargs):
        return fn(*args, **kwargs)

    entry.__code__ = entry.__code__.replace(co_name=name)
    entry.__name__ = entry.__qualname__ = name
    return entry


def _cache_entry_counts() -> dict[int, tuple[Any, int]]:
    """{id(code): (code, number of dynamo cache entries)} for every code object dynamo has looked at."""
    from torch._dynamo import convert_frame

    counts = {}
    for ref in list(convert_frame.input_codes.seen):
        code = ref()
        if code is not None:
            entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)
            counts[id(code)] = (code, len(entries))
    return counts


def _drop_new_cache_entries(before: dict[int, tuple[Any, int]]) -> None:
    """Drop the dynamo cache entries of code objects that had none before explain's compile.

    That is the wrapper, and the user's own frames when the compile broke the graph inside them. Where the
    caller had already compiled a frame, explain's entries for it stay, but never serve the caller: they
    live in explain's own recompile region and were made for a backend the caller does not use.
    """
    for key, (code, count) in _cache_entry_counts().items():
        if count and before.get(key, (None, 0))[1] == 0:
            torch._C._dynamo.eval_frame.reset_code(code)


def explain(
    fn_or_module: Callable,
    *args: Any,
    backend_options: Optional[dict[str, Any]] = None,
    dump_dir: Optional[str] = None,
    svg_dir: Optional[str] = None,
    no_grad: bool = True,
    dynamic: Optional[bool] = None,
    **kwargs: Any,
) -> FusionReport:
    """Compile `fn_or_module` with the fx_fusion backend, call it once on `*args, **kwargs`, report the pass.

    The call runs under `torch.no_grad()` (what inference and drafting do; the pass then sees the forward
    graph alone); pass `no_grad=False` to run with autograd as the caller has it.

    backend_options  options of the fx_fusion backend (`min_layers`, `disable`, any Inductor option), as in
                     `torch.compile(m, backend="fx_fusion", options=...)`
    dump_dir         write depyf's dumps (decompiled bytecode, graphs, generated kernels) there, plus
                     fx_fusion_graph_before/after.txt (the rewritten regions), fx_fusion_full_graph*_before/
                     after.py (the whole graph right before/after the pass) and the report (.txt, .json);
                     without depyf only the fx_fusion_* files are written (see report.notes)
    svg_dir          draw each rewritten region before and after the pass as SVG (needs pydot and Graphviz;
                     without them report.notes says how to install them)
    dynamic          passed to torch.compile

    Nothing global changes: Inductor's configuration is patched only during the call (with its FX graph and
    AOTAutograd caches off, so the pass really runs), and the compiled code never serves the caller's own
    later `torch.compile` of the same module or function. The module itself is left as it was: the fused
    code reads every parameter where it lives.
    """
    options = dict(backend_options or {})
    fn = _unwrap(fn_or_module)
    entry = _fresh_entry(fn, _entry_name(fn))
    notes: list[str] = []

    depyf_ctx: Any = contextlib.nullcontext()
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        try:
            import depyf
        except ImportError:
            notes.append(DEPYF_MISSING + ": wrote only the fx_fusion_* files")
            logger.warning("fx_fusion.explain: %s", DEPYF_MISSING)
        else:
            depyf_ctx = depyf.prepare_debug(os.path.abspath(dump_dir))

    before = _cache_entry_counts()
    try:
        compiled = torch.compile(entry, backend="fx_fusion", options=options, dynamic=dynamic, isolate_recompiles=True)
    except TypeError:  # a torch without per-call recompile regions
        compiled = torch.compile(entry, backend="fx_fusion", options=options, dynamic=dynamic)
    records: list[PassRecord] = []
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False))
            stack.enter_context(
                torch._functorch.config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False)
            )
            stack.enter_context(RecordSink.collect(records, keep_graphs=True))
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message=".*You are trying to debug `torch.compile`.*")
            stack.enter_context(depyf_ctx)  # exits first: depyf reads the cache entries while they exist
            stack.enter_context(torch.no_grad() if no_grad else contextlib.nullcontext())
            start_wall, start = time.time(), time.perf_counter()
            output = compiled(*args, **kwargs)
            seconds = time.perf_counter() - start
    finally:
        _drop_new_cache_entries(before)
        del compiled, entry

    report = FusionReport(
        fused_groups=[g for r in records for g in r.fused_groups],
        rejected=[x for r in records for x in r.rejected],
        graphs=len(records),
        stages=[r.stage for r in records],
        backend_options=options,
        compile_seconds=seconds,
        notes=notes,
        records=records,
        output=output,
    )
    befores, afters = [], []
    for record in records:
        region_before, region_after = _regions(record)
        befores.append(_code(region_before) if region_before is not None else record.graph_before)
        afters.append(_code(region_after) if region_after is not None else record.graph_after)
    report.graph_before = _joined(befores)
    report.graph_after = _joined(afters)
    if not records:
        if options.get("disable"):
            report.notes.append("the pass is disabled (backend option disable=True)")
        else:
            report.notes.append("the pass did not run: nothing was compiled by Inductor (see torch._dynamo.explain)")
    if dump_dir is not None:
        if not isinstance(depyf_ctx, contextlib.nullcontext):
            report.files += _new_files(dump_dir, start_wall)
        _write_dump_files(report, records, dump_dir)
    if svg_dir is not None:
        _write_svgs(report, [r for r in records if r.fused_groups], svg_dir)
    if dump_dir is not None:  # last, so that they list every file written
        _write_report_files(report, dump_dir)
    return report
