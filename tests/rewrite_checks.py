"""Helpers for the tests of the graph rewrites that run before matching (layer_unstack, select_cuts)."""

from __future__ import annotations

from typing import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx


def count_calls(graph: torch.fx.Graph, target) -> int:
    return sum(1 for node in graph.nodes if node.op == "call_function" and node.target is target)


def traced_and_rewritten(rewrite: Callable[[torch.fx.Graph], int], fn, *args) -> tuple[torch.fx.GraphModule, int, object]:
    """(`fn` traced and rewritten by `rewrite`, what `rewrite` returned, the traced graph's result before)."""
    traced = make_fx(fn, tracing_mode="fake")(*args)
    expected = traced(*args)
    rewritten = rewrite(traced.graph)
    traced.graph.lint()
    traced.recompile()
    return traced, rewritten, expected
