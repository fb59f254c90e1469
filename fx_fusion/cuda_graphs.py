"""Capture a warmed-up callable in a CUDA graph (used by the demo and the benchmarks to time replays)."""

from __future__ import annotations

from typing import Any, Callable

import torch


def capture(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Warm `fn` up on a side stream, capture one call into a CUDA graph; return a replaying callable.

    The callable returns the captured call's outputs (static tensors that every replay rewrites). It keeps
    `fn` alive, and with it whatever `fn` holds (the module, its inputs, its caches): the graph reads their
    memory by address, so freeing them while the graph may still replay would make it read freed memory.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn()
    torch.cuda.synchronize()

    def replay():
        graph.replay()
        return static_out

    replay.graph = graph  # keep the graph alive with the callable
    replay.captured = fn  # and what it reads
    return replay
