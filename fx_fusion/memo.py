"""Outcomes of the pass's probes memoised by plain-data keys, shared across layers and compiles.

A decoder's layers spell the same rotary region and the same head layout, so the probes that prove them
(`rotary_action._identify_on`, `kv_patterns._simulate_heads`) would run once per layer with identical
inputs. Their outcomes are kept by a key that describes every input as plain data (`plain`): nothing
hashed by identity, so a key holds no graph and two keys are equal only when the probes compute alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

PLAIN_VALUES = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def plain(x) -> Any:
    """`x` as hashable plain data that tells apart what Python equates (1, 1.0 and True): lists, tuples and
    dicts of PLAIN_VALUES and None; TypeError for anything else (a tensor, a node, an object)."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(plain(e) for e in x))
    if isinstance(x, dict):
        return ("dict", *sorted((key, plain(v)) for key, v in x.items()))
    if x is None or isinstance(x, PLAIN_VALUES):
        return (type(x).__name__, x)
    raise TypeError(f"{type(x).__name__} is not plain data")


class OutcomeMemo:
    """Outcomes of a pure computation by key: its result, or the exception of one of `errors` it raised
    (kept as type and message, re-raised on a hit). Bounded: cleared when `limit` keys are held."""

    def __init__(self, errors: tuple[type[Exception], ...], limit: int = 1024):
        self.errors = errors
        self.limit = limit
        self._outcomes: dict = {}

    def __len__(self) -> int:
        return len(self._outcomes)

    def __iter__(self):
        return iter(self._outcomes)

    def outcome(self, key: Callable[[], Any], compute: Callable[[], Any]) -> Any:
        """compute(), or its memoised outcome under key(); a key() that cannot be formed (TypeError: an input
        that is not plain data; AttributeError: one without a tensor value) computes without the memo."""
        try:
            k = key()
            found = self._outcomes.get(k)
        except (TypeError, AttributeError):
            k, found = None, None
        if found is None:
            try:
                found = ("value", compute())
            except self.errors as error:
                found = ("error", type(error), str(error))
            if k is not None:
                if len(self._outcomes) >= self.limit:
                    self._outcomes.clear()
                self._outcomes[k] = found
        if found[0] == "error":
            raise found[1](found[2])
        return found[1]
