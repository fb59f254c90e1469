"""Outputs of a group that holds query heads, handed on as strided views of the fused op's output.

A layer's Q and K fused into one group (heads in several blocks, `split_heads`) come out of the op
token-major: [total_ctx, n_blocks, unit, head_dim] in memory. A layer's query heads span several blocks,
yet stay one strided tensor there: [tokens, heads, head_dim] with strides (n_blocks * unit * head_dim,
head_dim, 1). Rebuilt as the model spells it (blocks, reshape to the projection's shape, view, transpose),
Inductor sees a reshape of a non-contiguous buffer, which it cannot express as a strided view, and copies
Q before every attention call. One `as_strided` of the op's output says the same thing as a view, so
attention reads Q in place (and writes its output in Q's layout, which the output projection reads as is).

Why it is safe: each branch's output is first built as the model spells it, on the op's fake output.
Only where that value is a view of the op's output does the pass swap it for one `as_strided` with the
view's sizes, strides and offset; a view is fully defined by them, so every element is the one the
rebuild reads. The offset must be a number, and each size and stride a number or a product of the
graph's symbol inputs times one (dynamic shapes: a batch's stride is tokens per sequence times the row
width, a flat token count batch times tokens); anything else keeps the plain rebuild.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .kv_patterns import same_size

aten = torch.ops.aten


def spelled(value, symbols: dict):
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
    """A `spelled` term as an argument of a new node: the number, or the product built with `builder`."""
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


def as_strided_view(builder, k_all: torch.fx.Node, rebuilt: torch.fx.Node, symbols: dict) -> Optional[torch.fx.Node]:
    """`rebuilt`, a branch's output built from the op's output `k_all` as the model spells it, as one
    `as_strided` node of `k_all` (built with `builder`), or None where its value is not such a view or its
    sizes, strides or offset cannot be spelled. `symbols`: {symbol: the graph input holding it}."""
    k_val, value = builder.value(k_all), builder.value(rebuilt)
    if k_val is None or value is None or not is_token_major(k_val):
        return None
    root = k_val if k_val._base is None else k_val._base
    if value._base is not root or not is_concrete_int(value.storage_offset()):
        return None
    sizes = [spelled(size, symbols) for size in value.shape]
    strides = [spelled(stride, symbols) for stride in value.stride()]
    # A dim of size one is never stepped: any stride reads the same elements, but attention kernels check
    # every stride's alignment (CUDA's efficient attention refuses a token stride of 1 at one token), so
    # one that cannot be spelled becomes the widest step of the others, aligned as they are.
    widest = max([int(size) * int(stride) for size, stride in zip(value.shape, value.stride()) if is_concrete_int(size) and is_concrete_int(stride)] + [1])
    strides = [widest if term is None and same_size(size, 1) else term for size, term in zip(value.shape, strides)]
    if None in sizes or None in strides:
        return None
    sizes, strides = ([spell(builder, term) for term in terms] for terms in (sizes, strides))
    return builder.call(aten.as_strided.default, k_all, sizes, strides, int(value.storage_offset()))
