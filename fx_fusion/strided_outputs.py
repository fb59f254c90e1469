"""Outputs of a group that holds query heads, handed on as strided views of the fused op's output.

A layer's Q and K fused into one group (heads in several blocks, `split_heads`) come out of the op
token-major: [total_ctx, n_blocks, unit, head_dim] in memory. A layer's query heads span several blocks,
yet stay one strided tensor there: [tokens, heads, head_dim] with strides (n_blocks * unit * head_dim,
head_dim, 1). Rebuilt as the model spells it (blocks, reshape to the projection's shape, view, transpose),
Inductor sees a reshape of a non-contiguous buffer, which it cannot express as a strided view, and copies
Q before every attention call. One `as_strided` of the op's output says the same thing as a view, so
attention reads Q in place (and writes its output in Q's layout, which the output projection reads as is).

Why it is safe: each branch's rebuild runs on fake values from a token-major output first. Only where the
result is a view of that output, of the replaced node's shape, does the pass use `as_strided`, with that
view's strides and offset; a view is fully defined by them, so every element is the one the rebuild
reads. The offset must be a number, and each size and stride a number or a product of the graph's symbol
inputs times one (dynamic shapes: a batch's stride is tokens per sequence times the row width, a flat
token count batch times tokens); anything else keeps the plain rebuild.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .kv_patterns import same_size, val


def _rebuilt(k_all: torch.Tensor, block: int, count: int, shape: list, chain: list[torch.fx.Node]) -> torch.Tensor:
    """A branch's output built from `k_all` as the pass builds it: its blocks reshaped to `shape` (its
    source's), then the layout ops the model applied."""
    piece = k_all[block] if count == 1 else k_all[block : block + count].permute(1, 0, 2, 3)
    piece = piece.reshape(shape)
    for node in chain:
        args, kwargs = torch.fx.map_arg((node.args[1:], node.kwargs), val)
        piece = node.target(piece, *args, **kwargs)
    return piece


def _spelled(value, symbols: dict):
    """A size or stride as the graph can spell it: a number, or (graph inputs, factor) for a product of graph
    inputs' symbols times a number (a batch's stride under dynamic shapes: tokens per sequence times the row
    width); None otherwise. `symbols`: {symbol: the graph input holding it}."""
    if is_concrete_int(value):
        return int(value)
    factor, product = value.node.expr.as_coeff_Mul()
    inputs = []
    for symbol, power in product.as_powers_dict().items():
        if symbol not in symbols or not (power.is_Integer and power > 0):
            return None
        inputs += [symbols[symbol]] * int(power)
    return (inputs, int(factor)) if factor.is_Integer else None


def spell(builder, term):
    """A `_spelled` term as an argument of a new node: the number, or the product built with `builder`."""
    if isinstance(term, int):
        return term
    inputs, factor = term
    value = inputs[0]
    for other in inputs[1:]:
        value = builder.call(operator.mul, value, other)
    return builder.call(operator.mul, value, factor) if factor != 1 else value


def is_token_major(k_all: torch.Tensor) -> bool:
    """Whether the op's [n_blocks, total_ctx, unit, head_dim] output lies in memory as the views assume: a
    dense [total_ctx, n_blocks, unit, head_dim] from the start of its storage."""
    n_blocks, _, unit, head_dim = k_all.shape
    dense = (unit * head_dim, n_blocks * unit * head_dim, head_dim, 1)
    return same_size(k_all.storage_offset(), 0) and all(same_size(a, b) for a, b in zip(k_all.stride(), dense))


def views_of_token_major(fake_mode, k_all_shape: tuple, outputs: list[tuple], symbols: dict) -> list[Optional[tuple]]:
    """Per branch, (sizes, strides, storage offset) of its output as a view of the op's token-major output
    (sizes and strides as `_spelled` terms), or None where the rebuild is not such a view or cannot be
    spelled. `k_all_shape`: the output's [n_blocks, total_ctx, unit, head_dim]; `outputs`: per branch
    (first block, blocks, source shape, layout chain, the replaced node); `symbols`: {symbol: the graph
    input holding it}."""
    if fake_mode is None:
        return [None] * len(outputs)
    n_blocks, tokens, unit, head_dim = k_all_shape
    found = []
    with fake_mode:  # k_all as materialize_k(..., token_major=True) lays it out (its fake kernel's strides)
        k_all = torch.empty((tokens, n_blocks, unit, head_dim), dtype=torch.int8).permute(1, 0, 2, 3)
        for block, count, shape, chain, replaced in outputs:
            try:
                rebuilt = _rebuilt(k_all, block, count, torch.fx.map_arg(shape, val), chain)
            except Exception:  # a layout op that does not apply to a plain tensor: keep the plain rebuild
                found.append(None)
                continue
            sizes = [_spelled(size, symbols) for size in rebuilt.shape]
            # a dim of size one is never stepped: any stride reads the same elements
            strides = [1 if same_size(size, 1) else _spelled(stride, symbols) for size, stride in zip(rebuilt.shape, rebuilt.stride())]
            is_view = rebuilt._base is k_all._base and is_concrete_int(rebuilt.storage_offset())
            same_shape = len(rebuilt.shape) == len(val(replaced).shape) and all(
                same_size(a, b) for a, b in zip(rebuilt.shape, val(replaced).shape)
            )
            spelled = None not in sizes and None not in strides
            found.append((sizes, strides, int(rebuilt.storage_offset())) if is_view and same_shape and spelled else None)
    return found

