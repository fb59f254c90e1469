"""What the fused K/V pass did in one compile: groups it fused and candidates it left alone, with why."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from typing import Iterator, Optional

import torch.fx

logger = logging.getLogger("fx_fusion")


def node_location(node: torch.fx.Node) -> str:
    """Where a graph node came from in the user's code: module path and source line when known."""
    module_path = ""
    stack = node.meta.get("nn_module_stack")
    if stack:
        module_path = list(stack.values())[-1][0]
        module_path = re.sub(r"^L\['[^']*'\]\.?", "", module_path) or "self"
    line = ""
    trace = node.meta.get("stack_trace")
    if trace:
        frames = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
        if frames:
            line = frames[-1].replace("File ", "", 1)
    text = " ".join(part for part in (module_path, f"({line})" if line else "") if part)
    return text or node.name


@dataclasses.dataclass
class FusedGroup:
    """One group of layers rewritten into a grouped GEMM plus one fused materialization op."""

    n_layers: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rotary_style: str  # "neox" or "interleaved"
    k_norm: bool
    bias: bool
    v_as_view: int  # how many V projections now read a view of the grouped GEMM output
    layers: list[str]  # source location of each absorbed layer's K projection
    rotary_matmuls_as_mul: int = 0  # outer-product matmuls of the cos/sin angles computed as multiplies
    # "per-token cos/sin" shared by the layers, "per-layer cos/sin" (each layer its own tables), or "cos/sin
    # cache + positions" (the op gathers the rows itself)
    rotary_tables: str = "per-token cos/sin"
    # heads of each absorbed layer; they differ where a layer's Q joined its K (fused in blocks of
    # num_kv_heads heads, the greatest common divisor)
    layer_heads: list[int] = dataclasses.field(default_factory=list)
    # what became of the cache writes after the group: absorbed into the op, why not, or "" (none)
    cache_writes: str = ""
    # outputs handed on as strided views of the op's output (query heads that attention reads in place)
    strided_views: int = 0

    def describe(self) -> str:
        heads = f"{self.num_kv_heads} KV heads"
        if len(set(self.layer_heads)) > 1:
            heads = f"{'+'.join(map(str, self.layer_heads))} heads in blocks of {self.num_kv_heads}"
        return (
            f"{self.n_layers} layers, {heads} x {self.head_dim}, rotary {self.rotary_dim} "
            f"{self.rotary_style}, {'k_norm' if self.k_norm else 'no k_norm'}, {'bias' if self.bias else 'no bias'}"
        ) + (f"; {self.cache_writes}" if self.cache_writes else "") + (
            f"; {self.strided_views} outputs read in place" if self.strided_views else ""
        )


@dataclasses.dataclass
class Rejection:
    """A candidate the pass left alone, and a reason a user can act on."""

    reason: str
    location: str


@dataclasses.dataclass
class PassRecord:
    """Everything one run of the pass over one graph decided."""

    fused_groups: list[FusedGroup] = dataclasses.field(default_factory=list)
    rejected: list[Rejection] = dataclasses.field(default_factory=list)
    graph_before: str = ""  # the rewritten region(s), before
    graph_after: str = ""  # and after
    stage: str = "post_grad"
    ops_inlined: int = 0  # fused op calls replaced by their traced bodies (op_lowering)
    ops_kept: list[str] = dataclasses.field(default_factory=list)  # op calls left opaque, with the reason
    gemm_epilogues: int = 0  # grouped GEMMs that normalise and rotate their K heads themselves (op_lowering)
    gemm_epilogue_notes: list[str] = dataclasses.field(default_factory=list)  # why other K norm/RoPE kernels stay
    rotary_angles_in_kernel: int = 0  # of those grouped GEMMs, how many compute RoPE's cos/sin themselves
    rotary_angle_notes: list[str] = dataclasses.field(default_factory=list)  # why the others read cos/sin tables
    # copies of the whole graph right before and after the pass, kept only while RecordSink asks for them
    full_graph_before: Optional[torch.fx.Graph] = dataclasses.field(default=None, repr=False, compare=False)
    full_graph_after: Optional[torch.fx.Graph] = dataclasses.field(default=None, repr=False, compare=False)

    def summary(self) -> str:
        fused = sum(g.n_layers for g in self.fused_groups)
        text = (
            f"fx_fusion: fused {len(self.fused_groups)} K/V group(s) ({fused} layers), "
            f"left {len(self.rejected)} candidate(s) alone"
        )
        if self.ops_inlined:
            text += f", {self.ops_inlined} fused op call(s) handed to Inductor as code"
        if self.gemm_epilogues:
            text += f", K norm/RoPE in {self.gemm_epilogues} grouped GEMM(s)"
            if self.rotary_angles_in_kernel:
                text += f" ({self.rotary_angles_in_kernel} computing their own cos/sin)"
        if self.ops_kept:
            text += f", {len(self.ops_kept)} kept as op call(s) ({self.ops_kept[0]})"
        if self.rejected:
            text += ": " + "; ".join(f"{r.location}: {r.reason}" for r in self.rejected[:3])
            if len(self.rejected) > 3:
                text += f"; ... (+{len(self.rejected) - 3} more)"
        return text


class RecordSink:
    """Collects PassRecords while active (used by `fx_fusion.explain`)."""

    _active: Optional[list[PassRecord]] = None
    keep_graphs: bool = False

    @classmethod
    def emit(cls, record: PassRecord) -> None:
        logger.info(record.summary())
        if cls._active is not None:
            cls._active.append(record)

    @classmethod
    @contextlib.contextmanager
    def collect(cls, records: list[PassRecord], keep_graphs: bool = False) -> Iterator[list[PassRecord]]:
        """Append every PassRecord emitted inside the block to `records` (with whole-graph copies if asked)."""
        previous = cls._active, cls.keep_graphs
        cls._active, cls.keep_graphs = records, keep_graphs
        try:
            yield records
        finally:
            cls._active, cls.keep_graphs = previous
