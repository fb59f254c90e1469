"""Token counts for the pass's probes: evaluate layouts and rotations on a few tokens, not on all of them.

The matcher proves what a K branch computes by running its layout ops on an index tensor and its rotary
region on probe values (kv_patterns.head_layout, rotary_action). Those tensors are as large as K itself,
so on static shapes the pass's cost would grow with the token count T. The ops a probe runs treat every
token alike (views, permutes, cuts and elementwise math; no token is mixed with another), so the same ops
over a few tokens prove the same thing. `ProbeSizes` maps each large token size of the probed tensors to
a small one, keeping their ratios (T -> 7, B*T -> 7*B), and `probe_call` runs one graph node with its
size arguments mapped:

- shape arguments (view, reshape, expand) are mapped; a cut (slice, narrow, select, split) is mapped only
  along a dim that was shrunk, so a feature cut that happens to equal T keeps its meaning;
- every dim of every result must have the node's own size, or that size mapped (a feature dim that
  happens to equal T is not shrunk), else `ProbeMismatch`; any failure and the caller runs the probe at
  full size: a mapping can cost time, never change an answer.

Sizes below `LARGE` are never changed, so a probe's cost is bounded by what LARGE tokens cost.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterable

import torch
import torch.fx

from .values import RESHAPES

aten = torch.ops.aten

LARGE = 512  # sizes from here on are token counts (head, rotary and head-count sizes stay below)
SMALL_TOKENS = 7  # what the smallest large token count becomes: odd, so no pair or half lines up by chance
_END = 2**62  # slice ends such as sys.maxsize mean "to the end", not a size
_CUTS = {  # op -> position of its dim argument, default dim
    aten.slice.Tensor: (1, 0),
    aten.narrow.default: (1, None),
    aten.select.int: (1, None),
    aten.split.Tensor: (2, 0),
    aten.split_with_sizes.default: (2, 0),
}


class ProbeMismatch(Exception):
    """A probe at mapped sizes did not reproduce the graph's shapes; run it at full size."""


def _ints(x) -> Iterable[int]:
    if isinstance(x, bool):
        return
    if isinstance(x, int):
        yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from _ints(item)


class ProbeSizes:
    """Callable mapping ints (and lists/tuples of them) to probe sizes; falsy when it maps nothing."""

    def __init__(self, token_sizes: Iterable[int] = ()):
        large = {n for n in _ints(list(token_sizes)) if LARGE <= n < _END}
        unit = math.gcd(*large) if large else 0
        self.mapping = {n: n // unit * SMALL_TOKENS for n in large} if unit >= LARGE else {}

    def __call__(self, x):
        if isinstance(x, bool) or not self.mapping:
            return x
        if isinstance(x, int):
            return self.mapping.get(x, x)
        if isinstance(x, (list, tuple)):
            return type(x)(self(item) for item in x)
        return x

    def __bool__(self) -> bool:
        return bool(self.mapping)


FULL_SIZE = ProbeSizes()


def _shape(value: torch.Tensor) -> list:
    """A fake tensor's shape with symbolic sizes replaced by their example values."""
    return [s.node.hint if isinstance(s, torch.SymInt) and s.node.hint is not None else s for s in value.shape]


def _unravel(flat: torch.Tensor, shape: list) -> torch.Tensor:
    """Row-major multi-indices [n, len(shape)] of flat positions into `shape`."""
    strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
    return torch.stack([flat // stride % size for stride, size in zip(strides, shape)], -1)


def _same_elements(full_in: list, probe_in: list, full_out: list, probe_out: list) -> bool:
    """Does reshaping probe_in to probe_out pick, at every output position, the input element that
    reshaping full_in to full_out picks there? (The probe is then the full reshape on fewer tokens.)"""
    if probe_in == full_in and probe_out == full_out:
        return True
    position = _unravel(torch.arange(math.prod(probe_out)), probe_out)
    full_strides = torch.tensor([math.prod(full_out[k + 1 :]) for k in range(len(full_out))], dtype=torch.int64)
    as_full = _unravel((position * full_strides).sum(-1), full_in)
    as_probe = _unravel(torch.arange(math.prod(probe_out)), probe_in)
    return torch.equal(as_full, as_probe)


def _reshape_sizes(node: torch.fx.Node, source: torch.Tensor, shape: list, sizes: ProbeSizes) -> list:
    """The reshape's target shape on the probe: its token sizes mapped, and not its features, which may
    equal a token size (T == hidden size). Tries the mappable positions, most mapped first, and takes the
    first that reshapes the probe as the graph reshapes the full tensor."""
    full_in, full_out = _shape(node.args[0].meta["val"]), _shape(node.meta["val"])
    mappable = [k for k, n in enumerate(shape) if sizes(n) != n]
    for count in range(len(mappable), -1, -1):
        for chosen in itertools.combinations(mappable, count):
            probe = [sizes(n) if k in chosen else n for k, n in enumerate(shape)]
            known = math.prod(n for n in probe if n != -1)
            if known == 0 or source.numel() % known:
                continue
            probe = [source.numel() // known if n == -1 else n for n in probe]
            if math.prod(probe) == source.numel() and _same_elements(full_in, list(source.shape), full_out, probe):
                return probe
    raise ProbeMismatch(f"{node.format_node()} regroups tokens with features")


def probe_call(node: torch.fx.Node, target, args: list, kwargs: dict, sizes: ProbeSizes):
    """target(*args, **kwargs) for `node` (args with hinted sizes, tensors at probe size), its size
    arguments mapped by `sizes`; raises ProbeMismatch unless the result is the node's result on fewer
    tokens (element by element for reshapes, by shape for the rest)."""
    if not sizes:
        return target(*args, **kwargs)
    source = args[0] if isinstance(args[0], torch.Tensor) else None
    if node.target in _CUTS:
        position, default = _CUTS[node.target]
        dim = args[position] if len(args) > position else kwargs.get("dim", default)
        if source.shape[dim] != _shape(node.args[0].meta["val"])[dim]:  # a token dim: cut it alike
            args, kwargs = sizes(args), {k: sizes(v) for k, v in kwargs.items()}
    elif node.target in RESHAPES:
        args = [source, _reshape_sizes(node, source, list(args[1]), sizes)]
    elif node.target is aten.expand.default:  # only sizes that were already there may be mapped
        new = sizes(args[1])
        offset = len(new) - source.dim()
        if any(n != o and (k < offset or source.shape[k - offset] == 1) for k, (n, o) in enumerate(zip(new, args[1]))):
            raise ProbeMismatch(f"{node.format_node()} broadcasts to a token size")
        args = [source, new]
    result = target(*args, **kwargs)
    expected = node.meta.get("val")
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    expected = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    if len(results) != len(expected):
        raise ProbeMismatch(f"{node.format_node()} at probe sizes")
    for got, full in zip(results, expected):
        if not isinstance(full, torch.Tensor) or node.target in RESHAPES:  # reshapes: checked element-wise
            continue
        full = _shape(full)
        if got.dim() != len(full) or any(n not in (f, sizes(f)) for n, f in zip(got.shape, full)):
            raise ProbeMismatch(f"{node.format_node()} at probe sizes")
    return result
